"""How many times ``convert(model, example_inputs=x)`` runs the model (issue 41 item 3: convert's
time is its steps), counted, not timed: an opaque custom ``autograd.Function`` inside the model
(it stays one call in the rewrite: Note: [autograd Functions stay whole]) counts every forward
and backward that really runs, and the batch each runs at. The check runs one eager and one
converted training step at the example batch, and one eager forward without autograd for the
outputs and statistics it compares (Note: [the eager reference within a training step's peak]);
the planner one recorded step of each, whose forward also gives the saves it reads (Note: [the
saves read off the recorded step]), at two slices of the batch (1 and 2 samples, else 2 and 3)
put on lines to it (Note: [measured on two slices of the batch] in sliced_measure.py): seven
forwards and six backwards, no forward of its own for the saved bytes."""
from __future__ import annotations

from typing import Any, List

import pytest
import torch
from torch import nn

import convbn
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


def test_convert_with_example_inputs_runs_two_full_steps_and_two_on_slices() -> None:
    calls = _runs()
    assert calls.count("forward") == 7 and calls.count("backward") == 6, calls
    # the check's eager step and eager forward, its converted step at the example batch, then
    # the planner's eager and converted step at 1, then at 2
    assert calls[:5] == ["forward", "backward", "forward", "forward", "backward"], calls
    assert _Count.batches == [8, 8, 8, 1, 1, 2, 2], _Count.batches


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
    # the planner's eager step raised at one sample (its forward reached the pooled norm), then 2 and 3
    assert _Count.batches == [8, 8, 8, 1, 2, 2, 3, 3], _Count.batches
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
