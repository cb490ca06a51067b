"""Bad input to a fused layer: a clear error, and NO state change.

Every failing call is checked to leave ``running_mean``, ``running_var``,
``num_batches_tracked`` and the parameters exactly as they were (compared with clones),
so a caught error never corrupts a model mid-training.
"""
from __future__ import annotations

import copy
import re
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Type

import pytest
import torch
from torch import Tensor, nn

from convbn.functional.activations import ACTIVATIONS
from convbn.autograd.dispatch import conv_bn_act
from convbn.functional.strategies import STRATEGIES
from convbn.nn.fused_conv_bn import FusedConvBN1d, FusedConvBN2d, FusedConvBN3d



def _snapshot(m: nn.Module) -> Dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@contextmanager
def unchanged(m: nn.Module) -> Iterator[None]:
    """Assert that every parameter and buffer of ``m`` is bit-identical after the block."""
    before = _snapshot(m)
    try:
        yield
    finally:
        after = _snapshot(m)
        assert before.keys() == after.keys()
        for k in before:
            assert torch.equal(before[k], after[k]), f"{k} changed by a failing call"


def _stateful(strategy: str = "recompute_bn", cls: Type[nn.Module] = FusedConvBN2d, **kw: Any) -> nn.Module:
    m = cls(3, 4, 3, strategy=strategy, **kw)
    m.train()
    # run one good step so the stats are not at their defaults
    out = m(torch.randn(2, 3, *([6] * (len(m.conv.kernel_size)))))
    out.backward(torch.randn(out.shape))
    return m


STRATEGY_PARAMS = pytest.mark.parametrize("strategy", STRATEGIES)


@STRATEGY_PARAMS
@pytest.mark.parametrize("momentum", [0.1, None])
def test_wrong_rank(strategy: str, momentum: Optional[float]) -> None:
    m = _stateful(strategy, momentum=momentum)
    eager = nn.Sequential(m.conv, m.bn)  # eager's exception type: the conv's or the BatchNorm's
    for bad in (torch.randn(3, 6, 6), torch.randn(2, 3, 6, 6, 6), torch.randn(3)):
        with pytest.raises(Exception) as ref:
            eager(bad)
        with unchanged(m), pytest.raises(ref.type, match=r"expected 4D input .* got %dD" % bad.dim()):
            m(bad)


def test_wrong_rank_1d_3d() -> None:
    m1 = _stateful(cls=FusedConvBN1d)
    with unchanged(m1), pytest.raises(RuntimeError, match="expected 3D input"):  # conv1d's own error type
        m1(torch.randn(2, 3, 6, 6))
    m3 = _stateful(cls=FusedConvBN3d)
    with unchanged(m3), pytest.raises(ValueError, match="expected 5D input"):  # unbatched: BatchNorm3d's
        m3(torch.randn(2, 3, 6, 6))


@STRATEGY_PARAMS
def test_channel_mismatch(strategy: str) -> None:
    m = _stateful(strategy)
    with unchanged(m), pytest.raises(RuntimeError, match="to have 3 channels, but got 5 channels"):
        m(torch.randn(2, 5, 6, 6))
    g = _stateful(strategy, groups=1)
    with unchanged(g), pytest.raises(RuntimeError, match="channels"):
        g(torch.randn(2, 1, 6, 6))


@pytest.mark.parametrize("strategy", ["recompute_conv", "recompute_bn"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_one_value_per_channel_in_training(strategy: str, momentum: Optional[float]) -> None:
    """As ``nn.BatchNorm`` raises: ValueError, and the stats (incl. ``num_batches_tracked``) stay put."""
    m = _stateful(strategy, momentum=momentum)
    x = torch.randn(1, 3, 3, 3)  # conv output 1x4x1x1: one value per channel
    eager = nn.Sequential(copy.deepcopy(m.conv), copy.deepcopy(m.bn))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        eager(x)
    with unchanged(m), pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        m(x)
    # the same input is fine in eval mode (running statistics) and with the frozen strategy
    m.eval()
    assert m(x).shape == (1, 4, 1, 1)
    f = _stateful("frozen")
    with unchanged(f):
        assert f(x).shape == (1, 4, 1, 1)


def test_one_value_per_channel_no_running_stats_eval() -> None:
    """``track_running_stats=False`` in eval still normalises with batch stats: still an error."""
    m = FusedConvBN2d(3, 4, 3, track_running_stats=False).eval()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        m(torch.randn(1, 3, 3, 3))


def test_unknown_activation_lists_allowed() -> None:
    with pytest.raises(ValueError) as info:
        FusedConvBN2d(3, 4, 3, activation="swish")
    msg = str(info.value)
    assert "'swish'" in msg
    for name in ACTIVATIONS:
        assert name in msg, name
    with pytest.raises(TypeError, match="Softsign"):
        FusedConvBN2d(3, 4, 3, activation=nn.Softsign())
    with pytest.raises(TypeError, match="activation must be"):
        FusedConvBN2d(3, 4, 3, activation=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="swish"):
        conv_bn_act(torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3), None, None, None, None, None, activation="swish")


def test_unknown_strategy_lists_allowed() -> None:
    for bad in ("recompute", "auto_", "", None):
        with pytest.raises(ValueError) as info:
            FusedConvBN2d(3, 4, 3, strategy=bad)  # type: ignore[arg-type]
        msg = str(info.value)
        assert repr(bad) in msg
        for name in STRATEGIES:
            assert name in msg, name
    with pytest.raises(ValueError, match=re.escape(repr(STRATEGIES))):
        FusedConvBN2d.from_modules(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), strategy="fast")
    with pytest.raises(ValueError, match="recompute_conv"):
        conv_bn_act(torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3), None, None, None, None, None, strategy="fast")


@STRATEGY_PARAMS
def test_dtype_mismatch(strategy: str) -> None:
    m = _stateful(strategy)
    with unchanged(m), pytest.raises(RuntimeError, match=r"input dtype \(torch.float64\) and weight dtype \(torch.float32\)"):
        m(torch.randn(2, 3, 6, 6, dtype=torch.float64))
    m.double()
    with unchanged(m), pytest.raises(RuntimeError, match="dtype"):
        m(torch.randn(2, 3, 6, 6))


@STRATEGY_PARAMS
def test_device_mismatch(strategy: str) -> None:
    """'meta' input vs CPU weights (and CPU input vs a 'meta' running stat): clear error, nothing moved."""
    m = _stateful(strategy)
    with unchanged(m), pytest.raises(RuntimeError, match=r"input is on meta but a weight/buffer is on cpu.*\.to\("):
        m(torch.randn(2, 3, 6, 6, device="meta"))
    x = torch.randn(2, 3, 6, 6)
    w = torch.randn(4, 3, 3, 3)
    rm, rv = torch.zeros(4, device="meta"), torch.ones(4, device="meta")
    with pytest.raises(RuntimeError, match="input is on cpu but a weight/buffer is on meta"):
        conv_bn_act(x, w, None, None, None, rm, rv, strategy=strategy)


@STRATEGY_PARAMS
def test_too_small_input(strategy: str) -> None:
    m = _stateful(strategy)
    with unchanged(m), pytest.raises(RuntimeError, match=r"too small .* output would have size \(0, 0\)"):
        m(torch.randn(2, 3, 2, 2))
    d = _stateful(strategy, dilation=2)  # effective kernel 5: 6x6 works (above), 4x6 does not
    with unchanged(d), pytest.raises(RuntimeError, match=r"too small .* size \(0, 2\)"):
        d(torch.randn(2, 3, 4, 6))


def test_frozen_needs_running_stats() -> None:
    m = FusedConvBN2d(3, 4, 3, strategy="frozen", track_running_stats=False)
    with unchanged(m), pytest.raises(ValueError, match="track_running_stats=False.*recompute_bn"):
        m(torch.randn(2, 3, 6, 6))


def test_functional_errors_leave_running_stats() -> None:
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    w = torch.randn(4, 3, 3, 3)
    calls: Dict[str, Callable[[], Tensor]] = {
        "rank": lambda: conv_bn_act(torch.randn(3, 6, 6), w, None, None, None, rm, rv),
        "channels": lambda: conv_bn_act(torch.randn(2, 2, 6, 6), w, None, None, None, rm, rv),
        "one value": lambda: conv_bn_act(torch.randn(1, 3, 3, 3), w, None, None, None, rm, rv),
        "too small": lambda: conv_bn_act(torch.randn(2, 3, 2, 6), w, None, None, None, rm, rv),
        "dtype": lambda: conv_bn_act(torch.randn(2, 3, 6, 6).double(), w, None, None, None, rm, rv),
        "weight": lambda: conv_bn_act(torch.randn(2, 3, 6, 6), torch.randn(4, 3), None, None, None, rm, rv),
    }
    for name, call in calls.items():
        with pytest.raises((ValueError, RuntimeError)):
            call()
        assert torch.equal(rm, rm0) and torch.equal(rv, rv0), name


def test_errors_match_eager_types() -> None:
    """The fused layer raises the exception *type* eager Conv -> BN raises for the same input."""
    fused = FusedConvBN2d(3, 4, 3)
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    for bad in (torch.randn(1, 3, 3, 3), torch.randn(2, 5, 6, 6), torch.randn(2, 3, 6, 6).double()):
        with pytest.raises(Exception) as e_info:
            eager(bad)
        with pytest.raises(Exception) as f_info:
            fused(bad)
        assert isinstance(f_info.value, type(e_info.value)), (type(f_info.value), type(e_info.value))


def test_from_modules_wrong_types() -> None:
    bn = nn.BatchNorm2d(4)
    with pytest.raises(TypeError, match="expects an nn.Conv2d or nn.ConvTranspose2d, but got Conv1d"):
        FusedConvBN2d.from_modules(nn.Conv1d(3, 4, 3), bn)
    with pytest.raises(TypeError, match="but got ConvTranspose1d"):
        FusedConvBN2d.from_modules(nn.ConvTranspose1d(3, 4, 3), bn)
    with pytest.raises(TypeError, match="Linear"):
        FusedConvBN2d.from_modules(nn.Linear(3, 4), bn)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a BatchNorm module, but got GroupNorm"):
        FusedConvBN2d.from_modules(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Conv3d"):
        FusedConvBN3d.from_modules(nn.Conv2d(3, 4, 3), bn)


def test_from_modules_mismatched_channels() -> None:
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(5)
    before = _snapshot(bn)
    with pytest.raises(ValueError, match=r"num_features=5 does not match the conv's out_channels=4"):
        FusedConvBN2d.from_modules(conv, bn)
    assert all(torch.equal(before[k], v) for k, v in bn.state_dict().items())


def test_from_modules_accepts_subclasses() -> None:
    """``isinstance`` matching: SyncBatchNorm / custom Conv subclasses are accepted."""

    class MyConv(nn.Conv2d):
        pass

    fused = FusedConvBN2d.from_modules(MyConv(3, 4, 3), nn.SyncBatchNorm(4))
    assert isinstance(fused.conv, MyConv)


def test_bad_constructor_options() -> None:
    with pytest.raises(ValueError, match="padding_mode"):
        FusedConvBN2d(3, 4, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match="same"):
        FusedConvBN2d(3, 4, 3, padding="same", stride=2)
    with pytest.raises(ValueError, match="groups"):
        FusedConvBN2d(3, 4, 3, groups=2)


@pytest.mark.parametrize("budget", (0, -0.5, 1.5, 5, True, "0.5"))
def test_convert_memory_budget_outside_0_1_is_an_error_naming_it(budget) -> None:
    import convbn

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(ValueError, match=r"memory_budget must be a fraction .* in \(0, 1\], but got " + repr(budget).replace(".", r"\.")):
        convbn.convert(model, example_inputs=torch.randn(2, 3, 8, 8), memory_budget=budget)
    # the rejected call changed nothing: the model still converts, and trains fused
    from fusion_checks import assert_chain_ran, assert_fused

    fast = convbn.convert(model, strategy="recompute_conv")
    assert_fused(fast, pairs=1, chains=1)
    assert_chain_ran(fast(torch.randn(2, 3, 8, 8, requires_grad=True)), calls=1)
