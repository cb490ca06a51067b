"""``convert(example_inputs=x)`` must not raise where eager trains: a model that sets
``requires_grad`` on a view of its input (the validation step used to make the input require
grad first), and a model whose first output needs no gradient (the peak measurement used to
differentiate the first output)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import TOL, assert_same_state, step, twins
from fusion_checks import assert_chain_ran, assert_fused


class ViewFlag(nn.Module):
    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        v = x[:, :] if self.flag == "off" else x.view(x.shape)
        if self.flag == "off":
            v.requires_grad_(False)
        else:
            v.requires_grad = True
        return torch.relu(self.bn(self.conv(v)))


class IndexFirst(nn.Module):
    """Returns the argmax of its input first, the trained features second."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return x.argmax(1), torch.relu(self.bn(self.conv(x)))


def x_(seed: int = 1):
    return torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make", [lambda: ViewFlag("off"), lambda: ViewFlag("on"), IndexFirst],
                         ids=["requires_grad_false_on_view", "requires_grad_true_on_view", "index_output_first"])
def test_convert_with_example_inputs_trains_as_eager(make):
    eager, twin = twins(make)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = convbn.convert(twin, example_inputs=x_())
    report = assert_fused(fast, pairs=1)
    assert report.validated == [""], report  # the whole model checked against eager, not part by part
    for s in range(3):
        out, ref = fast(x_(s)), eager(x_(s))
        pick = (lambda o: o[1]) if isinstance(ref, tuple) else (lambda o: o)
        if isinstance(ref, tuple):
            assert torch.equal(out[0], ref[0])
        g = torch.randn(pick(ref).shape, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        pick(out).backward(g), pick(ref).backward(g)
        torch.testing.assert_close(pick(out), pick(ref), **TOL)
        assert_same_state(eager, fast)
    assert_chain_ran(pick(fast(x_())), calls=1)


def test_peak_measured_on_the_trained_output():
    fast = convbn.convert(IndexFirst().double(), example_inputs=x_())
    report = assert_fused(fast, pairs=1)
    assert report.predicted_peak_bytes is not None and report.predicted_peak_bytes > 0, report
    assert report.eager_saved_bytes > 0
