"""How many times ``convert(model, example_inputs=x)`` runs the model (issue 41 item 3: convert's
time is its steps), counted, not timed: an opaque custom ``autograd.Function`` inside the model
(it stays one call in the rewrite: Note: [autograd Functions stay whole]) counts every forward
and backward that really runs, and the batch each runs at. The check runs one eager and one
converted training step, and one eager forward without autograd for the outputs and statistics
it compares (Note: [the eager reference within a training step's peak]), on the first two
samples of a batch of 8 or more on the CPU (Note: [the check on a slice of the batch] in
check/slice_check.py), else at the example batch; the planner one recorded step of each, whose
forward also gives the saves it reads (Note: [the saves read off the recorded step]), at two
slices of the batch (1 and 2 samples, else 2 and 3) put on lines to it (Note: [measured on two
slices of the batch] in sliced_measure.py): seven forwards and six backwards, none of them at
the example batch of 8, no forward of its own for the saved bytes."""
from __future__ import annotations

from typing import Any, List

import pytest
import torch
from torch import nn

import convbn
from convbn.passes.check import slice_check
from convbn.passes.check.validate import Comparison
from convbn.passes.plan import sliced_measure
from fusion_checks import assert_fused


class _Count(torch.autograd.Function):
    calls: List[str] = []
    batches: List[int] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _Count.calls.append("forward")
        _Count.batches.append(int(x.shape[0]))
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Count.calls.append("backward")
        return g * 1.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Count.apply(self.a(x))
        return self.head(self.b(y).mean((2, 3)))


def _runs(batch: int = 8, **options: Any) -> List[str]:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(batch, 3, 32, 32)
    _Count.calls.clear()
    _Count.batches.clear()
    fast = convbn.convert(model, example_inputs=x, **options)
    assert_fused(fast, pairs=2)
    assert fast.convbn_report.validated == [""]  # the check ran
    return list(_Count.calls)


def test_convert_with_example_inputs_runs_every_step_on_slices() -> None:
    calls = _runs()
    assert calls.count("forward") == 7 and calls.count("backward") == 6, calls
    # the check's eager step and eager forward, its converted step on the first two samples,
    # then the planner's eager and converted step at 1, then at 2
    assert calls[:5] == ["forward", "backward", "forward", "forward", "backward"], calls
    assert _Count.batches == [2, 2, 2, 1, 1, 2, 2], _Count.batches


class _PooledNorm(_Net):
    """A BatchNorm1d after global pooling: one sample gives one value per channel, which training
    mode refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(16, 4), nn.BatchNorm1d(4))


def test_a_model_that_refuses_one_sample_is_recorded_at_two_and_three(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = _PooledNorm(), torch.randn(8, 3, 32, 32)
    _Count.calls.clear()
    _Count.batches.clear()
    fast = convbn.convert(model, example_inputs=x, progress=False)
    assert_fused(fast, pairs=3)
    assert fast.convbn_report.validated == [""]
    # the check on two samples; the planner's eager step raised at one sample (its forward
    # reached the pooled norm), then 2 and 3
    assert _Count.batches == [2, 2, 2, 1, 2, 2, 3, 3], _Count.batches
    monkeypatch.setattr(sliced_measure, "MIN_BATCH", 10 ** 9)  # recorded at the example batch
    full = convbn.convert(model, example_inputs=x, progress=False)
    assert full.convbn_report.plan.chains == fast.convbn_report.plan.chains
    assert full.convbn_report.predicted_peak_bytes == fast.convbn_report.predicted_peak_bytes


def test_a_batch_below_the_slices_minimum_records_at_the_example_batch() -> None:
    calls = _runs(batch=4)
    assert calls.count("forward") == 5 and calls.count("backward") == 4, calls
    assert _Count.batches == [4, 4, 4, 4, 4], _Count.batches


def test_a_strategy_without_the_planner_runs_the_check_and_its_measurement() -> None:
    """``recompute_conv``: the check's two steps, then the saved bytes of each side (a forward each)."""
    calls = _runs(strategy="recompute_conv")
    assert calls.count("backward") == 2, calls


class _BatchBranch(_Net):
    """Python code on the batch size: the symbolic trace fails on it, so the root is traced with
    real shapes (a graph for batch 8 alone, guarded on its input shapes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Count.apply(self.a(x))
        if y.shape[0] >= 8:
            y = y * 2.0
        return self.head(self.b(y).mean((2, 3)))


class _BatchOfEight(_Net):
    """A batch size written into the code (a ``reshape``): the model runs at batch 8 only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Count.apply(self.a(x))
        return self.head(self.b(y).mean((2, 3)).reshape(8, 16))


def _counted(model: nn.Module, **options: Any) -> Any:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    _Count.calls.clear()
    _Count.batches.clear()
    fast = convbn.convert(model, example_inputs=x, progress=False, **options)
    assert fast.convbn_report.validated == [""]  # the check ran, on the whole model, and passed
    return fast


def test_a_graph_traced_with_real_shapes_is_checked_at_the_example_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note: [the check on a slice of the batch]: a graph for batch 8 runs another graph at 2."""
    fast = _counted(_BatchBranch())
    assert_fused(fast, pairs=2)
    sliced = list(_Count.batches)
    assert 2 not in sliced[:sliced.index(1)], sliced  # nothing ran at two samples before the planner
    monkeypatch.setattr(slice_check, "MIN_BATCH", 10 ** 9)
    _counted(_BatchBranch())
    assert sliced == _Count.batches  # the schedule of a check at the example batch


def test_a_model_that_refuses_the_slice_is_checked_at_the_example_batch() -> None:
    fast = _counted(_BatchOfEight())
    assert_fused(fast, pairs=2)
    # the check's eager step raised at two samples (after the counted call; again with the inputs
    # as given), then the check at 8; the planner's steps raised at 1 and at 2, then were recorded at 8
    assert _Count.batches == [2, 2, 8, 8, 8, 1, 2, 8, 8], _Count.batches


def test_a_difference_on_the_slice_is_decided_at_the_example_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice that differs (here: made to) is not the verdict: the check at the batch is, and a
    rewrite it passes converts whole; one it refuses is converted part by part, as before."""
    real = slice_check.check_step
    seen: List[int] = []

    def differs_on_slices(module: nn.Module, args: Any, kwargs: Any) -> Comparison:
        seen.append(int(args[0].shape[0]))
        result = real(module, args, kwargs)
        return Comparison(False, 1.0, 0.5, "made to differ") if args[0].shape[0] < 8 else result

    monkeypatch.setattr(slice_check, "check_step", differs_on_slices)
    fast = _counted(_Net())
    assert_fused(fast, pairs=2)
    assert seen == [2, 8]
    assert fast.convbn_report.untraced == []  # converted whole


def test_the_plan_and_report_are_those_of_a_check_at_the_example_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers keep the shapes of the example batch (on the lines through the planner's slices),
    and the plan, the predicted peak and the report's figures are those of the schedule with every
    step at the example batch."""
    fast = _counted(_PooledNorm())
    assert 8 not in _Count.batches, _Count.batches  # nothing ran at the example batch
    monkeypatch.setattr(slice_check, "MIN_BATCH", 10 ** 9)
    monkeypatch.setattr(sliced_measure, "MIN_BATCH", 10 ** 9)
    slow = _counted(_PooledNorm())
    assert _Count.batches == [8] * 5, _Count.batches  # the schedule before the slices
    a, b = fast.convbn_report, slow.convbn_report
    assert a.plan.chains == b.plan.chains
    assert (a.eager_peak_bytes, a.predicted_peak_bytes, a.eager_saved_bytes, a.floor_saved_bytes, a.saved_bytes) == \
        (b.eager_peak_bytes, b.predicted_peak_bytes, b.eager_saved_bytes, b.floor_saved_bytes, b.saved_bytes)
    shapes = [[(l.x_shape, l.y_shape, l.y_dtype) for c in sliced_measure.chains_of(m) for l in c.layers]
              for m in (fast, slow)]
    assert shapes[0] == shapes[1] and shapes[0][0][0][0] == 8, shapes


def test_parts_checked_on_slices_after_a_refused_whole_keep_the_planner_on_slices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-model rewrite refused (here: made to be) is undone and its parts are converted and
    checked on their own inputs, on slices; the planner reads the parts' shapes at that slice."""
    real = slice_check.check_step

    def refuse_the_root(module: nn.Module, args: Any, kwargs: Any) -> Comparison:
        result = real(module, args, kwargs)
        return Comparison(False, 1.0, 0.5, "made to differ") if isinstance(module, _Net) else result

    monkeypatch.setattr(slice_check, "check_step", refuse_the_root)
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    _Count.calls.clear()
    _Count.batches.clear()
    fast = convbn.convert(_Net(), example_inputs=x, progress=False)
    assert_fused(fast, pairs=2)
    assert fast.convbn_report.validated == ["a", "b"]  # the parts, each checked
    # the whole's check at 2, then at 8 (both refused), the eager run that finds the parts' inputs
    # at 8, then the planner at 1 and 2 only
    assert _Count.batches == [2, 2, 2, 8, 8, 8, 8, 1, 1, 2, 2], _Count.batches
