"""The planner's recorded steps taken at two slices of the batch and put on lines (Note:
[measured on two slices of the batch] in passes/plan/sliced_measure.py) give exactly what the
recordings at the example batch give: the eager step's saved bytes and peak, and every number
of the planner's inputs (each timeline point, saved bytes, prefixes, shapes, MACs)."""
from __future__ import annotations

from typing import Any, Callable, Tuple

import pytest
import torch
from torch import nn

import convbn
from convbn.passes.graph.graph_module import eager
from convbn.passes.graph.share_copy import share_copy
from convbn.passes.plan import sliced_measure
from convbn.passes.plan.sliced_measure import record_eager_and_chains, recorded_on_slices
from fusion_checks import assert_fused


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Hardswish(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


def _resnet18() -> nn.Module:
    pytest.importorskip("torchvision")
    from zoo import import_torchvision_without_fake_kernels

    return import_torchvision_without_fake_kernels().models.resnet18()


def _both(make: Callable[[], nn.Module], shape: Tuple[int, ...]) -> Tuple[Any, Any]:
    torch.manual_seed(0)
    x = torch.randn(shape)
    fast = convbn.convert(make(), example_inputs=x, progress=False)
    with eager(fast):
        reference = share_copy(fast)
    state = {k: v.clone() for k, v in fast.state_dict().items()}
    sliced = recorded_on_slices(reference, fast, (x,))
    assert all(torch.equal(v, fast.state_dict()[k]) for k, v in state.items())  # state put back
    return sliced, record_eager_and_chains(reference, fast, (x,))


@pytest.mark.parametrize("make, shape", [(_net, (8, 3, 16, 16)), (_net, (11, 3, 12, 20)),
                                         (_resnet18, (8, 3, 64, 64))])
def test_the_lines_give_what_the_example_batch_gives(make: Callable[[], nn.Module], shape: Tuple[int, ...]) -> None:
    sliced, full = _both(make, shape)
    assert sliced is not None  # the slices were used
    assert sliced.inputs.batch == full.inputs.batch == shape[0]
    assert sliced.inputs == full.inputs
    assert (sliced.eager_saved, sliced.eager_peak, sliced.eager_points, sliced.eager_ops) == \
        (full.eager_saved, full.eager_peak, full.eager_points, full.eager_ops)
    assert [id(c) for c in sliced.ordered] == [id(c) for c in full.ordered]


def test_the_report_and_plan_are_those_of_the_example_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole convert: the plan, the predicted peak and the report's figures are the same
    with the slices as with recordings at the example batch, and the layers keep its shapes."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16)
    model = _net()
    fast = convbn.convert(model, example_inputs=x, progress=False)
    assert_fused(fast, pairs=3)
    monkeypatch.setattr(sliced_measure, "MIN_BATCH", 10 ** 9)
    slow = convbn.convert(model, example_inputs=x, progress=False)
    a, b = fast.convbn_report, slow.convbn_report
    assert a.plan.chains == b.plan.chains
    assert (a.eager_peak_bytes, a.predicted_peak_bytes, a.eager_saved_bytes, a.floor_saved_bytes, a.saved_bytes) == \
        (b.eager_peak_bytes, b.predicted_peak_bytes, b.eager_saved_bytes, b.floor_saved_bytes, b.saved_bytes)
    assert [l.y_shape for c in sliced_measure.chains_of(fast) for l in c.layers] == \
        [l.y_shape for c in sliced_measure.chains_of(slow) for l in c.layers]


def test_a_small_batch_or_a_layer_the_lines_do_not_fit_is_recorded_at_the_batch() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    fast = convbn.convert(_net(), example_inputs=x, progress=False)
    with eager(fast):
        reference = share_copy(fast)
    assert recorded_on_slices(reference, fast, (x,)) is None  # below MIN_BATCH
    x8 = torch.randn(8, 3, 16, 16)
    layer = next(l for c in sliced_measure.chains_of(fast) for l in c.layers)
    layer.y_shape = (4, *layer.y_shape[1:])  # shapes not those the example batch gives
    assert recorded_on_slices(reference, fast, (x8,)) is None


class _OnlyItsBatch(nn.Module):
    """Runs at batch 8 alone (a model written for one batch size)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 8:
            raise ValueError(f"batch 8 only, not {x.shape[0]}")
        return self.body(x).mean((1, 2, 3))


def test_a_model_that_fails_at_a_slice_is_recorded_at_its_batch() -> None:
    torch.manual_seed(0)
    model, x = _OnlyItsBatch(), torch.randn(8, 3, 8, 8)
    fast = convbn.convert(model, example_inputs=x, progress=False)
    assert_fused(fast, pairs=1)
    assert fast.convbn_report.validated == [""] and fast.convbn_report.eager_peak_bytes > 0
    with eager(fast):
        reference = share_copy(fast)
    state = {k: v.clone() for k, v in fast.state_dict().items()}
    assert recorded_on_slices(reference, fast, (x,)) is None
    assert all(torch.equal(v, fast.state_dict()[k]) for k, v in state.items())
