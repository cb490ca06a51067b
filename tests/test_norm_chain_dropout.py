"""A training dropout (``p > 0``) in a per-sample-norm chain's tail runs fused: forward captures the
RNG state before each dropout draws, every recompute of that tail in backward replays it (Note: [a
dropout in a per-sample norm chain] in autograd/norm_chain.py). Float64 training steps against
eager: outputs, every gradient, running statistics, ``num_batches_tracked`` and the global RNG
state after the step; the chain ran fused (the Function in the graph, the report line "fused").
The mutant ``norm_dropout_redrawn`` (backward draws the dropout anew instead of replaying) fails
here."""
from __future__ import annotations

import copy
from typing import Callable, List

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import perturbed_twins
from convbn.autograd.norm_chain import NormChainFunction, NormLayerSpec, norm_chain_reference
from convbn.functional.activations import Activation
from convbn.functional.conv import conv_spec_from_module
from convbn.functional.norms import NormCall
from convbn.functional.tail import DropoutOp
from convbn.passes.plan.plan_inputs import measure_peak
from fusion_checks import assert_chain_ran
from norm_chain_checks import assert_chain_function_checks

KINDS = {"dropout": nn.Dropout, "dropout2d": nn.Dropout2d, "dropout3d": nn.Dropout3d,
         "alpha": nn.AlphaDropout, "feature_alpha": nn.FeatureAlphaDropout}


def _convs(kind: str) -> Callable[..., nn.Module]:
    conv = nn.Conv3d if kind == "dropout3d" else nn.Conv2d
    return lambda i, o: conv(i, o, 3, padding=1)


def _preact(kind: str, p: float) -> nn.Module:
    """A guided-diffusion ResBlock's half: GroupNorm -> SiLU -> Dropout(p) -> Conv."""
    conv = _convs(kind)
    return nn.Sequential(conv(3, 8), nn.GroupNorm(2, 8), nn.SiLU(), KINDS[kind](p), conv(8, 8),
                         nn.GroupNorm(4, 8), nn.SiLU(), KINDS[kind](p), conv(8, 4))


def _post(kind: str, p: float) -> nn.Module:
    """Conv -> GroupNorm -> ReLU -> Dropout -> Conv, an InstanceNorm with running statistics after."""
    conv = _convs(kind)
    inorm = nn.InstanceNorm3d if kind == "dropout3d" else nn.InstanceNorm2d
    return nn.Sequential(conv(3, 8), nn.GroupNorm(4, 8), nn.ReLU(), KINDS[kind](p), conv(8, 8),
                         inorm(8, affine=True, track_running_stats=True), nn.ReLU(), KINDS[kind](p), conv(8, 4))


def _x(kind: str) -> torch.Tensor:
    shape = (2, 3, 4, 6, 6) if kind == "dropout3d" else (2, 3, 8, 8)
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module, x: torch.Tensor, seed: int, fused: bool) -> List[torch.Tensor]:
    """One training step from RNG seed ``seed``: output, the input's and every parameter's
    gradient, every buffer, and the global RNG state after it."""
    torch.manual_seed(seed)
    xi = x.clone().requires_grad_()
    out = model(xi)
    if fused:
        assert_chain_ran(out)
    out.backward(torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 7)))
    res = [out.detach(), xi.grad, *(p.grad for p in model.parameters()), *model.buffers(), torch.get_rng_state()]
    model.zero_grad(set_to_none=True)
    return res


@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", ["preact", "post"])
def test_a_dropout_in_a_norm_chain_runs_fused_as_eager(shape: str, kind: str, strategy: str) -> None:
    eager, work = perturbed_twins(lambda: (_preact if shape == "preact" else _post)(kind, 0.3))
    x = _x(kind)
    fast = convbn.convert(work, strategy=strategy)
    for seed in (0, 1):  # two steps: running statistics move twice, fresh masks each step
        got, want = _step(fast, x, seed, True), _step(eager, x, seed, False)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    outcomes = fast.convbn_report.outcomes
    assert outcomes and all(o.result == "fused" for o in outcomes), outcomes


def test_a_training_dropout_draws_a_mask_of_its_own() -> None:
    """The masks differ from step to step and eager's gradients depend on them: a replay of the
    wrong state could not pass the comparison above by chance."""
    eager, _ = perturbed_twins(lambda: _preact("dropout", 0.5))
    x = _x("dropout")
    a, b = _step(eager, x, 0, False), _step(eager, x, 1, False)
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[2], b[2])


def _specs(fn: str, keep: bool) -> tuple:
    c1, c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 2, 1)
    return (NormLayerSpec(conv_spec_from_module(c1), NormCall("group_norm", 1e-5, 2), Activation("identity"),
                          tail=(Activation("silu"), DropoutOp(fn, 0.4)), keep_y=keep),
            NormLayerSpec(conv_spec_from_module(c2), None, Activation("identity")))


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("fn", ["dropout", "alpha_dropout"])
def test_function_gradcheck_with_a_dropout_tail(fn: str, keep: bool) -> None:
    """float64 gradcheck and gradgradcheck (the differentiable backward replays the masks too);
    each call from the same RNG state, as gradcheck's perturbed calls must see one function."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()

    params = [t(4, 3, 3, 3), t(4), t(4), t(4), t(2, 4, 1, 1), t(2)]
    with torch.random.fork_rng(devices=[]):
        assert_chain_function_checks(t(2, 3, 5, 5), params, _specs(fn, keep), seed=3)


@pytest.mark.parametrize("keep", [True, False])
def test_a_differentiable_backward_replays_forwards_masks(keep: bool) -> None:
    """The first-order gradients taken with ``create_graph=True`` (the differentiable backward,
    rebuilt from the reference) equal those of the plain backward and eager's, from one RNG seed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, generator=g).requires_grad_()
    params = [torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_()
              for s in ((4, 3, 3, 3), (4,), (4,), (4,), (2, 4, 1, 1), (2,))]
    specs, stats = _specs("dropout", keep), ((None, None),) * 2
    up = torch.randn(2, 2, 5, 5, dtype=torch.float64, generator=g)
    got = []
    with torch.random.fork_rng(devices=[]):
        for create in (False, True):
            torch.manual_seed(3)
            out = NormChainFunction.apply(x, *params, specs, stats)
            assert type(out.grad_fn).__name__ == "NormChainFunctionBackward"
            got.append(torch.autograd.grad(out, [x, *params], up, create_graph=create))
        torch.manual_seed(3)
        want = torch.autograd.grad(norm_chain_reference(x, params, specs), [x, *params], up)
    for a, b, c in zip(*got, want):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-12)


def test_under_torch_compile_a_dropout_chain_runs_eager_modules_with_eagers_values() -> None:
    """Under ``torch.compile`` (``aot_eager``) a dropout tail's chain runs its layers as eager modules
    (``compilable_norm_chain`` refuses it): the step equals the eager twin's compiled the same way."""
    eager, work = perturbed_twins(lambda: _post("dropout", 0.3))
    x = _x("dropout")
    fast = convbn.convert(work, strategy="recompute_conv")
    ce, cf = torch.compile(eager, backend="aot_eager"), torch.compile(fast, backend="aot_eager")
    got, want = _step(cf, x, 0, False), _step(ce, x, 0, False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_dropout_chains_step_peaks_below_eagers() -> None:
    """Forward keeps no mask (RNG states only): the converted step's peak (exact bytes on the CPU)
    stays below eager's, as the same chain's without a dropout does."""
    torch.manual_seed(0)
    model = _preact("dropout", 0.3).float()
    x = torch.randn(2, 3, 32, 32)
    fast = convbn.convert(copy.deepcopy(model), example_inputs=(x,))
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused"] * 2
    fused, eager = measure_peak(fast, (x,)), measure_peak(model, (x,))
    assert any(p.op.startswith("NormChainFunctionBackward/") for p in fused.points)
    assert fused.peak < 0.8 * eager.peak, (fused.peak, eager.peak)


class _ChannelRMS(nn.Module):
    """torch's ``nn.RMSNorm`` over the channels, between permutes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _ChannelLN(_ChannelRMS):
    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)  # type: ignore[assignment]


@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv"])
@pytest.mark.parametrize("norm", [_ChannelRMS, _ChannelLN])
def test_a_dropout_after_a_channel_norm_runs_fused_as_eager(norm: type, strategy: str) -> None:
    make = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.GELU(), nn.Dropout(0.3),  # noqa: E731
                                 nn.Conv2d(8, 8, 3, padding=1), norm(8), nn.SiLU(), nn.Dropout2d(0.2), nn.Conv2d(8, 4, 1))
    eager, work = perturbed_twins(make)
    x = _x("dropout")
    fast = convbn.convert(work, strategy=strategy)
    for seed in (0, 1):
        for a, b in zip(_step(fast, x, seed, True), _step(eager, x, seed, False)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused", "fused"]
