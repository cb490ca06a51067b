"""A converted step of a per-sample-norm chain dispatches no more operators than eager's step plus
the recompute's (issue 39): each extra operator is a kernel launch on an accelerator and each
extra cast memory traffic, so an extra cast or a second recompute of a layer regresses loudly.

Counted exactly (no clock) by ``tests/op_count_helpers.py`` over one training step (forward under
bf16 autocast or in float32, float32 loss, backward). The recompute's budget is eager's own
operators for each layer's norm and activation, run on that layer's input as eager's forward saw
it, under the same autocast: with every conv output kept (``recompute_bn``) the backward runs each
layer's norm and activation once more and nothing else; on the CPU each chain convolution's
backward is two ``convolution_backward`` calls, its weight's gradient first (Note: [the weight's
gradient first] in functional/conv.py: the same work, less scratch at once).
"""
from __future__ import annotations

import copy
from collections import Counter
from typing import Callable, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import convbn
from convbn.nn.norm_chain import FusedNormChain
from convbn.passes.plan.chain_plans import apply_plan
from fusion_checks import assert_fused
from bench_modules import load_benchmark
from op_count_helpers import OpCounter, kind_of, ops_of, step_ops
from test_norm_chains import LayerNorm2d

#: dwconv -> LayerNorm2d -> 1x1 conv -> GELU -> 1x1 conv, plus the input (one chain): the benchmark's block
ConvNeXtBlock = load_benchmark("bm_norm_peaks").ConvNeXtBlock


class Net(nn.Module):
    """``stem -> [norm -> act -> conv] * depth`` (pre-activation, as diffusion U-Nets) or
    ``[conv -> norm -> act] * depth -> conv`` (post-activation, as 3-D U-Nets and ConvNeXt)."""

    def __init__(self, norm: Callable[[int], nn.Module], act: Callable[[Tensor], Tensor], pre: bool,
                 c: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.norms = nn.ModuleList([norm(c) for _ in range(depth)])
        self.convs = nn.ModuleList([nn.Conv2d(c, c, 3, padding=1) for _ in range(depth)])
        self.act, self.pre = act, pre

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for n, c in zip(self.norms, self.convs):
            h = c(self.act(n(h))) if self.pre else self.act(n(c(h)))
        return h


NETS = {
    "GroupNorm-SiLU pre": lambda: Net(lambda c: nn.GroupNorm(4, c), F.silu, pre=True),
    "InstanceNorm-LeakyReLU post": lambda: Net(lambda c: nn.InstanceNorm2d(c, affine=True),
                                               lambda t: F.leaky_relu(t, 0.01), pre=False),
    "LayerNorm2d-GELU post": lambda: Net(LayerNorm2d, F.gelu, pre=False),
}


def _autocast(device: str, amp: Optional[torch.dtype]) -> torch.autocast:
    return torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None)


def inputs_seen(twin: nn.Module, modules: List[nn.Module], x: Tensor, amp: Optional[torch.dtype]) -> List[Tensor]:
    """The input each of ``modules`` gets in a forward of ``twin`` on ``x`` without autograd, under
    ``amp``'s autocast, in call order."""
    inputs: List[Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for m in modules]
    try:
        with torch.no_grad(), _autocast(x.device.type, amp):
            twin(x)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def recompute_budget(net: Net, x: Tensor, amp: Optional[torch.dtype]) -> Counter:
    """What the backward may run beyond eager's step: per layer, eager's own operators for its norm
    and activation on the input eager's forward gave that norm, and autocast's cast of the result
    for the next conv (eager keeps that cast from forward; the chain rebuilds it); and the cast of the
    chain's input for its first conv's weight gradient (the chain keeps its input as given, not
    eager's cast copy of it). Under the same autocast, on a copy of the net (its running
    statistics stay)."""
    twin = copy.deepcopy(net)
    inputs = inputs_seen(twin, list(twin.norms), x, amp)
    conv_dtype = amp or x.dtype
    budget: Counter = Counter(ops_of(lambda: x.to(conv_dtype)).counts)
    for n, y in zip(twin.norms, inputs):
        def post(n: nn.Module = n, y: Tensor = y) -> None:
            with torch.enable_grad(), _autocast(x.device.type, amp):
                twin.act(n(y.requires_grad_())).to(conv_dtype)
        budget.update(ops_of(post).counts)
    return budget


def over_budget(fast: OpCounter, eager: OpCounter, budget: Counter) -> dict:
    """The kernels and casts the converted step dispatched beyond eager's and the budget's."""
    return {k: (n, eager.counts[k], budget[k]) for k, n in fast.counts.items()
            if kind_of(k) != "free" and n > eager.counts[k] + budget[k]}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [torch.bfloat16, None], ids=["bf16-autocast", "float32"])
@pytest.mark.parametrize("name", list(NETS))
def test_converted_step_dispatches_eager_ops_plus_one_recompute(name: str, amp: Optional[torch.dtype],
                                                                device: str) -> None:
    torch.manual_seed(0)
    eager = NETS[name]().to(device)
    x = torch.randn(2, 3, 8, 8, device=device)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    assert_fused(fast, chains=1, strategies={"recompute_bn"})
    e, f = step_ops(eager, x, amp), step_ops(fast, x, amp)
    assert f.counts["convolution"] == e.counts["convolution"]  # every conv output kept: no conv recomputed
    budget = recompute_budget(eager, x, amp)
    if device == "cpu":  # Note: [the weight's gradient first]: grad_W and grad_x in two calls per chain conv
        budget["convolution_backward"] += len(eager.convs)
    assert not over_budget(f, e, budget), over_budget(f, e, budget)
    # the recompute did run: each layer's norm once more than eager's step
    norm_op = next(k for k in budget if k.startswith("native_"))
    assert f.counts[norm_op] == e.counts[norm_op] + len(eager.norms), (norm_op, f.counts, e.counts)


class ConvNeXtNet(nn.Module):
    def __init__(self, c: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 2, stride=2)
        self.stage = nn.ModuleList([ConvNeXtBlock(c) for _ in range(depth)])

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for b in self.stage:
            h = b(h)
        return h


def convnext_budget(net: ConvNeXtNet, x: Tensor, amp: Optional[torch.dtype]) -> Counter:
    """A ConvNeXt block's recompute with every conv output dropped and no rebuilt input dropped
    (Note: [a norm before a dropped conv recomputed once]), as eager's own operators on
    the block's input as eager's forward saw it: its depthwise conv, its LayerNorm (under
    autograd), its first 1x1 conv and GELU, once each; and the cast of each chain's input for its
    first conv's weight gradient (tests/test_norm_chain_ops.py's ``recompute_budget``)."""
    twin = copy.deepcopy(net)
    inputs = inputs_seen(twin, list(twin.stage), x, amp)
    budget: Counter = Counter()
    for b, h in zip(twin.stage, inputs):
        def block(b: nn.Module = b, h: Tensor = h) -> None:
            with _autocast(x.device.type, amp):
                with torch.no_grad():
                    y = b.dw(h.to(amp or h.dtype))
                with torch.enable_grad():
                    z = b.norm(y.requires_grad_())
                with torch.no_grad():
                    F.gelu(b.pw1(z))
        budget.update(ops_of(block).counts)
    return budget


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [torch.bfloat16, None], ids=["bf16-autocast", "float32"])
def test_a_layer_norm_before_a_dropped_conv_is_recomputed_once(amp: Optional[torch.dtype], device: str) -> None:
    """ConvNeXt blocks keeping no conv output, backward not dropping rebuilt inputs (the ``auto``
    planner's plan where the step peaks elsewhere): the end conv's input rebuild runs the
    LayerNorm under autograd and keeps its output for the 1x1 conv's backward (Note: [a norm before
    a dropped conv recomputed once]): each block's LayerNorm, depthwise conv, 1x1 conv and GELU run
    once more than in eager's step. Rebuilt twice (once without a graph for the end conv, once
    with it for the 1x1 conv), the LayerNorm and the depthwise conv ran twice more: that is the
    plan that may drop (a lower chain peak), and it says so."""
    torch.manual_seed(0)
    eager = ConvNeXtNet().to(device)
    x = torch.randn(2, 3, 16, 16, device=device)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv")
    assert_fused(fast, chains=len(eager.stage), strategies={"recompute_conv"})
    chains = [m for _, m in convbn.fused_modules(fast) if isinstance(m, FusedNormChain)]
    blocks = len(eager.stage)
    e = step_ops(eager, x, amp)
    for drop, again in ((False, 1), (True, 2)):
        apply_plan(chains, [[False] * 3] * blocks, [drop] * blocks)
        f = step_ops(fast, x, amp)
        assert f.counts["native_layer_norm"] == e.counts["native_layer_norm"] + again * blocks, (drop, f.counts)
        assert f.counts["convolution"] == e.counts["convolution"] + (1 + again) * blocks, (drop, f.counts)
        assert f.counts["gelu"] == e.counts["gelu"] + blocks, (drop, f.counts)
    apply_plan(chains, [[False] * 3] * blocks, [False] * blocks)
    f = step_ops(fast, x, amp)
    budget = convnext_budget(eager, x, amp)
    if device == "cpu":  # Note: [the weight's gradient first]: grad_W and grad_x in two calls per chain conv
        budget["convolution_backward"] += sum(isinstance(m, nn.Conv2d) for b in eager.stage for m in b.modules())
    assert not over_budget(f, e, budget), over_budget(f, e, budget)


def test_engine_grad_is_autograd_grad() -> None:
    """``_compat.engine_grad`` (Note: [one autograd.grad per layer]) gives ``torch.autograd.grad``'s
    gradients bit for bit, ``None`` for an input the output does not depend on, and is
    ``torch.autograd.grad`` itself for a tensor subclass."""
    from convbn._compat import engine_grad

    torch.manual_seed(0)
    y = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    w, b, unused = (torch.randn(8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 8, 4, 4, dtype=torch.float64)

    def out() -> Tensor:
        return F.silu(F.group_norm(y, 4, w, b))

    want = torch.autograd.grad(out(), (y, w, b, unused), g, allow_unused=True)
    got = engine_grad(out(), (y, w, b, unused), g)
    assert got[3] is None and want[3] is None
    for a, e in zip(got[:3], want[:3]):
        assert torch.equal(a, e)

    class Sub(Tensor):
        seen = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.autograd.grad:
                cls.seen += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    ys = y.detach().as_subclass(Sub).requires_grad_()
    got = engine_grad(ys * 2, (ys,), g.as_subclass(Sub))
    assert Sub.seen == 1 and torch.equal(got[0].as_subclass(Tensor), 2 * g)
