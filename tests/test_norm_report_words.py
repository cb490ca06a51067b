"""The reports count every norm they handle, so their words say "norms", not "BatchNorms"
(issue 39: a GroupNorm / InstanceNorm / channel LayerNorm net's report names no BatchNorm)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import convbn


def _net() -> nn.Module:
    # the first GroupNorm fuses; the second follows a Linear, so it is listed as skipped
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Flatten(2),
                         nn.Linear(36, 36), nn.GroupNorm(4, 8))


def test_convert_report_counts_norms_and_names_no_batchnorm() -> None:
    fast = convbn.convert(_net())
    text = str(fast.convbn_report)
    assert "1 pairs fused in 1 chains, 1 norms skipped" in text.splitlines()[0], text
    assert text.splitlines()[1].split()[:4] == ["chain.pos", "conv", "norm", "tail"], text
    assert "BatchNorm" not in text, text


@pytest.mark.expect_unfused("a model with nothing to fuse: the warning's words are the test")
def test_nothing_fused_warning_says_norm() -> None:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        convbn.convert(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    words = [str(w.message) for w in got if "fused nothing" in str(w.message)]
    assert words and "no Conv -> norm pair found" in words[0], words


def test_fold_report_header_says_norm() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8, affine=True, track_running_stats=True)).eval()
    text = str(convbn.fold(model, example_inputs=torch.randn(1, 3, 8, 8)).convbn_report)
    assert "norm calls/modules)" in text.splitlines()[0] and text.splitlines()[1].split()[0] == "norm", text
