"""What each fused strategy keeps for backward, in bytes, asserted exactly.

Expected bytes are *derived* from shapes and element sizes (never hard-coded):

* ``recompute_conv`` keeps the conv input ``x`` and the parameters plus the ``(C,)``
  batch statistics ``mean``/``invstd``; no ``N x C x H x W`` tensor besides ``x``.
* ``recompute_bn`` keeps ``x`` and the conv output ``y`` (plus the same small tensors).
* ``frozen`` keeps ``x``, the parameters and copies of the running statistics; with the
  identity activation nothing of size ``N x C_out x ...``; with ReLU-family activations
  the output, with smooth ones the pre-activation (both of the output's shape).

Eager ``Conv -> BN -> act`` keeps ``x``, ``y`` and the activation output: strictly more.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import nn

from convbn.memory import SavedBytes, saved_bytes
from convbn.nn.fused_conv_bn import FusedConvBN1d, FusedConvBN2d, FusedConvBN3d

FUSED = {1: FusedConvBN1d, 2: FusedConvBN2d, 3: FusedConvBN3d}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
SPATIAL = {1: (10,), 2: (8, 6), 3: (4, 5, 6)}
ACT_MODULES = {None: nn.Identity, "relu": nn.ReLU, "relu6": nn.ReLU6, "leaky_relu": nn.LeakyReLU, "silu": nn.SiLU, "gelu": nn.GELU, "hardswish": nn.Hardswish}



def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the ``(C,)`` statistics the batch-norm kernel returns (float32 at least)."""
    return torch.promote_types(dtype, torch.float32)


def conv_out_shape(m: nn.Module, in_shape: Sequence[int]) -> Tuple[int, ...]:
    with torch.no_grad():
        return tuple(m.conv(torch.zeros(in_shape, dtype=m.conv.weight.dtype)).shape)


def padded_shape(m: nn.Module, in_shape: Sequence[int]) -> Tuple[int, ...]:
    """Shape of the input the convolution kernel sees (``nn.ConvNd`` pre-pads non-zero modes)."""
    conv = m.conv
    if conv.padding_mode == "zeros":
        return tuple(in_shape)
    return tuple(in_shape[:2]) + tuple(s + 2 * p for s, p in zip(in_shape[2:], conv.padding))


def params_counted() -> bool:
    """Whether the fused Functions hand their ``nn.Parameter`` inputs to ``save_for_backward``.

    SPEC §3 counts parameters in saved bytes; a Function may instead hold parameters by
    reference on ``ctx`` (the module keeps them alive anyway), in which case the saved-tensor
    hooks do not see them. Probe once with a layer whose weight shape is unique; every
    expectation below is then exact for that convention, and *all* parameters must follow it.
    """
    m = FusedConvBN1d(2, 3, 5, strategy="recompute_conv")
    shapes = [s for _, s, _, _ in saved_bytes(m, torch.randn(2, 2, 9)).shapes]
    return tuple(m.conv.weight.shape) in shapes


PARAMS_COUNTED = params_counted()


def expected_fused(m: nn.Module, in_shape: Sequence[int]) -> Tuple[int, List[Tuple[int, ...]]]:
    """(total bytes, shapes of the activation-sized saved tensors) derived for one fused layer."""
    dtype = m.conv.weight.dtype
    c = m.conv.out_channels
    x_shape = padded_shape(m, in_shape)
    y_shape = conv_out_shape(m, in_shape)
    small: List[Sequence[int]] = []
    if PARAMS_COUNTED:
        small += [m.conv.weight.shape]
        small += [(c,)] * ((m.conv.bias is not None) + 2 * (m.bn.weight is not None))
    big = [x_shape]
    if m.conv.padding_mode in ("reflect", "replicate"):
        # PyTorch's reflection/replication pad backward keeps the unpadded input too (as eager does)
        big.append(tuple(in_shape))
    frozen = m.strategy == "frozen" or not m.bn.training
    if frozen:
        small_stats = [(c,), (c,)]  # copies of running_mean / running_var
        if m.activation.name != "identity":
            big.append(y_shape)  # output (ReLU family) or pre-activation (smooth)
    else:
        small_stats = [(c,), (c,)]  # batch mean / invstd
        if m.strategy == "recompute_bn":
            big.append(y_shape)
    total = sum(nbytes(s, dtype) for s in big + small)
    sdt = dtype if frozen else stats_dtype(dtype)
    total += sum(nbytes(s, sdt) for s in small_stats)
    return total, big


def big_shapes(r: SavedBytes, batch: int, ndim: int) -> List[Tuple[int, ...]]:
    """The N x C x ... shapes among the saved storages."""
    return [s for _, s, _, _ in r.shapes if len(s) == ndim and s[0] == batch]


CASES: List[Tuple[str, int, Dict[str, Any]]] = [
    ("base", 2, dict(padding=1)),
    ("no_bias", 2, dict(padding=1, bias=False)),
    ("no_affine", 2, dict(padding=1, affine=False)),
    ("no_bias_no_affine_1d", 1, dict(padding=1, bias=False, affine=False)),
    ("strided_3d", 3, dict(stride=2, padding=1)),
    ("grouped", 2, dict(groups=2, padding=1)),
    ("reflect", 2, dict(padding=2, padding_mode="reflect")),
    ("valid", 2, dict(padding=0, dilation=2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("act", [None, "relu", "silu"])
@pytest.mark.parametrize("strategy", ["recompute_conv", "recompute_bn", "frozen"])
@pytest.mark.parametrize("name,dims,options", CASES, ids=[c[0] for c in CASES])
def test_saved_bytes_exact(name: str, dims: int, options: Dict[str, Any], strategy: str, act: Optional[str], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    m = FUSED[dims](4, 6, 3, activation=act, strategy=strategy, dtype=dtype, **options)
    in_shape = (3, 4, *SPATIAL[dims])
    x = torch.randn(in_shape, dtype=dtype, requires_grad=True)
    r = saved_bytes(m, x)
    total, big = expected_fused(m, in_shape)
    assert Counter(big_shapes(r, 3, dims + 2)) == Counter(big), r.shapes
    assert r.total == total, r.shapes
    assert r.count == len(r.shapes) and r.total == sum(b for *_, b in r.shapes)


def test_strategy_keeps_what_it_says() -> None:
    """The headline claims, spelled out on one layer (N x C x H x W-wise)."""
    in_shape = (4, 3, 8, 8)
    x = torch.randn(in_shape, requires_grad=True)
    found = {}
    for strategy, act in (("recompute_conv", "relu"), ("recompute_bn", "relu"), ("frozen", None), ("frozen", "relu")):
        m = FusedConvBN2d(3, 5, 3, padding=1, activation=act, strategy=strategy)
        found[strategy, act] = big_shapes(saved_bytes(m, x), 4, 4)
    y = (4, 5, 8, 8)
    assert found["recompute_conv", "relu"] == [in_shape]  # no N x C_out x H x W tensor at all
    assert sorted(found["recompute_bn", "relu"]) == sorted([in_shape, y])
    assert found["frozen", None] == [in_shape]
    assert sorted(found["frozen", "relu"]) == sorted([in_shape, y])


@pytest.mark.parametrize("act", [None, "relu", "gelu"])
@pytest.mark.parametrize("strategy", ["recompute_conv", "recompute_bn", "frozen"])
def test_eager_keeps_more(strategy: str, act: Optional[str]) -> None:
    """Eager keeps x, y and (for a non-identity activation) the activation's input/output;
    the fused layer saves exactly the activation-sized tensors it drops less."""
    torch.manual_seed(0)
    in_shape = (3, 4, 7, 7)
    m = FusedConvBN2d(4, 6, 3, padding=1, activation=act, strategy=strategy)
    eager = nn.Sequential(m.conv, m.bn, ACT_MODULES[act]())  # shares the parameters, no copy needed
    if strategy == "frozen":
        eager[1].eval()
    x = torch.randn(in_shape, requires_grad=True)
    r_fused = saved_bytes(m, x)
    r_eager = saved_bytes(eager, x)
    y_shape = (3, 6, 7, 7)
    eager_big = big_shapes(r_eager, 3, 4)
    assert Counter(eager_big) == Counter([in_shape, y_shape] + ([y_shape] if act is not None else []))
    fused_big = big_shapes(r_fused, 3, 4)
    assert not Counter(fused_big) - Counter(eager_big), "fused keeps an activation eager does not"
    dropped = Counter(eager_big) - Counter(fused_big)
    if strategy == "recompute_bn" and act is None:
        # nothing to drop: eager keeps only x and y too (fused saves no more)
        assert not dropped
        assert r_fused.total <= r_eager.total
    else:
        assert sum(dropped.values()) >= 1
        big_bytes = lambda shapes: sum(nbytes(s, torch.float32) for s in shapes)  # noqa: E731
        assert r_eager.total - r_fused.total >= big_bytes(dropped.elements())


def test_saved_bytes_two_layers_per_module() -> None:
    """Two fused layers in a model: bytes attributed per layer; the second keeps the first's
    output as its input (counted once, under the layer that saved it first)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            a=FusedConvBN2d(3, 4, 3, padding=1, activation="relu", strategy="recompute_conv"),
            b=FusedConvBN2d(4, 5, 3, padding=1, activation="relu", strategy="recompute_bn"),
        )
    )
    in_shape = (2, 3, 6, 6)
    x = torch.randn(in_shape, requires_grad=True)
    r = saved_bytes(model, x, per_module=True)
    ta, big_a = expected_fused(model.a, in_shape)
    tb, big_b = expected_fused(model.b, (2, 4, 6, 6))
    assert r.per_module == {"a": ta, "b": tb}
    assert r.total == ta + tb
    assert Counter(big_shapes(r, 2, 4)) == Counter(big_a + big_b)


def test_saved_bytes_no_grad_input() -> None:
    """An input that does not need grad is still kept (the weight gradient needs it)."""
    m = FusedConvBN2d(3, 4, 3, strategy="recompute_conv")
    x = torch.randn(2, 3, 6, 6)
    total, big = expected_fused(m, x.shape)
    r = saved_bytes(m, x)
    assert r.total == total and big_shapes(r, 2, 4) == big


def test_parameters_all_or_nothing() -> None:
    """Whatever the convention, it holds for every parameter: exactly the conv weight, conv
    bias, BN weight and BN bias are (or none is) among the saved storages."""
    m = FusedConvBN1d(2, 3, 5, strategy="recompute_bn", activation="relu")
    in_shape = (2, 2, 9)
    r = saved_bytes(m, torch.randn(in_shape))
    sizes = Counter(s for _, s, _, _ in r.shapes)
    assert sizes[tuple(m.conv.weight.shape)] == int(PARAMS_COUNTED)
    # (3,)-shaped storages: batch mean + invstd, plus conv bias, BN weight, BN bias when counted
    assert sizes[(3,)] == 2 + 3 * int(PARAMS_COUNTED)


def test_saved_bytes_updates_running_stats_once() -> None:
    """``saved_bytes`` runs one training forward: stats advance exactly as one step would."""
    m = FusedConvBN2d(3, 4, 3)
    saved_bytes(m, torch.randn(2, 3, 6, 6))
    assert int(m.bn.num_batches_tracked) == 1
