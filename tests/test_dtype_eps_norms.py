"""Hand-written channel LayerNorms that pick their eps by the input's dtype fuse with the
convolution before them, and each dtype computes with the eps its own code picks.

``eps = 1e-5 if x.dtype == torch.float32 else 1e-3`` (lucidrains' ``ChanLayerNorm`` /
``LayerNorm``) is control flow on a traced value: the symbolic trace of the parent keeps the
norm opaque. The trace with real inputs answers the dtype (Note: [dtype questions answered by
the capture] in ``graph/shape_capture.py``; Note: [opaque children traced again with real
shapes] in ``convert/pipeline.py``), and the graph is guarded on the inputs' dtypes and the
autocast state: a call of another kind (bf16 autocast, float64) runs a variant that answers again.

The first convolution's parameters are scaled so that the channel variance of its output is of
the order of the eps: the two eps give outputs far apart (the tests check that they do), so a
graph that took the other branch fails.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

import convbn
from capture_helpers import TIGHT, assert_steps_match, perturbed_twins
from fusion_checks import assert_chain_ran, assert_fused, fused_chains
from convbn.nn.norm_chain import FusedNormChain
from convbn.passes.report.live import layer_status

SCALE = 0.02  # conv output variance ~ 1e-4: eps 1e-5 and 1e-3 give very different outputs
#: float32 rounding; the first conv's gradients are large (its weights are scaled down)
F32 = dict(rtol=1e-4, atol=1e-3)


class ChanLayerNorm(nn.Module):
    """dalle2-pytorch's ``ChanLayerNorm`` (``rsqrt``, a gain, optionally a bias as in med-seg-diff)."""

    def __init__(self, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(1, dim, 1, 1))
        self.b = nn.Parameter(torch.zeros(1, dim, 1, 1)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=1, keepdim=True)
        out = (x - mean) * (var + eps).rsqrt() * self.g
        return out if self.b is None else out + self.b


class SqrtLayerNorm(nn.Module):
    """x-unet's spelling: a division by ``sqrt``, eps picked by ``is_floating_point`` and dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, dim, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        eps = 1e-5 if x.is_floating_point() and x.dtype == torch.float32 else 1e-3
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=1, keepdim=True)
        return (x - mean) / (var + eps).sqrt() * self.gamma


class DeviceLayerNorm(ChanLayerNorm):
    """The eps picked by the device and the dtype (the same choice as ``ChanLayerNorm`` on the CPU)."""

    def forward(self, x: Tensor) -> Tensor:
        eps = 1e-3 if x.device.type == "cpu" and x.dtype != torch.float32 else 1e-5
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)
        return (x - torch.mean(x, dim=1, keepdim=True)) * (var + eps).rsqrt() * self.g


class ImagenLayerNorm(ChanLayerNorm):
    """imagen-pytorch's ``ChanLayerNorm``: statistics over ``dim=-3``, casts back to the input's dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.g = nn.Parameter(torch.ones(dim, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        dtype, dim = x.dtype, -3
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        var = torch.var(x, dim=dim, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=dim, keepdim=True)
        return (x - mean) * (var + eps).rsqrt().type(dtype) * self.g.type(dtype)


NORMS = {"rsqrt": ChanLayerNorm, "imagen": ImagenLayerNorm, "rsqrt-bias": lambda c: ChanLayerNorm(c, bias=True), "sqrt": SqrtLayerNorm,
         "device": DeviceLayerNorm}


def _net(norm: Callable[[int], nn.Module]) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.SiLU(), nn.Conv2d(8, 4, 1))


def _x(dtype: torch.dtype, seed: int = 0) -> Tensor:
    return torch.randn(2, 3, 7, 7, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _twins(make: Callable[[], nn.Module]) -> tuple:
    """``perturbed_twins`` with the first convolution's weight and bias scaled by :data:`SCALE`."""
    pair = perturbed_twins(make)
    with torch.no_grad():
        for model in pair:
            conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
            conv.weight.mul_(SCALE)
            conv.bias.mul_(SCALE)
    return pair


def _with_eps(model: nn.Module, eps: float) -> nn.Module:
    """``model`` with its norm's eps fixed to ``eps`` (what the other branch computes)."""
    other = copy.deepcopy(model)
    norm = other[1]
    cls = type(norm)

    def forward(x: Tensor) -> Tensor:
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)
        centred = x - torch.mean(x, dim=1, keepdim=True)
        if cls is SqrtLayerNorm:
            return centred / (var + eps).sqrt() * norm.gamma
        out = centred * (var + eps).rsqrt() * norm.g
        return out if norm.b is None else out + norm.b
    norm.forward = forward
    return other


def _assert_the_branch_matters(model: nn.Module, x: Tensor, taken: float) -> None:
    """The two eps give outputs far apart on ``x``: a graph with the other one would fail."""
    other = 1e-3 if taken == 1e-5 else 1e-5
    with torch.no_grad():
        assert (_with_eps(model, other)(x) - model(x)).abs().max() > 0.1


def _chain_eps(model: nn.Module) -> list:
    return [layer[2] for c in fused_chains(model) for layer in c.op_structure.layers if layer[2] is not None]


@pytest.mark.parametrize("example", [True, False])
@pytest.mark.parametrize("name", sorted(NORMS))
def test_float64_takes_its_own_eps_fused_and_exact(name: str, example: bool) -> None:
    eager, work = _twins(lambda: _net(NORMS[name]))
    x = _x(torch.float64)
    _assert_the_branch_matters(eager, x, 1e-3)
    fast = convbn.convert(work, example_inputs=x if example else None)
    if not example:
        assert_chain_ran(fast(x.clone()))  # captured with the real inputs on the first call
        fast.zero_grad(set_to_none=True)
        eager(x.clone())  # the same first step's statistics (none here) and RNG: nothing to update
    report = assert_fused(fast)
    assert [(o.batchnorm, o.result, o.layer) for o in report.outcomes] == [("1", "fused", "0")]
    assert all(isinstance(c, FusedNormChain) for c in fused_chains(fast))
    assert _chain_eps(fast) == [1e-3]
    assert_steps_match(eager, fast, x, steps=2)


@pytest.mark.parametrize("name", sorted(NORMS))
def test_float32_takes_its_own_eps(name: str) -> None:
    eager, work = (m.float() for m in _twins(lambda: _net(NORMS[name])))
    x = _x(torch.float32)
    _assert_the_branch_matters(eager, x, 1e-5)
    fast = convbn.convert(work, example_inputs=x)
    assert [(o.batchnorm, o.result) for o in fast.convbn_report.outcomes] == [("1", "fused")]
    assert _chain_eps(fast) == [1e-5]
    assert_steps_match(eager, fast, x, steps=2, tol=F32)


@pytest.mark.parametrize("name", sorted(set(NORMS) - {"imagen"}))
def test_bf16_autocast_runs_a_variant_with_its_own_eps(name: str) -> None:
    """Captured in float32 (eps 1e-5); a call under bf16 autocast fails the guard and runs a
    variant captured for it, fused, with the eps the code picks for bf16 (1e-3); the report names
    that variant by its dtypes and autocast."""
    eager, work = (m.float() for m in _twins(lambda: _net(NORMS[name])))
    x = _x(torch.float32)
    fast = convbn.convert(work, example_inputs=x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_the_branch_matters(eager, x, 1e-3)  # under autocast the norm sees bf16: eps 1e-3
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_f = eager(xe), fast(xf)
    assert_chain_ran(out_f)
    assert out_f.dtype == out_e.dtype == torch.bfloat16
    out_e.float().sum().backward()
    out_f.float().sum().backward()
    bf16 = dict(rtol=3e-2, atol=3e-2)  # bf16 rounding; the other eps is off by more than 0.1
    torch.testing.assert_close(out_f.float(), out_e.float(), **bf16)
    torch.testing.assert_close(xf.grad, xe.grad, rtol=5e-2, atol=xe.grad.abs().max().item() * 5e-2)
    assert sorted(_chain_eps(fast)) == [1e-5, 1e-3]  # the first capture's and the variant's
    report = fast.convbn_report
    assert len(report.variants) == 1 and "under cpu autocast to bfloat16" in report.variants[0], report.variants
    assert set(layer_status(fast).values()) == {"fused"}, layer_status(fast)
    assert [(o.batchnorm, o.result) for o in report.outcomes] == [("1", "fused")]
    out_again = fast(x)  # float32 again: the first capture, eps 1e-5
    assert_chain_ran(out_again)
    torch.testing.assert_close(out_again, eager(x), **F32)


def test_a_norm_casting_its_gain_under_autocast_runs_its_own_code_and_says_so() -> None:
    """imagen's norm multiplies by ``self.g.type(dtype)``: under bf16 autocast a real cast of a
    float32 parameter (no row computes that), so the variant fuses nothing; the call runs the
    model's own forward, bit for bit eager's, and the report says fallback for that call."""
    eager, work = (m.float() for m in _twins(lambda: _net(ImagenLayerNorm)))
    x = _x(torch.float32)
    fast = convbn.convert(work, example_inputs=x)
    assert _chain_eps(fast) == [1e-5]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(RuntimeWarning, match="under cpu autocast to bfloat16"):
        out_f = fast(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_e = eager(x)
    assert torch.equal(out_f, out_e)
    [outcome] = fast.convbn_report.outcomes
    assert outcome.result == "left" and "fallback" in outcome.reason and "autocast to bfloat16" in outcome.reason
    assert_chain_ran(fast(x))  # float32 again: the first capture


def test_a_model_cast_after_convert_answers_again() -> None:
    """Converted in float64 (eps 1e-3), then cast to float32 with float32 inputs: the guard on
    the inputs' dtypes runs a variant (eps 1e-5), never the float64 graph."""
    eager, work = _twins(lambda: _net(ChanLayerNorm))
    fast = convbn.convert(work, example_inputs=_x(torch.float64))
    eager.float()
    fast.float()
    x = _x(torch.float32, seed=1)
    _assert_the_branch_matters(eager, x, 1e-5)
    assert_steps_match(eager, fast, x, steps=2, tol=F32)
    assert "float32 on cpu" in fast.convbn_report.variants[0], fast.convbn_report.variants
    assert sorted(_chain_eps(fast)) == [1e-5, 1e-3]


class Block(nn.Module):
    """The norm's parent is a block with its own forward (dalle2's ``Attention`` prologue), not a
    ``Sequential``: the block is traced again with real inputs, its symbolic trace kept the norm opaque."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.out = nn.Conv2d(3, 8, 3, padding=1), ChanLayerNorm(8, bias=True), nn.Conv2d(8, 4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.nn.functional.gelu(self.norm(self.conv(x))))


def test_a_block_holding_the_norm_is_traced_with_real_inputs() -> None:
    eager, work = _twins(Block)
    x = _x(torch.float64)
    fast = convbn.convert(work, example_inputs=x)
    assert [(o.batchnorm, o.result, o.layer) for o in fast.convbn_report.outcomes] == [("norm", "fused", "conv")]
    assert _chain_eps(fast) == [1e-3]
    assert_steps_match(eager, fast, x, steps=2, tol=TIGHT)
    assert list(fast.state_dict()) == list(eager.state_dict())


class Layered(nn.Module):
    """Not a norm: an opaque block with a convolution inside, own parameters too (a symbolic
    trace that fails in it keeps it a leaf, converted on its own as before)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.conv = nn.Conv2d(8, 8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x) * self.scale if x.dtype == torch.float64 else self.conv(x)


def test_a_block_with_layers_inside_is_not_taken_for_a_norm() -> None:
    from convbn.passes.tracing.trace import LayerTracer, trace

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), Layered(), ChanLayerNorm(8))
    traced = trace(model, LayerTracer, training=True)
    assert sorted(traced.opaque) == ["2", "3"]
    assert traced.opaque_norms(model) == ["3"]


class Casts(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.float() * 2 + x.double().sum(-1, keepdim=True).type(x.dtype) + x.to(torch.float32).mean(dim=-3, keepdim=True)


@pytest.mark.parametrize("example", [True, False])
def test_casts_to_a_value_own_dtype_and_dims_from_the_end(example: bool) -> None:
    """A trace with real inputs drops the casts that change nothing and makes negative reduction
    dims absolute; a cast to another dtype stays, and a symbolic trace (no dtypes, no ranks) keeps all."""
    from convbn.passes.graph.absolute_dims import absolute_reduction_dims
    from convbn.passes.graph.noop_casts import drop_noop_casts
    from convbn.passes.tracing.trace import LayerTracer, trace

    x = _x(torch.float32)
    gm = trace(Casts(), LayerTracer, example=((x,), {}) if example else None).gm
    dropped, absolute = drop_noop_casts(gm), absolute_reduction_dims(gm)
    methods = [n.target for n in gm.graph.nodes if n.op == "call_method"]
    # x.float() and x.to(torch.float32) of a float32 x go; x.double() and the float64 sum's
    # .type(float32) change the dtype and stay
    assert len(dropped) == (2 if example else 0) and len(absolute) == (2 if example else 0)
    assert methods == (["double", "sum", "type", "mean"] if example else ["float", "double", "sum", "type", "to", "mean"])
    sums = [n.args[1] for n in gm.graph.nodes if n.target == "sum"]
    means = [n.kwargs["dim"] for n in gm.graph.nodes if n.target == "mean"]
    assert (sums, means) == (([3], [1]) if example else ([-1], [-3]))
    assert torch.equal(gm(x), Casts()(x))


def _default(value: Any, fallback: Any) -> Any:
    return value if value is not None else fallback


class ZeroBiasLayerNorm(ChanLayerNorm):
    """med-seg-diff-pytorch's ``LayerNorm``: ``... * self.g + default(self.b, 0)`` (``+ 0`` without a bias)."""

    def forward(self, x: Tensor) -> Tensor:
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=1, keepdim=True)
        return (x - mean) * (var + eps).rsqrt() * self.g + _default(self.b, 0)


class PreNormAttention(nn.Module):
    """med-seg-diff's attention prologue: the residual stream normalised, a 1x1 conv, split into
    pieces that einops' ``rearrange`` is asked about (``isinstance(t, list)``), a residual sum."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.prenorm = ZeroBiasLayerNorm(8)
        self.to_qk = nn.Conv2d(8, 16, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        q, k = self.to_qk(self.prenorm(x)).chunk(2, dim=1)
        q, k = (t if not isinstance(t, list) else t[0] for t in (q, k))  # what einops asks first
        return (q.softmax(dim=1) * k) + x


def test_a_pre_norm_with_a_zero_bias_before_a_conv_fuses() -> None:
    """Traced with real inputs: ``isinstance(piece, list)`` on a piece of a chunk is answered (its
    fake value is a tensor), the ``+ 0`` after the norm dropped, and the norm heads the chain of
    the conv it feeds; float64 exact against eager with its eps 1e-3."""
    eager, work = _twins(PreNormAttention)
    x = _x(torch.float64)
    fast = convbn.convert(work, example_inputs=x)
    assert not fast.convbn_report.untraced
    fused = {o.batchnorm: o.layer for o in fast.convbn_report.outcomes if o.result == "fused"}
    assert fused == {"prenorm": "stem"} or fused == {"prenorm": "to_qk"}, fast.convbn_report.outcomes
    assert _chain_eps(fast) == [1e-3]
    assert_steps_match(eager, fast, x, steps=2)


class ZeroAdds(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        a = x * 2 + 0                    # dropped: float, x * 2 read by the sum only
        b = (x > 0) + 0                  # a bool plus 0 is int64: stays
        c = x.long() + 0.0               # an int64 plus 0.0 is float32: stays
        d = x * 3
        e = d + 0                        # stays: d is read again below
        f = (x * 4 + 0).add_(1)          # stays: written in place
        return a + b + c + e + d + f


@pytest.mark.parametrize("example", [True, False])
def test_additions_of_zero_dropped_only_where_they_change_nothing(example: bool) -> None:
    from convbn.passes.graph.zero_adds import drop_zero_adds
    from convbn.passes.tracing.trace import LayerTracer, trace

    x = _x(torch.float32)
    gm = trace(ZeroAdds(), LayerTracer, example=((x,), {}) if example else None).gm
    assert len(drop_zero_adds(gm)) == (1 if example else 0)
    assert torch.equal(gm(x), ZeroAdds()(x))
