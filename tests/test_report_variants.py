"""The report says what ran when a module is called unlike its capture (Note: [a report says
what ran, call by call] in passes/report/calls_seen.py).

A block whose ``forward(x, inject=None)`` puts ``y + inject`` between ``conv1`` and ``norm1``
when ``inject`` is given: captured with ``inject=None`` (``conv1 -> norm1`` fuses), then called
with it (a variant runs, where ``norm1`` cannot fuse). A counting probe on ``FusedChain.forward``
(which norms went through the fused Function) must agree with the report, and the converted
model must train as its eager twin does.
"""
from __future__ import annotations

import collections
from typing import Callable, Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convbn
from capture_helpers import assert_same_state, step, twins
from fusion_checks import FUSED_BACKWARDS
from convbn.nn.chain import FusedChain

NORMS = {"batchnorm": lambda: nn.BatchNorm2d(8), "groupnorm": lambda: nn.GroupNorm(2, 8)}


class Block(nn.Module):
    def __init__(self, norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(3, 8, 3, padding=1), norm()
        self.conv2, self.norm2 = nn.Conv2d(3, 8, 1), norm()

    def forward(self, x, inject=None):
        y = self.conv1(x)
        if inject is not None:
            y = y + inject  # conv1 -> add -> norm1: no chain in calls with inject
        return F.relu(self.norm1(y)) + F.relu(self.norm2(self.conv2(x)))


class Net(nn.Module):
    """Calls its block without ``inject`` (``use == 0``), with it (1) or both ways (2)."""

    def __init__(self, norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.block = Block(norm)
        self.use = 0

    def forward(self, x):
        if float(x.detach().mean()) > 1e9:  # reads a value: the root does not trace, the block is captured alone
            x = x * 2
        inject = torch.full((1, 8, 1, 1), 0.5, dtype=x.dtype)
        if self.use == 0:
            return self.block(x)
        if self.use == 1:
            return self.block(x, inject)
        return self.block(x) + self.block(x, inject)


@pytest.fixture
def probe(monkeypatch) -> Counter:
    """Per norm's qualified name, how many chain calls ran it through the fused Function (a new
    variant's first call runs its chains for its own check too)."""
    ran: Counter = collections.Counter()
    forward = FusedChain.forward

    def counting(self, *inputs):
        out = forward(self, *inputs)
        if type(out.grad_fn).__name__ in FUSED_BACKWARDS:
            ran.update(layer.names[1] for layer in self.layers if layer.names[1])
        return out

    monkeypatch.setattr(FusedChain, "forward", counting)
    return ran


def outcomes(model):
    return {o.batchnorm: o for o in model.convbn_report.outcomes}


def train(eager, fast, x, use, seed=0):
    eager.use = fast.use = use
    for m in (eager, fast):
        step(m, x, seed=seed)
    assert_same_state(eager, fast)


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("with_inputs", [False, True])
def test_report_says_what_calls_with_the_other_argument_ran(norm, with_inputs, probe):
    eager, model = twins(lambda: Net(NORMS[norm]))
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(model, example_inputs=(x,) if with_inputs else None)
    train(eager, fast, x, use=0)
    now = outcomes(fast)
    assert now["block.norm1"].result == now["block.norm2"].result == "fused", fast.convbn_report
    probe.clear()
    train(eager, fast, x, use=1, seed=1)
    assert set(probe) == {"block.norm2"}, probe  # norm1 ran as a module in the call with inject
    now = outcomes(fast)
    assert now["block.norm2"].result == "fused", fast.convbn_report
    assert now["block.norm1"].result == "left", fast.convbn_report
    assert "inject=<given>" in now["block.norm1"].reason and "runs as modules" in now["block.norm1"].reason
    assert "block.norm1" in str(fast.convbn_report)  # listed as skipped
    assert [n for n, _ in convbn.fused_modules(fast)] == ["block.convbn_chain0_"]  # the variant's chain only
    assert outcomes(fast) == now, "a second read with no call between says the same"
    probe.clear()
    train(eager, fast, x, use=0, seed=2)  # called as captured again: fused again
    assert set(probe) == {"block.norm1", "block.norm2"}, probe
    again = outcomes(fast)["block.norm1"]
    assert (again.result, again.reason) == ("fused", ""), fast.convbn_report  # the calls since the last read only


@pytest.mark.parametrize("norm", list(NORMS))
def test_both_kinds_of_call_since_the_last_read_are_both_said(norm, probe):
    eager, model = twins(lambda: Net(NORMS[norm]))
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(model)
    train(eager, fast, x, use=0)
    outcomes(fast)
    probe.clear()
    train(eager, fast, x, use=2, seed=1)  # both kinds in one step
    assert set(probe) == {"block.norm1", "block.norm2"}, probe
    one = outcomes(fast)["block.norm1"]
    assert one.result == "fused", fast.convbn_report
    assert one.reason.startswith("fused in some calls: fused in calls with inject=None;"), one.reason
    assert "in calls with inject=<given>:" in one.reason, one.reason
    assert outcomes(fast)["block.norm2"].reason == "", fast.convbn_report  # fused in both kinds
    pair = next(p for p in fast.convbn_report.pairs if p.bn == "block.norm1")
    assert pair.status == one.reason
    assert f"block.norm1: {one.reason}" in str(fast.convbn_report)



@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("with_inputs", [False, True])
def test_a_norm_only_a_variant_fuses_is_reported_fused_when_its_calls_ran(norm, with_inputs, probe):
    eager, model = twins(lambda: Net(NORMS[norm]))
    eager.use = model.use = 1  # with example_inputs captured with inject (norm1 left), without them for inject=None
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(model, example_inputs=(x,) if with_inputs else None)
    train(eager, fast, x, use=1)
    assert set(probe) == {"block.norm2"}, probe
    now = outcomes(fast)
    assert (now["block.norm1"].result, now["block.norm2"].result) == ("left", "fused"), fast.convbn_report
    probe.clear()
    train(eager, fast, x, use=0, seed=1)  # the variant for inject=None fuses conv1 -> norm1
    assert set(probe) == {"block.norm1", "block.norm2"}, probe
    one = outcomes(fast)["block.norm1"]
    assert (one.result, one.layer, one.direction, one.reason) == ("fused", "block.conv1", "preceding", ""), one
    probe.clear()
    train(eager, fast, x, use=2, seed=2)  # both kinds
    assert set(probe) == {"block.norm1", "block.norm2"}, probe
    one = outcomes(fast)["block.norm1"]
    assert one.result == "fused" and one.reason.startswith("fused in some calls: fused in calls with inject=None;"), one
    assert "in calls with inject=<given>: the" in one.reason and "does not fuse it" in one.reason, one
    probe.clear()
    train(eager, fast, x, use=1, seed=3)  # the first capture's kind only: left again, as recorded
    assert set(probe) == {"block.norm2"}, probe
    assert outcomes(fast)["block.norm1"].left, fast.convbn_report
