"""fold and per-sample norms (issue 39): an InstanceNorm normalising by its running statistics in
eval folds into the conv before it; GroupNorm and an InstanceNorm without running statistics are
reported with the exact reason (the norm table's ``fold``)."""
from __future__ import annotations

import copy

import torch
from torch import nn

import convbn


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
                      nn.ReLU(), nn.Conv2d(4, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3),
                      nn.InstanceNorm2d(4)).double().eval()
    with torch.no_grad():
        m[1].running_mean.normal_()
        m[1].running_var.uniform_(0.5, 2.0)
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.normal_()
    return m


def test_instance_norm_with_running_stats_folds_the_others_say_why() -> None:
    model = _model()
    folded = convbn.fold(copy.deepcopy(model))
    got = {o.batchnorm: (o.result, o.layer, o.reason) for o in folded.convbn_report.outcomes}
    assert got["1"] == ("folded", "0", "")
    assert got["4"][0] == "left" and got["4"][2].startswith("cannot fold: per-sample statistics (a GroupNorm")
    assert got["7"][0] == "left" and "without track_running_stats" in got["7"][2]
    assert isinstance(folded[4], nn.GroupNorm)  # left as it was
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    torch.testing.assert_close(folded(x), model(x), rtol=0, atol=1e-12)


def test_instance_norm_in_training_mode_is_not_folded() -> None:
    model = _model()
    model[1].train()  # normalises by each sample's statistics: no affine map to fold
    folded = convbn.fold(copy.deepcopy(model))
    got = {o.batchnorm: (o.result, o.reason) for o in folded.convbn_report.outcomes}
    assert got["1"][0] == "left" and "training mode" in got["1"][1]
