"""Convolutions whose weight the model computes from its parameters (weight standardisation:
timm's ``StdConv2d`` / ``ScaledStdConv2d``, hand-written WS convs, a gain) fuse with the norm
after them: the chain runs the model's own weight computation and autograd carries the weight
gradient back through it (``convbn/nn/computed_weight.py``, ``passes/graph/computed_weight.py``).
A weight computed from an activation, or drawn at random, is not taken.
"""
from __future__ import annotations

import copy
from typing import Callable, List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import convbn
from convbn.nn.computed_weight import ComputedWeight
from fusion_checks import assert_chain_ran, assert_fused, fused_chains
from zoo import timm_or_skip

EXACT = dict(rtol=1e-10, atol=1e-12)


class MeanStdConv(nn.Conv2d):
    """Weight standardisation spelled with mean / std (big_transfer's, lucidrains' WS conv)."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class GainConv(nn.Conv2d):
    """A standardised weight scaled by a learned per-channel gain (NFNet's spelling, by hand)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.rand(self.out_channels, 1, 1, 1) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        mean, var = w.mean(dim=(1, 2, 3), keepdim=True), w.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
        w = self.gain * (w - mean) * torch.rsqrt(var + 1e-4) * w[0].numel() ** -0.5
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class InputScaledConv(nn.Conv2d):
    """Look-alike: the weight is scaled by a statistic of the activation."""

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight * x.mean(), self.bias, self.stride, self.padding)


class DropConnectConv(nn.Conv2d):
    """Look-alike: a weight drawn anew on each call (DropConnect) is not a function of the parameters."""

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, F.dropout(self.weight, 0.2, self.training), self.bias, self.stride, self.padding)


def _net(conv: Callable[..., nn.Module], norm: Callable[[int], nn.Module] = lambda c: nn.GroupNorm(4, c)) -> nn.Module:
    return nn.Sequential(conv(3, 8, 3, padding=1), norm(8), nn.SiLU(), conv(8, 8, 3, padding=1, bias=False), norm(8),
                         nn.ReLU()).double()


def _train_alike(eager: nn.Module, fast: nn.Module, x: Tensor, steps: int = 3) -> None:
    """``steps`` SGD steps of both: outputs, input gradient, every parameter's gradient and every
    buffer equal after each, the fused chain in every converted step's graph (the parameters
    change between steps: the chain reads the weight the model computes now)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, fast)]
    for k in range(steps):
        for o in opts:
            o.zero_grad(set_to_none=True)
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_f = eager(xe), fast(xf)
        assert_chain_ran(out_f)
        g = torch.randn(out_e.shape, dtype=out_e.dtype, generator=torch.Generator().manual_seed(k))
        out_e.backward(g)
        out_f.backward(g)
        torch.testing.assert_close(out_f, out_e, **EXACT)
        torch.testing.assert_close(xf.grad, xe.grad, **EXACT)
        for (n, p), (_, q) in zip(fast.named_parameters(), eager.named_parameters()):
            assert p.grad is not None and q.grad is not None, n
            torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=lambda m: f"{n}: {m}")
        for (n, b), (_, c) in zip(fast.named_buffers(), eager.named_buffers()):
            torch.testing.assert_close(b, c, **EXACT, msg=lambda m: f"{n}: {m}")
        for o in opts:
            o.step()


def _computed_layers(model: nn.Module) -> List[ComputedWeight]:
    return [l.computed for c in fused_chains(model) for l in c.layers if l.computed is not None]


@pytest.mark.parametrize("conv", [MeanStdConv, GainConv], ids=["mean-std", "gain"])
@pytest.mark.parametrize("with_inputs", [True, False])
def test_hand_written_weight_standardisation_fuses_and_trains_as_eager(conv: type, with_inputs: bool) -> None:
    torch.manual_seed(0)
    eager = _net(conv)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x if with_inputs else None)
    report = assert_fused(fast, pairs=2)
    assert [(o.batchnorm, o.result) for o in report.outcomes] == [("1", "fused"), ("4", "fused")], report
    assert len(_computed_layers(fast)) == 2
    _train_alike(eager, fast, x)


def test_timm_std_conv_with_group_norm_act_fuses_and_trains_as_eager() -> None:
    timm_or_skip()
    from timm.layers import GroupNormAct, ScaledStdConv2d, StdConv2d

    torch.manual_seed(0)
    eager = nn.Sequential(StdConv2d(3, 16, 3, padding=1, eps=1e-8), GroupNormAct(16, 4),
                          ScaledStdConv2d(16, 16, 3, padding=1), GroupNormAct(16, 8, act_layer=nn.SiLU),
                          StdConv2d(16, 8, 1)).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    report = assert_fused(fast)
    assert [(o.batchnorm, o.result) for o in report.outcomes] == [("1", "fused"), ("3", "fused")], report
    # Note: [one computed weight per chain]: each StdConv starts its own chain, the last one stays a conv
    assert report.num_chains == 2 and len(_computed_layers(fast)) == 2
    _train_alike(eager, fast, x)


def test_timm_bit_resnet_fuses_its_group_norms_exactly() -> None:
    timm_or_skip()
    from functools import partial

    from timm.layers import GroupNormAct, StdConv2d
    from timm.models.resnetv2 import ResNetV2

    torch.manual_seed(0)
    eager = ResNetV2(layers=[1, 1], channels=(32, 64), width_factor=1, stem_chs=16, stem_type="fixed",
                     conv_layer=partial(StdConv2d, eps=1e-8), norm_layer=partial(GroupNormAct, num_groups=4),
                     num_classes=5).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    report = assert_fused(fast)
    outcomes = {o.batchnorm: o.result for o in report.outcomes}
    # each block's norm2 / norm3 (after a StdConv) fuse, and norm1, a pre-activation head read by
    # two convolutions (the shortcut and conv1: one head each); the final norm feeds pooling
    assert outcomes == {**{f"stages.{s}.blocks.0.norm{k}": "fused" for s in (0, 1) for k in (1, 2, 3)},
                        "norm": "left"}, report
    assert len(report.outcomes) == 7, report  # one outcome per norm, a split head's too
    _train_alike(eager, fast, x, steps=2)


def test_a_batch_norm_chain_takes_a_computed_weight_too() -> None:
    torch.manual_seed(0)
    eager = _net(MeanStdConv, nn.BatchNorm2d)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x, strategy="recompute_bn")
    assert_fused(fast, pairs=2, chains=2)
    _train_alike(eager, fast, x)  # running statistics and num_batches_tracked among the buffers


@pytest.mark.expect_unfused("look-alikes: a weight computed from an activation or drawn at random is not taken")
@pytest.mark.parametrize("conv, why", [(InputScaledConv, "computed from the module's inputs"),
                                       (DropConnectConv, "random or in place")], ids=["from-input", "random"])
def test_a_weight_not_computed_from_parameters_alone_is_not_taken(conv: type, why: str) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(conv(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU()).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    report = fast.convbn_report
    assert not report.pairs and not fused_chains(fast), report
    [outcome] = report.outcomes
    assert outcome.batchnorm == "1" and outcome.result == "left" and why in outcome.reason, report
    if conv is InputScaledConv:  # the converted model still computes what eager does
        out = fast(x)
        torch.testing.assert_close(out, eager(x), **EXACT)


def test_the_weight_is_computed_once_per_call_and_read_from_the_parameters_of_that_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    eager = _net(MeanStdConv)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    assert len(_computed_layers(fast)) == 2
    calls = []
    original = ComputedWeight.compute
    monkeypatch.setattr(ComputedWeight, "compute", lambda self: (calls.append(self.name), original(self))[1])
    assert_chain_ran(fast(x.clone().requires_grad_()))
    assert len(calls) == 2, calls  # once per layer, though a chain reads each weight several times
    # a parameter swapped in (torch.func.functional_call) is the one the weight is computed from
    w = fast[0].weight.detach() * 2
    out = torch.func.functional_call(fast, {"0.weight": w}, (x,))
    ref = torch.func.functional_call(eager, {"0.weight": w}, (x,))
    torch.testing.assert_close(out, ref, **EXACT)


def test_gradcheck_through_a_computed_weight() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(MeanStdConv(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU()).double()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x.detach(), strategy="recompute_conv")
    assert len(_computed_layers(fast)) == 1
    w = fast[0].weight.detach().clone().requires_grad_()
    g = fast[1].weight.detach().clone().requires_grad_()

    def run(x: Tensor, w: Tensor, g: Tensor) -> Tensor:
        out = torch.func.functional_call(fast, {"0.weight": w, "1.weight": g}, (x,))
        assert_chain_ran(out)
        return out

    assert torch.autograd.gradcheck(run, (x, w, g))


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_a_computed_weight_chain_under_torch_compile_matches_eager(norm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import convbn.nn.chain as chain
    import convbn.nn.norm_chain as norm_chain

    torch.manual_seed(0)
    eager = _net(MeanStdConv, (lambda c: nn.GroupNorm(4, c)) if norm == "group" else nn.BatchNorm2d)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    calls: List[bool] = []
    module, name = (norm_chain, "norm_chain_compiled_apply") if norm == "group" else (chain, "run_chain")
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: (calls.append(torch.compiler.is_compiling()), original(*a))[1])
    torch._dynamo.reset()
    compiled = torch.compile(fast, backend="aot_eager")
    for _ in range(2):  # the second step reads the parameters the first one's SGD step changed
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_f = eager(xe), compiled(xf)
        out_e.square().sum().backward()
        out_f.square().sum().backward()
        assert calls and all(calls), "the chains did not run as compiled chains"
        torch.testing.assert_close(out_f, out_e, **EXACT)
        torch.testing.assert_close(xf.grad, xe.grad, **EXACT)
        for p, q in zip(fast.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **EXACT)
        for (n, b), c in zip(fast.named_buffers(), eager.buffers()):
            torch.testing.assert_close(b, c, **EXACT, msg=lambda m: f"{n}: {m}")
        with torch.no_grad():
            for m in (fast, eager):
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None


def test_fold_leaves_a_computed_weight_with_its_reason() -> None:
    torch.manual_seed(0)
    eager = _net(MeanStdConv, nn.BatchNorm2d).eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    folded = convbn.fold(copy.deepcopy(eager), example_inputs=x)
    report = folded.convbn_report
    assert not report.folded and all("computed in forward" in o.reason for o in report.outcomes), report
    with torch.no_grad():
        torch.testing.assert_close(folded(x), eager(x), **EXACT)


def test_a_converted_model_with_computed_weights_deep_copies_and_pickles() -> None:
    import io

    torch.manual_seed(0)
    eager = _net(MeanStdConv)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    for other in (copy.deepcopy(fast), torch.load(buf, weights_only=False)):
        computed = _computed_layers(other)
        assert len(computed) == 2
        # the copy's layers read the copy's parameters, not the original's
        assert computed[0].sources[0][0] is other[0] and other[0] is not fast[0]
        _train_alike(copy.deepcopy(eager), other, x, steps=2)


def test_under_bf16_autocast_a_computed_weight_is_computed_and_cast_as_eager_does() -> None:
    timm_or_skip()
    from timm.layers import GroupNormAct, StdConv2d

    torch.manual_seed(0)
    eager = nn.Sequential(StdConv2d(3, 16, 3, padding=1), GroupNormAct(16, 4), StdConv2d(16, 16, 3, padding=1),
                          GroupNormAct(16, 4))
    x = torch.randn(2, 3, 16, 16)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    assert len(_computed_layers(fast)) == 2
    xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_e, out_f = eager(xe), fast(xf)
    assert_chain_ran(out_f)
    out_e.float().square().sum().backward()
    out_f.float().square().sum().backward()
    assert out_f.dtype == out_e.dtype == torch.bfloat16
    torch.testing.assert_close(out_f, out_e, rtol=0, atol=0)  # the same ops in the same dtypes
    torch.testing.assert_close(xf.grad, xe.grad, rtol=0, atol=0)
    for (n, p), q in zip(fast.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


class PreActDown(nn.Module):
    """A pre-activation block that downsamples: ``act(norm(x))`` read by the projection shortcut
    and the body's first conv (ResNetV2 / BiT)."""

    def __init__(self, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.norm1, self.act = norm(8), nn.ReLU()
        self.down = nn.Conv2d(8, 16, 1, stride=2)
        self.conv1, self.norm2 = nn.Conv2d(8, 16, 3, stride=2, padding=1), norm(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        z = self.act(self.norm1(x))
        return self.down(z) + self.conv2(torch.relu(self.norm2(self.conv1(z))))


@pytest.mark.parametrize("norm", [lambda c: nn.GroupNorm(4, c), lambda c: nn.InstanceNorm2d(c, affine=True)],
                         ids=["group", "instance"])
def test_a_per_sample_pre_activation_head_read_by_two_convs_gets_one_head_each(norm: Callable[[int], nn.Module]) -> None:
    torch.manual_seed(0)
    eager = PreActDown(norm).double()
    x = torch.randn(2, 8, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    report = assert_fused(fast)
    assert {o.batchnorm: o.result for o in report.outcomes} == {"norm1": "fused", "norm2": "fused"}, report
    heads = [l for c in fused_chains(fast) for l in c.layers if l.is_head]
    assert [l.names[1] for l in heads] == ["norm1", "norm1"], report
    _train_alike(eager, fast, x)


def test_a_pre_activation_norm_with_running_statistics_read_by_two_convs_is_not_copied() -> None:
    torch.manual_seed(0)
    eager = PreActDown(lambda c: nn.InstanceNorm2d(c, affine=True, track_running_stats=True)).double()
    x = torch.randn(2, 8, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    report = assert_fused(fast)
    outcomes = {o.batchnorm: o.result for o in report.outcomes}
    assert outcomes["norm1"] == "left" and outcomes["norm2"] == "fused", report  # two heads would update twice
    _train_alike(eager, fast, x)
