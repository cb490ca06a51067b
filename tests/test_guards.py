"""What training code does to a model after ``convert`` is never silently ignored.

A converted model and an eager twin (same weights, float64) go through the same steps while
something changes between them: an attribute on a schedule read in ``forward`` (a residual
scale, ``F.dropout(x, self.p)``), a flag that switches a branch, a conv re-initialised by
assignment, a BatchNorm swapped for ``nn.Identity`` and back, ``nn.SyncBatchNorm``
conversion. Every step must match eager (outputs, input and parameter gradients, running
statistics, ``num_batches_tracked``), the chains must run fused where fusion is expected,
and a message and the report must say what changed and what runs now. A model nothing
happens to is never captured again and warns nothing.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import convbn
from convbn.passes.convert.recapture import MAX_RECAPTURES
from fusion_checks import assert_chain_ran, assert_fused

DT = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


class Block(nn.Module):
    """Conv -> BN -> ReLU, a dropout and a residual scaled by Python attributes, and an
    optional squeeze branch behind a flag: everything ``forward`` reads that the trace bakes."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.scale = 1.0
        self.p = 0.0
        self.squeeze = False

    def forward(self, x: Tensor) -> Tensor:
        y = F.dropout(F.relu(self.bn(self.conv(x))), self.p, self.training)
        if self.squeeze:
            y = y * torch.sigmoid(y.mean((2, 3), keepdim=True))
        return x + self.scale * y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.block1 = Block(4)
        self.block2 = Block(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block2(self.block1(self.stem(x))).mean((2, 3)))


def twins(**kw: Any) -> tuple:
    torch.manual_seed(0)
    eager = Net().to(DT)
    with torch.no_grad():
        for m in eager.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    fast = convbn.convert(copy.deepcopy(eager), **kw)
    return eager, fast


X = torch.randn(4, 3, 6, 6, dtype=DT, generator=torch.Generator().manual_seed(1))


def step(model: nn.Module, seed: int) -> tuple:
    x = X.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = model(x)
    y.backward(torch.randn(y.shape, dtype=DT, generator=torch.Generator().manual_seed(seed + 100)))
    return y, x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def same_step(eager: nn.Module, fast: nn.Module, seed: int, fused: bool = True) -> Tensor:
    """One training step of each, compared; returns the converted model's output."""
    ye, ge, pe = step(eager, seed)
    yf, gf, pf = step(fast, seed)
    torch.testing.assert_close(yf, ye, **TOL, msg=lambda m: f"output: {m}")
    torch.testing.assert_close(gf, ge, **TOL, msg=lambda m: f"input grad: {m}")
    assert pf.keys() == pe.keys(), (sorted(pf), sorted(pe))
    for n in pe:
        torch.testing.assert_close(pf[n], pe[n], **TOL, msg=lambda m: f"grad {n}: {m}")
    be, bf = dict(eager.named_buffers()), dict(fast.named_buffers())
    assert be.keys() == bf.keys()
    for n in be:
        if be[n].is_floating_point():
            torch.testing.assert_close(bf[n], be[n], **TOL, msg=lambda m: f"buffer {n}: {m}")
        else:  # num_batches_tracked
            assert torch.equal(bf[n], be[n]), (n, bf[n], be[n])
    if fused:
        assert_chain_ran(yf)
    return yf


def steps_with_messages(eager: nn.Module, fast: nn.Module, seed: int, fused: bool = True) -> List[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same_step(eager, fast, seed, fused)
    return [str(w.message) for w in caught]


def test_attribute_on_a_schedule_is_captured_again() -> None:
    """A residual scale on a warm-up schedule: each new value is what runs, fused."""
    eager, fast = twins()
    assert_fused(fast, pairs=3)
    same_step(eager, fast, 0)
    for i, scale in enumerate((0.25, 0.5)):
        for m in (eager, fast):
            m.block1.scale = scale
        msgs = steps_with_messages(eager, fast, i + 1)
        assert any("block1 (Block).scale changed from" in s and "re-captured" in s for s in msgs), msgs
    assert_fused(fast, pairs=3)
    assert len(fast.convbn_report.changes) == 2, fast.convbn_report.changes
    assert "scale changed from 0.25 to 0.5" in str(fast.convbn_report)


def test_dropout_probability_changed() -> None:
    """``F.dropout(x, self.p)`` with ``self.p`` raised after convert: eager's dropout runs."""
    eager, fast = twins()
    same_step(eager, fast, 0)
    for m in (eager, fast):
        m.block2.p = 0.3
    msgs = steps_with_messages(eager, fast, 1)
    assert any("block2 (Block).p changed from 0.0 to 0.3" in s for s in msgs), msgs
    same_step(eager, fast, 2)
    assert any("dropout(0.3)" in p.activation for p in fast.convbn_report.pairs), str(fast.convbn_report)


def test_flag_switches_a_branch() -> None:
    eager, fast = twins()
    same_step(eager, fast, 0)
    for m in (eager, fast):
        m.block1.squeeze = True
    msgs = steps_with_messages(eager, fast, 1)
    assert any("block1 (Block).squeeze changed from False to True" in s for s in msgs), msgs
    for m in (eager, fast):
        m.block1.squeeze = False
    steps_with_messages(eager, fast, 2)
    assert_fused(fast, pairs=3)


def test_conv_reinitialised_by_assignment_gets_gradients() -> None:
    eager, fast = twins()
    same_step(eager, fast, 0)
    torch.manual_seed(5)
    new = nn.Conv2d(4, 4, 3, padding=1, bias=False).to(DT)
    eager.block1.conv = copy.deepcopy(new)
    fast.block1.conv = new
    msgs = steps_with_messages(eager, fast, 1)
    assert any("block1 (Block).conv was replaced (Conv2d -> Conv2d)" in s for s in msgs), msgs
    assert new.weight.grad is not None
    torch.testing.assert_close(new.weight.grad, eager.block1.conv.weight.grad, **TOL)
    assert_fused(fast, pairs=3)
    report = fast.convbn_report
    assert {(p.conv, p.bn) for p in report.pairs} == {("stem.0", "stem.1"), ("block1.conv", "block1.bn"),
                                                      ("block2.conv", "block2.bn")}


def test_batchnorm_swapped_for_identity_and_back() -> None:
    eager, fast = twins()
    same_step(eager, fast, 0)
    bn_e, bn_f = eager.block2.bn, fast.block2.bn
    eager.block2.bn = nn.Identity()
    fast.block2.bn = nn.Identity()
    msgs = steps_with_messages(eager, fast, 1)
    assert any("block2 (Block).bn was replaced (BatchNorm2d -> Identity)" in s for s in msgs), msgs
    report = fast.convbn_report
    assert len(report.pairs) == 2 and not any(p.bn == "block2.bn" for p in report.pairs), str(report)
    assert not any(o.batchnorm == "block2.bn" and o.result == "fused" for o in report.outcomes)
    eager.block2.bn, fast.block2.bn = bn_e, bn_f  # the second swap: back to the same BatchNorm
    msgs = steps_with_messages(eager, fast, 2)
    assert any("block2 (Block).bn was replaced (Identity -> BatchNorm2d)" in s for s in msgs), msgs
    assert_fused(fast, pairs=3)
    assert [o.result for o in fast.convbn_report.outcomes if o.batchnorm == "block2.bn"] == ["fused"]


@pytest.fixture
def one_process_group():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sync_batchnorm_conversion_after_convert(one_process_group: None) -> None:
    eager, fast = twins()
    same_step(eager, fast, 0)
    # torch's SyncBatchNorm refuses CPU inputs; over one process it computes what BatchNorm
    # does, so the eager twin keeps its BatchNorms
    fast = nn.SyncBatchNorm.convert_sync_batchnorm(fast)
    msgs = steps_with_messages(eager, fast, 1)
    assert any("was replaced (BatchNorm2d -> SyncBatchNorm)" in s and "re-captured" in s for s in msgs), msgs
    same_step(eager, fast, 2)
    assert_fused(fast, pairs=3)
    # every BatchNorm the converted model now holds reduces over the process group
    bns = [m for m in fast.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(bns) == 3 and all(type(m).__name__ == "SyncBatchNorm" for m in bns)


def test_no_change_no_recapture_no_warning() -> None:
    """Train, evaluate, train again, copy: nothing changed, so nothing is captured again."""
    eager, fast = twins()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(3):
            same_step(eager, fast, s)
        eager.eval(), fast.eval()
        with torch.no_grad():
            torch.testing.assert_close(fast(X), eager(X), **TOL)
        eager.train(), fast.train()
        same_step(eager, fast, 3)
        twin = copy.deepcopy(fast)
        same_step(copy.deepcopy(eager), twin, 4)
    assert fast.convbn_report.changes == [] and twin.convbn_report.changes == []
    assert_fused(fast, pairs=3)


class Counting(Net):
    """A forward with a Python side effect: a call counter (not read by the computation)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return super().forward(x)


@pytest.mark.parametrize("example", [False, True], ids=["lazy", "example_inputs"])
def test_the_checks_own_runs_are_no_change(example: bool) -> None:
    """The checks (first call and first backward, or convert's own on ``example_inputs``) run
    the module's own forward, which bumps a counter: that is not a change of the model, so
    nothing is captured again."""
    torch.manual_seed(0)
    eager = Counting().to(DT)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=X if example else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(3):
            same_step(eager, fast, s)
    assert fast.convbn_report.changes == []


def test_a_copy_follows_its_own_changes() -> None:
    """A deep copy's guards watch the copy's modules, not the original's."""
    eager, fast = twins()
    same_step(eager, fast, 0)
    eager2, fast2 = copy.deepcopy(eager), copy.deepcopy(fast)
    eager2.block1.scale = fast2.block1.scale = 0.5
    msgs = steps_with_messages(eager2, fast2, 1)
    assert any("scale changed" in s for s in msgs), msgs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same_step(eager, fast, 1)
    assert fast.convbn_report.changes == []


@pytest.mark.expect_unfused("past the re-capture limit the module's own forward runs (unfused) by design")
def test_recapture_limit_runs_the_original() -> None:
    """A value set on every step: after the limit, the module's own forward runs, and says so."""
    eager, fast = twins()
    seen: List[str] = []
    for s in range(MAX_RECAPTURES + 2):
        for m in (eager, fast):
            m.block1.scale = 1.0 + 0.1 * (s + 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            same_step(eager, fast, s, fused=s < MAX_RECAPTURES)
        seen += [str(w.message) for w in caught]
    assert sum("re-captured" in m for m in seen) == MAX_RECAPTURES, seen
    assert sum("running the original (unfused) Net forward" in m for m in seen) == 1, seen
    report = fast.convbn_report
    assert report.pairs == [] and all(o.result == "left" for o in report.outcomes), str(report)
    assert "past the limit" in str(report)
