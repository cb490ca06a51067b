"""convert on Conv -> GroupNorm / InstanceNorm / channel LayerNorm -> tail chains (issue 39).

Each model is converted and compared with its eager twin in float64 over two training steps
(outputs, the input's and every parameter's gradient, running statistics, num_batches_tracked:
``assert_steps_match``), with the fused Function asserted to have run, the report's lines
checked, and ``state_dict`` unchanged.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convbn
from bench_modules import load_benchmark
from capture_helpers import assert_steps_match, perturbed_twins
from fusion_checks import assert_fused, fused_chains
from convbn.autograd.norm_chain import NormLayerSpec
from convbn.functional.activations import Activation
from convbn.functional.conv import conv_spec_from_module
from convbn.functional.norms import NormCall
from convbn.nn.norm_chain import FusedNormChain
from norm_chain_checks import assert_chain_function_checks


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: a LayerNorm subclass whose forward permutes around ``F.layer_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ChannelsLastLN(nn.Module):
    """Conv -> permute -> nn.LayerNorm -> permute back -> GELU -> conv (ConvNeXt-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.norm = nn.LayerNorm(6)
        self.pw = nn.Conv2d(6, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dw(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.pw(F.gelu(y))


class FunctionalGN(nn.Module):
    """F.group_norm on the module's own tensors, then SiLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(6, 8, 3, padding=1)
        self.weight = nn.Parameter(torch.rand(8) + 0.5)
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(F.group_norm(self.conv(x), 4, self.weight, self.bias, 1e-5))


class PreActBlock(nn.Module):
    """A diffusion ResBlock's order: GroupNorm -> SiLU -> Conv, twice, plus the skip."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return x + h


def _seq(norm: Callable[[], nn.Module], act: nn.Module, dims: int = 2) -> nn.Module:
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    return nn.Sequential(conv(6, 8, 3, padding=1), norm(), act, conv(8, 8, 3, padding=1, bias=False), norm(), act)


class ConvNeXt1x1Block(nn.Module):
    """dwconv -> LayerNorm2d -> 1x1 conv -> GELU -> 1x1 conv, plus the skip: one chain whose middle
    layer is a convolution with an activation and no norm."""

    def __init__(self) -> None:
        super().__init__()
        self.dw, self.norm = nn.Conv2d(6, 6, 7, padding=3, groups=6), LayerNorm2d(6)
        self.pw1, self.pw2 = nn.Conv2d(6, 24, 1), nn.Conv2d(24, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(F.gelu(self.pw1(self.norm(self.dw(x)))))


MODELS = {
    "convnext-1x1-mlp": (ConvNeXt1x1Block, (2, 6, 8, 8), 3),
    "groupnorm-silu": (lambda: _seq(lambda: nn.GroupNorm(4, 8), nn.SiLU()), (2, 6, 8, 8), 2),
    "groupnorm-1group-relu": (lambda: _seq(lambda: nn.GroupNorm(1, 8, affine=False), nn.ReLU()), (2, 6, 8, 8), 2),
    "instancenorm2d-affine-stats": (lambda: _seq(lambda: nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
                                                 nn.LeakyReLU(0.01)), (2, 6, 8, 8), 2),
    "instancenorm2d-plain": (lambda: _seq(lambda: nn.InstanceNorm2d(8), nn.LeakyReLU(0.2)), (2, 6, 8, 8), 2),
    "instancenorm3d-stats-momentum-none": (
        lambda: _seq(lambda: nn.InstanceNorm3d(8, track_running_stats=True, momentum=None), nn.LeakyReLU(0.01), 3),
        (2, 6, 5, 5, 5), 2),
    "instancenorm1d-affine": (lambda: _seq(lambda: nn.InstanceNorm1d(8, affine=True), nn.GELU(), 1), (3, 6, 9), 2),
    "layernorm2d-subclass": (lambda: _seq(lambda: LayerNorm2d(8), nn.GELU()), (2, 6, 8, 8), 2),
    "channels-last-layernorm": (ChannelsLastLN, (2, 6, 8, 8), 2),
    "functional-group-norm": (FunctionalGN, (2, 6, 8, 8), 1),
    "pre-activation": (PreActBlock, (2, 8, 8, 8), 3),
}



@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv", "auto"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_norm_chain_matches_eager(name: str, strategy: str) -> None:
    make, shape, pairs = MODELS[name]
    eager, work = perturbed_twins(make)
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    x = torch.randn(shape, dtype=torch.float64)
    fast = convbn.convert(work, strategy=strategy)
    report = assert_fused(fast, pairs=pairs)
    assert all(isinstance(c, FusedNormChain) for c in fused_chains(fast))
    assert list(fast.state_dict()) == list(state)
    assert all(torch.equal(fast.state_dict()[k], v) for k, v in state.items())
    assert_steps_match(eager, fast, x, steps=2)
    assert not report.skipped, report
    with torch.no_grad():  # the no-grad path
        torch.testing.assert_close(fast(x), eager(x), rtol=0, atol=1e-12)


def test_report_names_each_norm_and_what_runs() -> None:
    eager, work = perturbed_twins(MODELS["instancenorm2d-affine-stats"][0])
    fast = convbn.convert(work, strategy="recompute_bn")
    report = fast.convbn_report
    assert [(p.conv, p.bn, p.activation) for p in report.pairs] == [
        ("0", "1", "leaky_relu(0.01)"), ("3", "4", "leaky_relu(0.01)")]
    assert [o.result for o in report.outcomes] == ["fused", "fused"]
    assert "1 -> " not in str(report) or "leaky_relu" in str(report)


def test_running_stats_move_once_per_step() -> None:
    """A mutant updating InstanceNorm's running statistics again in backward's recompute fails here."""
    eager, work = perturbed_twins(MODELS["instancenorm2d-affine-stats"][0])
    fast = convbn.convert(work, strategy="recompute_conv")
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64)
    for _ in range(3):
        eager(x).sum().backward()
        fast(x).sum().backward()
    for (n, b), c in zip(eager.named_buffers(), fast.buffers()):
        torch.testing.assert_close(c, b, rtol=0, atol=1e-12, msg=n)


def test_eval_instance_norm_with_running_stats_runs_its_statistics() -> None:
    make = MODELS["instancenorm2d-affine-stats"][0]
    eager, work = perturbed_twins(make)
    with torch.no_grad():
        for m in eager.modules():
            if isinstance(m, nn.InstanceNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    work.load_state_dict(eager.state_dict())
    fast = convbn.convert(work, strategy="recompute_bn")
    for m in (eager, fast):
        for mod in m.modules():
            if isinstance(mod, nn.InstanceNorm2d):
                mod.eval()  # a frozen InstanceNorm inside a model in training mode
    assert_steps_match(eager, fast, torch.randn(2, 6, 8, 8, dtype=torch.float64), steps=1)


def test_hooked_norm_left_with_reason() -> None:
    eager, work = perturbed_twins(MODELS["groupnorm-silu"][0])
    work[1].register_forward_hook(lambda m, i, o: None)
    fast = convbn.convert(work, strategy="recompute_bn")
    left = {o.batchnorm: o.reason for o in fast.convbn_report.outcomes if o.left}
    assert "hooks" in left["1"]
    assert_steps_match(eager, fast, torch.randn(2, 6, 8, 8, dtype=torch.float64), steps=1)


@pytest.mark.expect_unfused("a GroupNorm after a linear layer is left, with the reason")
def test_norm_after_linear_left_with_reason() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.GroupNorm(2, 8), nn.ReLU()).double()
    fast = convbn.convert(copy.deepcopy(model))
    (o,) = fast.convbn_report.outcomes
    assert o.left and "linear layer" in o.reason


def _layer_specs(keep: tuple) -> tuple:
    c1, c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, stride=2, padding=1)
    return (NormLayerSpec(conv_spec_from_module(c1), NormCall("group_norm", 1e-5, 2), Activation("silu"), keep_y=keep[0]),
            NormLayerSpec(conv_spec_from_module(c2), NormCall("channel_layer_norm", 1e-5, normalized=(4,)),
                          Activation("gelu"), keep_y=keep[1]),
            NormLayerSpec(conv_spec_from_module(nn.Conv2d(4, 2, 1)), None, Activation("identity")))


@pytest.mark.parametrize("keep", [(True, True), (False, False), (True, False), (False, True)])
def test_function_gradcheck_and_gradgradcheck(keep: tuple) -> None:
    specs = _layer_specs(keep)
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()

    params = [t(4, 3, 3, 3), t(4), t(4), t(4), t(4, 4, 3, 3), t(4), t(4), t(4), t(2, 4, 1, 1), t(2)]
    x = t(2, 3, 5, 5)
    assert_chain_function_checks(x, params, specs)


class ConvNeXtLinearBlock(nn.Module):
    """torchvision's CNBlock / timm's ConvNeXtBlock(conv_mlp=False): the LayerNorm's channels-last
    output feeds the MLP's Linear, the permute back comes after the MLP (NORMS_BUGS.md 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.dw, self.ln = nn.Conv2d(8, 8, 7, padding=3, groups=8), nn.LayerNorm(8, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(torch.permute(self.dw(x), [0, 2, 3, 1]))
        return x + self.fc2(F.gelu(self.fc1(h))).permute(0, 3, 1, 2)


def test_convnext_block_with_linear_mlp_fuses_its_layernorm() -> None:
    eager, work = perturbed_twins(ConvNeXtLinearBlock)
    fast = convbn.convert(work, strategy="recompute_conv")
    assert [(o.batchnorm, o.result, o.layer) for o in fast.convbn_report.outcomes] == [("ln", "fused", "dw")]
    assert_steps_match(eager, fast, torch.randn(2, 8, 9, 9, dtype=torch.float64))


class Tower(nn.Module):
    """A head applying one tower to each feature level in a Python loop (FCOS / RetinaNet heads):
    the parent does not trace, its Sequential converts on its own (NORMS_BUGS.md 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU())

    def forward(self, feats: list) -> list:
        return [self.tower(f) for f in feats]


def test_norm_of_a_container_converted_alone_is_reported_once() -> None:
    eager, work = perturbed_twins(Tower)
    fast = convbn.convert(work)
    feats = [torch.randn(2, 8, 8, 8, dtype=torch.float64), torch.randn(2, 8, 4, 4, dtype=torch.float64)]
    outs, ref = fast(feats), eager(feats)
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=1e-12)
    assert [(o.batchnorm, o.result) for o in fast.convbn_report.outcomes] == [("tower.1", "fused")]


def test_double_backward_through_converted_norm_chains() -> None:
    """A gradient penalty (create_graph=True) through fused norm chains equals eager's."""
    eager, work = perturbed_twins(PreActBlock)
    fast = convbn.convert(work, strategy="recompute_bn")
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64)
    results = []
    for model in (eager, fast):
        xi = x.clone().requires_grad_()
        out = model(xi)
        (gx,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
        gx.square().sum().backward()
        results.append([out.detach(), gx.detach()] + [p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_torch_compile_runs_norm_chains(fullgraph: bool) -> None:
    """Under torch.compile a norm chain is its ops in a selective checkpoint (Note: [a norm chain
    under torch.compile]): same outputs and gradients, no graph break where fullgraph is asked
    (tests/test_norm_chains_compiled.py: what it saves, autocast, inductor)."""
    eager, work = perturbed_twins(lambda: _seq(lambda: nn.GroupNorm(4, 8), nn.SiLU()))
    fast = convbn.convert(work, strategy="recompute_bn")
    fast(torch.randn(2, 6, 8, 8, dtype=torch.float64))  # the first call's check, eager
    compiled = torch.compile(fast, fullgraph=fullgraph, backend="aot_eager")
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64)
    out_c, out_e = compiled(x), eager(x)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-10)
    out_c.sum().backward()
    out_e.sum().backward()
    for p, q in zip(eager.parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("net, shape, most", [("DiffusionUNet", (2, 3, 32, 32), 0.55),
                                              ("InstanceUNet3d", (2, 1, 16, 16, 16), 0.55),
                                              ("ConvNeXtNet", (4, 3, 64, 64), 0.5)])
def test_step_peak_below_eager(net: str, shape: tuple, most: float) -> None:
    """The standard loop's exact CPU peak (timeline: zero_grad, forward, loss, backward, step) of
    the benchmark's nets, converted with example_inputs: at most ``most`` of eager's, never above."""
    bm = load_benchmark("bm_norm_peaks")
    torch.manual_seed(0)
    model = getattr(bm, net)()
    x = torch.randn(shape)
    fast = convbn.convert(copy.deepcopy(model), example_inputs=(x,))
    assert all(isinstance(c, FusedNormChain) for c in fused_chains(fast)) and fused_chains(fast)
    eager_peak, fast_peak = bm._peak(model, x), bm._peak(fast, x)
    assert fast_peak <= most * eager_peak, (fast_peak / eager_peak, fast.convbn_report)


def test_what_each_strategy_keeps() -> None:
    """recompute_bn keeps the chain input and each conv output, recompute_conv the input alone
    (saved bytes, exact): a chain keeping nothing, or everything, fails here."""
    eager, work = perturbed_twins(MODELS["groupnorm-silu"][0])
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64)
    kept = {}
    for strategy in ("recompute_bn", "recompute_conv"):
        fast = convbn.convert(copy.deepcopy(work), strategy=strategy)
        fast(x)  # the first call's check
        kept[strategy] = convbn.saved_bytes(fast, x.clone().requires_grad_()).activation_bytes
    map_bytes = 2 * 8 * 8 * 8 * 8  # one (2, 8, 8, 8) float64 conv output
    assert kept["recompute_conv"] == x.numel() * 8
    assert kept["recompute_bn"] == x.numel() * 8 + 2 * map_bytes
    assert convbn.saved_bytes(eager, x.clone().requires_grad_()).activation_bytes > kept["recompute_bn"]


@pytest.mark.expect_unfused("the InstanceNorm after an activation is left; its reason is the point")
def test_left_norm_reason_names_the_norm() -> None:
    """NORMS_BUGS.md 5: the reason names the norm, not "BatchNorm"."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.LeakyReLU(), nn.InstanceNorm2d(8, affine=True), nn.Flatten())
    (o,) = convbn.convert(model).convbn_report.outcomes
    assert o.left and o.reason.startswith("InstanceNorm2d after an activation: it follows"), o.reason
    assert "pre-activation chain (InstanceNorm2d -> element-wise ops -> conv)" in o.reason and "BN" not in o.reason


@pytest.mark.expect_unfused("the GroupNorm head before a Conv -> BatchNorm is left; its reason is the point")
def test_lone_head_before_a_batchnorm_says_why() -> None:
    """timm's SHViT (``GroupNorm(1, C)`` -> Conv -> BatchNorm): the per-sample head cannot join the
    BatchNorm chain after it, and its reason names that BatchNorm instead of "see that layer's
    line"; the Conv -> BN still fuses and trains as eager."""
    def make() -> nn.Module:
        return nn.Sequential(nn.GroupNorm(1, 6), nn.Conv2d(6, 8, 1), nn.BatchNorm2d(8), nn.ReLU())

    eager, work = perturbed_twins(make)
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64)
    fast = convbn.convert(work, example_inputs=x)
    assert_fused(fast, chains=1, skipped=1)
    (left,) = [o for o in fast.convbn_report.outcomes if o.left]
    assert left.batchnorm == "0", left
    assert left.reason.endswith("is normalised by a BatchNorm ('2'): a chain holds BatchNorms or per-sample norms, "
                                "not both; GroupNorm -> act alone saves nothing"), left.reason
    assert_steps_match(eager, fast, x)


class _ShapeReadAttention(nn.Module):
    """timm CoAtNet's ``Attention2d`` after its pre-norm: ``B, C, H, W = x.shape`` of the norm's output,
    then a 1x1 qkv conv whose output is viewed by those sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 6)
        self.qkv = nn.Conv2d(6, 12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        b, _, h, w = y.shape
        return self.qkv(y).view(b, 2, 6, h * w).sum(2)


@pytest.mark.expect_unfused("the GroupNorm head whose output's shape is read is left; its reason is the point")
def test_lone_head_whose_output_shape_is_read_says_why() -> None:
    model = convbn.convert(_ShapeReadAttention(), example_inputs=torch.randn(2, 6, 4, 4))
    (o,) = model.convbn_report.outcomes
    assert o.left and "the model reads the shape of the value between them ('.shape')" in o.reason, o.reason
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, 4)
    torch.testing.assert_close(model(x), _ShapeReadAttention.forward(model, x), rtol=0, atol=0)


@pytest.mark.expect_unfused("a hook added after convert runs the chain as eager modules, by design")
def test_hook_added_later_runs_and_a_swapped_norm_is_captured_again() -> None:
    eager, work = perturbed_twins(MODELS["groupnorm-silu"][0])
    fast = convbn.convert(work, strategy="recompute_bn")
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64)
    assert_steps_match(eager, fast, x, steps=1)
    seen = []
    handle = fast[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    torch.testing.assert_close(fast(x), eager(x), rtol=0, atol=1e-12)
    assert seen == [torch.Size([2, 8, 8, 8])]  # the GroupNorm module ran, its hook with it
    handle.remove()
    new_norm = nn.GroupNorm(2, 8).double()  # another norm swapped in: what the capture assumed changed
    fast[1] = new_norm
    eager[1] = copy.deepcopy(new_norm)
    fast.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning):
        out = fast(x)
    torch.testing.assert_close(out, eager(x), rtol=0, atol=1e-12)
    assert any(o.batchnorm == "1" and o.result == "fused" for o in fast.convbn_report.outcomes)
