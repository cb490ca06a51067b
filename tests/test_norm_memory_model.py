"""The planner's memory model of a per-sample-norm chain (issue 39 item 2) against measurement.

What :class:`~convbn.autograd.norm_chain.NormChainFunction` saves (the chain input and the conv
outputs its plan keeps) is :meth:`ChainCost.kept_bytes`, to the byte, for each norm of the table
and each strategy; its backward's transient is :func:`norm_replay`, read off the norm table
(``output_unread``, ``stat_count``), against the step's exact CPU timeline.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, Tuple

import pytest
import torch
from torch import nn

import convbn
from convbn.autograd.refcounts import frees_incoming_gradients
from convbn.memory import timeline
from convbn.nn.norm_chain import FusedNormChain
from convbn.passes.plan.peak_model import ChainCost, chain_backward_peak
from convbn.passes.plan.plan_inputs import _norms, _stat_bytes
from test_norm_chains import LayerNorm2d

NORMS: Dict[str, Callable[[int], nn.Module]] = {
    "group_norm": lambda c: nn.GroupNorm(4, c),
    "instance_norm": lambda c: nn.InstanceNorm2d(c, affine=True),
    "channel_layer_norm": lambda c: LayerNorm2d(c),
}
ACTS = {"relu": nn.ReLU, "silu": nn.SiLU}
STRATEGIES = ("recompute_bn", "recompute_conv")


def _net(norm: Callable[[int], nn.Module], act: Callable[[], nn.Module]) -> nn.Module:
    layers = []
    for cin, cout in ((4, 8), (8, 16), (16, 8)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1), norm(cout), act()]
    return nn.Sequential(*layers)


def _converted(norm: str, act: str, strategy: str) -> Tuple[nn.Module, FusedNormChain]:
    torch.manual_seed(0)
    fused = convbn.convert(_net(NORMS[norm], ACTS[act]), strategy=strategy)
    chains = [m for _, m in convbn.fused_modules(fused) if isinstance(m, FusedNormChain)]
    assert len(chains) == 1 and len(chains[0].layers) == 3, fused.convbn_report
    fused(torch.randn(8, 4, 16, 16))  # the first call's check; the layers' shapes
    return fused, chains[0]


def _cost(chain: FusedNormChain) -> Tuple[ChainCost, list]:
    ls = chain.layers
    cost = ChainCost(tuple(l.y_bytes() for l in ls), tuple(l.x_bytes() for l in ls), tuple(l.flops() for l in ls),
                     tuple(l.tail_kind() for l in ls),
                     w_bytes=tuple(sum(t.numel() * 4 for t in l.parameters() if t.requires_grad) for l in ls),
                     head=ls[0].is_head, end=ls[-1].is_end, s_bytes=tuple(_stat_bytes(l) for l in ls),
                     norms=_norms(chain))
    return cost, [l.mode == "recompute_bn" for l in ls]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_predicted_saved_bytes_are_the_measured_ones(norm: str, strategy: str) -> None:
    """Saved bytes (exact): the chain input plus the kept conv outputs the planner counts. A
    Function keeping nothing (or everything) under either strategy fails here."""
    fused, chain = _converted(norm, "silu", strategy)
    x = torch.randn(8, 4, 16, 16, requires_grad=True)
    cost, keep = _cost(chain)
    assert cost.norms == (norm,) * 3
    measured = convbn.saved_bytes(fused, x).activation_bytes
    assert measured == x.numel() * 4 + cost.kept_bytes(keep)
    assert cost.kept_bytes(keep) == (sum(cost.y_bytes) if strategy == "recompute_bn" else 0)


def _measured_backward(fused: nn.Module, cost: ChainCost, keep: list) -> int:
    """The chain backward's peak in one step's timeline, less what was alive before it besides
    the kept conv outputs and the incoming gradient (as the replay counts)."""
    torch.manual_seed(1)
    x, proj = torch.randn(8, 4, 16, 16, requires_grad=True), torch.randn(8, 8, 16, 16)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return (out * proj).sum()

    loss(fused(x)).backward()
    for p in fused.parameters():
        p.grad = None
    tl = timeline(fused, x, loss_fn=loss)
    idx = [i for i, p in enumerate(tl.points) if p.op.startswith("NormChainFunctionBackward/")]
    assert idx, "the fused chain's backward did not run"
    before = tl.points[idx[0] - 1].bytes
    alive = sum(y for y, k in zip(cost.y_bytes, keep) if k) + cost.y_bytes[-1]
    return max(tl.points[i].bytes for i in idx) - (before - alive)


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_replayed_backward_is_the_measured_one(norm: str, act: str) -> None:
    """Keeping the conv outputs, the replay of NormChainFunction's backward is the measured peak
    to the byte (the norm's output released under ReLU as its row's ``output_unread`` says; each
    kept conv output freed after its norm's backward; the Function's incoming gradient freed once
    its activation's backward read it); recomputing them too (a recomputed conv output is let go once its
    norm's backward read it, not held through its conv's backward). The BatchNorm chain's replay is not."""
    fused, chain = _converted(norm, act, "recompute_bn")
    cost, keep = _cost(chain)
    measured = _measured_backward(fused, cost, keep)
    # the incoming gradient is freed once consumed where this Python and torch let the probe
    # prove it unshared (tests/test_peak_memory.py); elsewhere it stays to the end
    held = 0 if frees_incoming_gradients() else cost.y_bytes[-1]
    assert chain_backward_peak(cost, keep)[0] + held == measured
    bn_model = chain_backward_peak(ChainCost(cost.y_bytes, cost.x_bytes, cost.macs, cost.acts, w_bytes=cost.w_bytes,
                                             s_bytes=cost.s_bytes), keep)[0]
    assert bn_model != measured
    fused, chain = _converted(norm, act, "recompute_conv")
    cost, keep = _cost(chain)
    measured = _measured_backward(fused, cost, keep)
    assert chain_backward_peak(cost, keep)[0] + held == measured


def test_the_model_reads_the_norm_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose backward read its output would keep the norm's output under ReLU: the replay
    says so from the row alone (the same chain, one field of its row changed)."""
    from dataclasses import replace

    import convbn.functional.norms as norms

    fused, chain = _converted("group_norm", "relu", "recompute_bn")
    cost, keep = _cost(chain)
    before = chain_backward_peak(cost, keep)[0]
    rows = [replace(r, output_unread=False) if r.name == "group_norm" else r for r in norms.NORMS]
    monkeypatch.setattr(norms, "NORMS", rows)
    assert chain_backward_peak(cost, keep)[0] > before


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_recomputed_relu_is_written_over_the_norm_output(norm: str) -> None:
    """Note: [the norm's output as a root only]: under ReLU the backward recomputes each layer's
    norm and writes the activation over the norm's output: no out-of-place ReLU in the chain's
    backward (one map fewer alive than the norm's output beside the activation's), no view's
    ``grad_fn`` rebuilt by that write (an ``AsStridedBackward0`` copies a whole map), the replay
    still equal to the measured backward to the byte, and the layer-by-layer backward below
    the replay of the same chain with the activation allocated beside the norm's output. Every
    conv output kept: each layer's norm is recomputed under autograd (a rebuild from a recomputed
    conv output runs without autograd, out of place: not this Note's)."""
    fused, chain = _converted(norm, "relu", "recompute_bn")
    cost, keep = _cost(chain)
    torch.manual_seed(1)
    x = torch.randn(8, 4, 16, 16, requires_grad=True)
    fused(x).sum().backward()
    for p in fused.parameters():
        p.grad = None
    ops = [p.op for p in timeline(fused, x).points if p.phase == "backward"]
    ours = [op.split("/", 1)[1] for op in ops if op.startswith("NormChainFunctionBackward/")]
    assert "aten.relu_.default" in ours and "aten.relu.default" not in ours, sorted(set(ours))
    assert not any(op.startswith("AsStridedBackward0/") for op in ops)
    held = 0 if frees_incoming_gradients() else cost.y_bytes[-1]
    assert chain_backward_peak(cost, keep)[0] + held == _measured_backward(fused, cost, keep)
    beside = ChainCost(cost.y_bytes, cost.x_bytes, cost.macs, ("smooth",) * 3, w_bytes=cost.w_bytes,
                       head=cost.head, end=cost.end, s_bytes=cost.s_bytes, norms=cost.norms)
    assert chain_backward_peak(cost, keep)[0] < chain_backward_peak(beside, keep)[0]


class ZeroPadUpCat(nn.Module):
    """MONAI UpCat's shape: the upsampled map padded by zero (``replicate``), concatenated with the
    skip, then Conv -> InstanceNorm -> LeakyReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.skip = nn.Conv2d(3, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(3, 4, 2, stride=2)
        self.conv = nn.Conv2d(8, 4, 3, padding=1)
        self.norm = nn.InstanceNorm2d(4, affine=True)

    def forward(self, x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        up = torch.nn.functional.pad(self.up(low), [0, 0, 0, 0], "replicate")
        return torch.nn.functional.leaky_relu(self.norm(self.conv(torch.cat([self.skip(x), up], 1))), 0.01)


def test_zero_width_pad_before_a_concatenation_is_dropped() -> None:
    """The zero pad is gone from the installed graph (its replication-pad backward no longer keeps
    the upsampled map), the concatenation's pieces feed the chain, and training is eager's."""
    torch.manual_seed(0)
    eager = ZeroPadUpCat().double()
    x, low = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=(x, low))
    graph = fast.forward.graph
    assert not any(n.op == "call_function" and n.target is torch.nn.functional.pad for n in graph.nodes)
    assert [type(m).__name__ for _, m in convbn.fused_modules(fast)] == ["FusedNormChain"]
    for model in (eager, fast):
        model.zero_grad(set_to_none=True)
        model(x, low).pow(2).sum().backward()
    torch.testing.assert_close(fast(x, low), eager(x, low), rtol=0, atol=1e-12)
    for (name, p), q in zip(eager.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-10, msg=name)
    saved = convbn.saved_bytes(fast, x, low).activation_bytes
    assert saved < convbn.saved_bytes(eager, x, low).activation_bytes


def test_a_layer_norm_kept_for_a_dropped_conv_is_priced_for_every_plan() -> None:
    """Note: [a norm before a dropped conv recomputed once]: where a ConvNeXt block's 1x1 conv output
    is dropped and its rebuilt input may not be, the end conv's input rebuild keeps the LayerNorm's
    output (and its graph) until the 1x1 conv's backward; where it may, the LayerNorm runs again
    for the 1x1 conv's backward. The planner's step peak is the measured one to the byte for every
    plan of two blocks (each flag pattern in both chains, and each chain alone keeping all) with
    the drops the planner chooses, none and all; keeping it is dearer where it applies."""
    import itertools

    from convbn.passes.plan.chain_plans import apply_plan
    from convbn.passes.plan.peak_model import drops_needed, step_peak
    from convbn.passes.plan.plan_inputs import measure_peak, measure_plan_inputs
    from test_norm_chain_ops import ConvNeXtNet

    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    fused = convbn.convert(ConvNeXtNet(depth=2), example_inputs=(x,))
    chains, inputs = measure_plan_inputs(fused, (x,))
    costs, gaps, floor = inputs.costs(), inputs.gaps(), inputs.floor
    assert [c.norms for c in costs] == [("channel_layer_norm", "", "")] * 2, costs
    plans = [[list(f)] * 2 for f in itertools.product((False, True), repeat=3)] + [[[True] * 3, [False] * 3],
                                                                                  [[False] * 3, [True] * 3]]
    dearer = 0
    for keeps in plans:
        for may_drop in (drops_needed(costs, keeps, floor, gaps), [True, True], [False, False]):
            apply_plan(chains, keeps, may_drop)
            measured = measure_peak(fused, (x,))
            assert any(p.op.startswith("NormChainFunctionBackward/") for p in measured.points)
            assert step_peak(costs, keeps, floor, may_drop=may_drop, gaps=gaps)[0] == measured.peak, (keeps, may_drop)
        dearer += step_peak(costs, keeps, floor, may_drop=[False] * 2, gaps=gaps)[0] > \
            step_peak(costs, keeps, floor, may_drop=[True] * 2, gaps=gaps)[0]
    assert dearer  # the plans where the LayerNorm's output is kept peak higher, and the model says so
