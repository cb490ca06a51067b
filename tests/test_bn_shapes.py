"""BatchNorm shapes real models write that convert / fold left as they were (issue 22, item 7).

One from-scratch replica per shape, each run against eager PyTorch: a training step of
``convbn.convert`` (with and without ``example_inputs``) gives the same outputs, every
gradient, running statistics and ``num_batches_tracked``; the report says what was fused and
the fused path ran (the BatchNorm module itself is never called); ``convbn.explain`` reports
the same; ``convbn.fold`` folds where it is exact and its outputs equal eval-mode eager:

* a pre-activation ``BN -> act`` whose output two convs read (body and projection shortcut),
  over a block input that is no conv output (``shared_heads.py``, ``nn/bn_shared.py``);
* ``Linear -> transpose(1, 2) -> BatchNorm1d`` over tokens (``token_bn.py``, and fold's
  ``fold_preceding_tokens``);
* a BatchNorm after the channel concatenation of several convs' outputs, mixed kernel
  sizes: convert gives each conv its slice of the BatchNorm (``cat_norms.py``,
  ``nn/bn_slice.py``), fold folds into each conv (``fold_preceding_cat``); also written as
  ``zip(convs, torch.split(x, sizes, 1))``, which the tracer now iterates.
"""
from __future__ import annotations

import copy
import pickle
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn
from convbn.nn import FusedChain
from convbn.nn.bn_shared import SharedBatchStats
from convbn.nn.bn_slice import BatchNormSlice


class PreActProjection(nn.Module):
    """A downsampling pre-activation unit: ``z = relu(bn(x))`` read by the body and the shortcut."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.body1 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.act2 = nn.ReLU()
        self.body2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.proj = nn.Conv2d(8, 16, 1, stride=2, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x * 2.0 + 1.0  # the unit's input is no conv output (the previous unit's sum)
        z = self.act(self.bn(x))
        return self.body2(self.act2(self.bn2(self.body1(z)))) + self.proj(z)


class TokenMLP(nn.Module):
    """Linear on (B, L, C) tokens, BatchNorm1d over its features through a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 12)
        self.bn = nn.BatchNorm1d(12)
        self.act = nn.GELU()
        self.head = nn.Linear(12, 4)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        y = self.bn(self.fc(tokens).transpose(1, 2)).transpose(1, 2)
        return self.head(self.act(y))


class MixedKernel(nn.Module):
    """Split channels, convs of kernel 3 and 5, concatenate, BN -> act -> conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 1)
        self.k3 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.k5 = nn.Conv2d(3, 4, 5, padding=2, bias=True)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x: Tensor) -> Tensor:
        a, b = torch.split(self.stem(x), [3, 3], 1)
        return self.out(self.act(self.bn(torch.cat([self.k3(a), self.k5(b)], 1))))


class ZipMix(nn.Module):
    """MixConv as pytorchcv / geffnet write it: ``zip`` over a split into listed sizes, three
    kernel sizes, one BatchNorm (cumulative average: ``momentum=None``) and SiLU after the
    concatenation, then a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 9, 1)
        self.sizes = [3, 3, 3]
        self.convs = nn.ModuleList(nn.Conv2d(3, c, k, padding=k // 2, bias=False)
                                   for c, k in zip((4, 2, 2), (3, 5, 7)))
        self.bn = nn.BatchNorm2d(8, momentum=None)
        self.act = nn.SiLU()
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x: Tensor) -> Tensor:
        parts = [conv(p) for conv, p in zip(self.convs, torch.split(self.stem(x), self.sizes, 1))]
        return self.out(self.act(self.bn(torch.cat(parts, 1))))


def _bn_calls(model: nn.Module) -> Dict[str, int]:
    """Forward calls of each BatchNorm module, counted by an observer hook (fused layers stay fused)."""
    calls: Dict[str, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, _BatchNorm) and not isinstance(m, SharedBatchStats):
            def hook(mod: Any, args: Any, out: Any, name: str = name) -> None:
                calls[name] = calls.get(name, 0) + 1
            hook.convbn_observer = True  # type: ignore[attr-defined]
            m.register_forward_hook(hook)
    return calls


def _step(model: nn.Module, x: Tensor, g: Optional[Tensor] = None) -> Dict[str, Any]:
    torch.manual_seed(3)
    out = model(x)
    if g is None:
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    out.backward(g)
    state = model.state_dict(keep_vars=True)
    return {"out": out.detach(), "g": g,
            "grads": {k: v.grad for k, v in state.items() if isinstance(v, nn.Parameter)},
            "buffers": {k: v.detach().clone() for k, v in state.items() if not isinstance(v, nn.Parameter)}}


def _assert_same_step(ref: Dict[str, Any], got: Dict[str, Any]) -> None:
    torch.testing.assert_close(got["out"], ref["out"])
    assert got["grads"].keys() == ref["grads"].keys()
    for k, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][k], g, msg=lambda m, k=k: f"gradient of {k}: {m}")
    assert got["buffers"].keys() == ref["buffers"].keys()
    for k, b in ref["buffers"].items():
        torch.testing.assert_close(got["buffers"][k], b, msg=lambda m, k=k: f"buffer {k}: {m}")


def _fused(report: Any) -> Dict[str, List[Optional[str]]]:
    found: Dict[str, List[Optional[str]]] = {}
    for o in report.outcomes:
        if o.result == "fused":
            found.setdefault(o.batchnorm, []).append(o.layer)
    return found


def _chains(model: nn.Module) -> List[FusedChain]:
    return [m for _, m in convbn.fused_modules(model) if isinstance(m, FusedChain)]


def _heads(model: nn.Module) -> List[Tuple[str, str]]:
    """``(BatchNorm, conv after it)`` of every pre-activation head of the fused chains."""
    return sorted((c.layers[0].names[1], c.layers[1].names[0]) for c in _chains(model)
                  if c.layers[0].conv_owner is None)


CASES = {
    "preact_projection": (PreActProjection, (2, 8, 8, 8), {"bn", "bn2"}, [("bn", "body1"), ("bn", "proj")]),
    "token_mlp": (TokenMLP, (2, 3, 4, 4), {"bn"}, []),
    "mixed_kernel": (MixedKernel, (2, 3, 8, 8), {"bn"}, []),
    "mixed_kernel_zip": (ZipMix, (2, 3, 8, 8), {"bn"}, []),
}


@pytest.mark.parametrize("with_inputs", [True, False], ids=["example_inputs", "no_example_inputs"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_convert_fuses_the_shape_and_trains_like_eager(case: str, with_inputs: bool) -> None:
    cls, shape, want, heads = CASES[case]
    torch.manual_seed(0)
    model = cls().double()
    x = torch.randn(shape, dtype=torch.float64)
    eager = copy.deepcopy(model)
    converted = convbn.convert(copy.deepcopy(model), example_inputs=x if with_inputs else None)
    report = converted.convbn_report
    assert set(_fused(report)) == want
    assert not report.skipped
    assert _chains(converted)
    assert _heads(converted) == heads
    calls = _bn_calls(converted)
    for i in range(2):  # two steps: running statistics and num_batches_tracked advance alike
        calls.clear()  # (without example_inputs the first call checks itself against the original once)
        ref = _step(eager, x)
        _assert_same_step(ref, _step(converted, x, ref["g"]))
    assert calls == {}, f"the fused path did not run: BatchNorm modules called {calls}"
    assert int(converted.state_dict()["bn.num_batches_tracked"]) == 2
    eager.eval(), converted.eval()
    torch.testing.assert_close(converted(x), eager(x))


def test_preact_projection_keeps_less_than_eager() -> None:
    """The heads rebuild ``relu(bn(x))`` in backward: neither conv keeps it."""
    torch.manual_seed(0)
    model, x = PreActProjection(), torch.randn(2, 8, 8, 8)
    report = convbn.explain(model, x)
    assert set(_fused(report)) == {"bn", "bn2"} and not report.skipped
    assert report.saved_bytes < report.eager_saved_bytes
    converted = convbn.convert(model, example_inputs=x)
    assert len(_chains(converted)) == 2  # [head(bn), body1 -> bn2 -> body2] and [head(bn's view), proj]
    assert _heads(converted) == [("bn", "body1"), ("bn", "proj")]


def test_shared_head_in_eval_mode_reads_running_statistics() -> None:
    torch.manual_seed(0)
    model, x = PreActProjection(), torch.randn(2, 8, 8, 8)
    converted = convbn.convert(copy.deepcopy(model), example_inputs=x)
    for m in (model, converted):
        m(x)  # one training step each: running statistics move
    model.eval(), converted.eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(x), model(x))
    assert not any(isinstance(m, SharedBatchStats) for m in converted.modules())  # never registered
    assert converted.state_dict().keys() == model.state_dict().keys()


def _fold(model: nn.Module, x: Tensor) -> nn.Module:
    torch.manual_seed(0)
    for _ in range(2):
        model(x)  # running statistics away from their initial values
    model.eval()
    folded = convbn.fold(copy.deepcopy(model), example_inputs=x)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-4, atol=1e-5)
    return folded


def test_fold_bn_after_channel_concatenation_into_each_conv() -> None:
    torch.manual_seed(0)
    folded = _fold(MixedKernel(), torch.randn(2, 3, 8, 8))
    done = {o.batchnorm: o.layer for o in folded.convbn_report.folded}
    assert done == {"bn": "k3, k5"}
    assert not any(isinstance(m, _BatchNorm) for m in folded.modules())


def test_fold_bn_after_concatenation_with_a_non_layer_piece_is_left_with_reason() -> None:
    class CatInput(MixedKernel):
        def forward(self, x: Tensor) -> Tensor:
            a, b = torch.split(self.stem(x), [3, 3], 1)
            return self.out(self.act(self.bn(torch.cat([self.k3(a), self.k5(b) * 2.0], 1))))

    torch.manual_seed(0)
    folded = _fold(CatInput(), torch.randn(2, 3, 8, 8))
    (left,) = folded.convbn_report.skipped
    assert "every piece is a conv/linear output" in left.reason


@pytest.mark.parametrize("cls", [MixedKernel, ZipMix])
def test_bn_after_concatenation_is_one_slice_per_conv_fused_with_its_tail(cls: type) -> None:
    """Each conv's chain normalises its own channels and runs the activation; the
    concatenation and the BatchNorm module are gone from the graph, bitwise as eager."""
    torch.manual_seed(0)
    model, x = cls(), torch.randn(2, 3, 8, 8)
    eager = copy.deepcopy(model)
    converted = convbn.convert(copy.deepcopy(model), example_inputs=x)
    chains = [c for c in _chains(converted) if any(isinstance(l.bn, BatchNormSlice) for l in c.layers)]
    pieces = sorted((l.bn.start, l.bn.stop, l.bn.counts) for c in chains for l in c.layers)
    assert pieces == ([(0, 4, True), (4, 8, False)] if cls is MixedKernel else
                      [(0, 4, True), (4, 6, False), (6, 8, False)])
    pairs = [p for p in converted.convbn_report.pairs if p.bn == "bn"]
    assert len(pairs) == len(chains) and {p.activation for p in pairs} == {"relu" if cls is MixedKernel else "silu"}
    for _ in range(3):
        ref = _step(eager, x)
        got = _step(converted, x, ref["g"])
        for key in ("out",):
            assert torch.equal(got[key], ref[key])
        for k in ref["grads"]:
            assert torch.equal(got["grads"][k], ref["grads"][k]), k
        for k in ref["buffers"]:
            assert torch.equal(got["buffers"][k], ref["buffers"][k]), k
    assert converted.state_dict().keys() == model.state_dict().keys()
    for clone in (copy.deepcopy(converted), pickle.loads(pickle.dumps(converted))):
        ref, got = _step(copy.deepcopy(eager), x), _step(clone, x)
        assert torch.equal(got["out"], ref["out"])
    converted.eval(), eager.eval()
    with torch.no_grad():  # eval: the running statistics' slices (rounding as any fused eval layer)
        torch.testing.assert_close(converted(x), eager(x))


@pytest.mark.expect_unfused("a BatchNorm over a concatenation with a piece that is no conv output: left, with its reason")
def test_bn_after_concatenation_with_a_non_layer_piece_is_left_by_convert() -> None:
    class CatInput(MixedKernel):
        def forward(self, x: Tensor) -> Tensor:
            a, b = torch.split(self.stem(x), [3, 3], 1)
            return self.act(self.bn(torch.cat([self.k3(a), self.k5(b) * 2.0], 1)))  # no conv after: no head

    torch.manual_seed(0)
    model, x = CatInput().double(), torch.randn(2, 3, 8, 8, dtype=torch.float64)
    converted = convbn.convert(copy.deepcopy(model), example_inputs=x)
    assert [o.batchnorm for o in converted.convbn_report.skipped] == ["bn"]
    assert "follows function cat" in converted.convbn_report.skipped[0].reason
    ref = _step(model, x)
    _assert_same_step(ref, _step(converted, x, ref["g"]))


def test_fold_zip_over_split_mixed_kernels() -> None:
    torch.manual_seed(0)
    folded = _fold(ZipMix(), torch.randn(2, 3, 8, 8))
    assert {o.batchnorm: o.layer for o in folded.convbn_report.folded} == {"bn": "convs.0, convs.1, convs.2"}


def test_batch_norm_slice_checks_its_arguments() -> None:
    bn = nn.BatchNorm2d(4)
    with pytest.raises(TypeError, match="expects a _BatchNorm source, but got Conv2d"):
        BatchNormSlice(nn.Conv2d(1, 1, 1), 0, 1, counts=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"0 <= start < stop <= 4 .* start=2, stop=6"):
        BatchNormSlice(bn, 2, 6, counts=True)
    view = BatchNormSlice(bn, 1, 3, counts=False, source_name="bn")
    assert view.num_features == 2 and view.num_batches_tracked is None
    assert view.weight._base is bn.weight and view.running_mean.data_ptr() == bn.running_mean[1:].data_ptr()
    assert "channels 1:3 of bn" in repr(view)
    bn.eval()
    assert not view.training


def test_fold_token_batchnorm_into_the_linear() -> None:
    torch.manual_seed(0)
    folded = _fold(TokenMLP(), torch.randn(2, 3, 4, 4))
    assert {o.batchnorm: o.layer for o in folded.convbn_report.folded} == {"bn": "fc"}
    assert not any(isinstance(m, _BatchNorm) for m in folded.modules())


def test_fold_token_batchnorm_on_a_4d_linear_output_is_left() -> None:
    """A transpose(1, 2) of a 4-D linear output does not bring its features to dim 1."""

    class FourD(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.bn = nn.Linear(6, 5), nn.BatchNorm2d(4)

        def forward(self, x: Tensor) -> Tensor:
            return self.bn(self.fc(x).transpose(1, 2))  # (B, 4, H, 5) -> channels are H

    torch.manual_seed(0)
    folded = _fold(FourD(), torch.randn(2, 3, 4, 6))
    assert [o.batchnorm for o in folded.convbn_report.skipped] == ["bn"]
    assert "3-D tokens" in folded.convbn_report.skipped[0].reason


@pytest.mark.parametrize("chain", [True, False])
def test_shared_head_not_split_where_a_reader_cannot_join(chain: bool) -> None:
    """A reflect-padded conv only starts a chain: the head stays whole, left with its reason,
    and the model trains as eager (no copy of the head is left behind in the graph)."""
    torch.manual_seed(0)
    model = PreActProjection().double()
    if chain:
        model.body1.padding_mode = "reflect"
    x = torch.randn(2, 8, 8, 8, dtype=torch.float64)
    eager = copy.deepcopy(model)
    converted = convbn.convert(copy.deepcopy(model), example_inputs=x, chain=chain)
    assert "bn" not in _fused(converted.convbn_report)
    assert [o.batchnorm for o in converted.convbn_report.skipped] == ["bn"]
    ref = _step(eager, x)
    _assert_same_step(ref, _step(converted, x, ref["g"]))


class ConvActBN(nn.Module):
    """conv -> act -> BN: fused as a head where a conv follows, else left saying the order."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.a1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(8)
        self.c2, self.a2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.SiLU(), nn.BatchNorm2d(8)

    def forward(self, x: Tensor) -> Tensor:
        return self.b2(self.a2(self.c2(self.b1(self.a1(self.c1(x))))))


def test_conv_act_bn_order_fused_as_head_or_left_with_the_order_named() -> None:
    torch.manual_seed(0)
    model, x = ConvActBN().double(), torch.randn(2, 3, 6, 6, dtype=torch.float64)
    converted = convbn.convert(copy.deepcopy(model), example_inputs=x)
    assert set(_fused(converted.convbn_report)) == {"b1"} and _heads(converted) == [("b1", "c2")]
    (left,) = converted.convbn_report.skipped
    assert left.batchnorm == "b2" and "silu of convolution c2 (conv -> activation -> BN order)" in left.reason
    ref = _step(model, x)
    _assert_same_step(ref, _step(converted, x, ref["g"]))
