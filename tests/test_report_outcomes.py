"""Both passes report one :class:`BNOutcome` per BatchNorm: convert's and fold's reports
list the same record, with the layer, the direction and the reason."""
from __future__ import annotations

import copy
import warnings
from typing import Dict, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn
from convbn.passes.report.outcome import BNOutcome


class Mixed(nn.Module):
    """One BatchNorm of each fate.

    * ``bn_in`` reads the input and feeds ``conv1`` (no padding): convert fuses it as a
      pre-activation head, fold into the following conv -- both with ``conv1`` after it;
    * ``bn1`` follows ``conv1``: fused / folded with the conv before it;
    * ``bn_pool`` normalises a pooling output that is also added: left by both;
    * ``unused`` is never called: left by both.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bn_in = nn.BatchNorm2d(3)
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.bn1 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.bn_pool = nn.BatchNorm2d(8)
        self.unused = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(self.bn_in(x))))
        p = self.pool(y)
        return p + self.bn_pool(p)


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = Mixed()
    for bn in m.modules():
        if isinstance(bn, _BatchNorm):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return m


def _by_name(outcomes) -> Dict[str, Tuple[str, Optional[str], Optional[str]]]:
    return {o.batchnorm: (o.result, o.layer, o.direction) for o in outcomes}


def _one_per_bn(model: nn.Module, outcomes) -> None:
    names = sorted(n for n, m in model.named_modules() if isinstance(m, _BatchNorm))
    assert sorted(o.batchnorm for o in outcomes) == names
    assert all(type(o) is BNOutcome for o in outcomes)


def test_convert_and_fold_report_the_same_record_per_batchnorm() -> None:
    x = torch.randn(2, 3, 12, 12)
    model = _model()
    report = convbn.convert(copy.deepcopy(model), example_inputs=x).convbn_report
    folded = convbn.fold(copy.deepcopy(model).eval(), example_inputs=x)
    fold_report = folded.convbn_report

    for outcomes in (report.outcomes, fold_report.outcomes):
        _one_per_bn(model, outcomes)
    assert _by_name(report.outcomes) == {
        "bn_in": ("fused", "conv1", "following"),
        "bn1": ("fused", "conv1", "preceding"),
        "bn_pool": ("left", None, None),
        "unused": ("left", None, None),
    }
    assert _by_name(fold_report.outcomes) == {
        "bn_in": ("folded", "conv1", "following"),
        "bn1": ("folded", "conv1", "preceding"),
        "bn_pool": ("left", None, None),
        "unused": ("left", None, None),
    }
    for outcomes in (report.outcomes, fold_report.outcomes):
        reasons = {o.batchnorm: o.reason for o in outcomes if o.left}
        assert "'pool'" in reasons["bn_pool"] and "add" in reasons["bn_pool"]  # neither neighbour is a layer
        assert "not called" in reasons["unused"]

    # the attributes each report had before read the same outcomes
    assert report.skipped == [o for o in report.outcomes if o.left]
    assert {s.bn for s in report.skipped} == {"bn_pool", "unused"}
    assert {p.bn for p in report.pairs if p.bn} == {o.batchnorm for o in report.outcomes if o.result == "fused"}
    assert [a.batchnorm for a in fold_report.folded] == ["bn_in", "bn1"]
    assert {a.batchnorm for a in fold_report.skipped} == {"bn_pool", "unused"}
    assert "bn_pool" in str(report) and "bn_pool" in str(fold_report)


@pytest.mark.parametrize("kwargs, message", [
    (dict(result="dropped"), "result must be one of"),
    (dict(result="folded", direction="after"), "direction must be one of"),
    (dict(result="left"), "needs the reason"),
])
def test_outcome_rejects_what_no_pass_reports(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        BNOutcome("bn", **kwargs)


class RootBatchNorm(nn.Module):
    """``F.batch_norm`` on the traced module's own buffers (no BatchNorm submodule to name it
    after); ``computed=True`` normalises with the batch's variance instead, which neither pass
    can use."""

    def __init__(self, computed: bool) -> None:
        super().__init__()
        self.computed = computed
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("running_mean", torch.zeros(4))
        self.register_buffer("running_var", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        var = y.var((0, 2, 3)).detach() if self.computed else self.running_var
        return F.batch_norm(y, self.running_mean, var, training=False)


@pytest.mark.expect_unfused("the functional batch norm at the root may have no conv to fuse with")
@pytest.mark.parametrize("computed", [False, True])
def test_both_passes_name_a_functional_batch_norm_alike(computed: bool) -> None:
    """Both passes find BatchNorms with one discovery (bn_sites.bn_call), so a call has one
    name in both reports, whatever becomes of it."""
    model = RootBatchNorm(computed)
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "convbn.convert fused nothing")
        report = convbn.convert(copy.deepcopy(model), example_inputs=x).convbn_report
    fold_report = convbn.fold(copy.deepcopy(model).eval(), example_inputs=x).convbn_report
    (outcome,) = report.recorded  # what convert decided (this tiny chain then runs eager: never above eager)
    (fold_outcome,) = fold_report.outcomes
    assert outcome.batchnorm == fold_outcome.batchnorm == "batch_norm() call 'batch_norm' in <root>"
    assert (outcome.result, fold_outcome.result) == (("left", "left") if computed else ("fused", "folded"))
    if computed:
        assert "computed in forward" in outcome.reason and "computed in forward" in fold_outcome.reason
    else:
        assert [p.bn for p in report.pairs] == [outcome.batchnorm]  # a named BatchNorm, not a chain end


class WithSpare(nn.Module):
    """A BatchNorm registered under two names that forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.spare = self.alias = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def test_a_batchnorm_never_reached_gets_one_outcome_with_the_same_reason_in_both() -> None:
    model = WithSpare()
    x = torch.randn(2, 3, 6, 6)
    report = convbn.convert(copy.deepcopy(model), example_inputs=x).convbn_report
    fold_report = convbn.fold(copy.deepcopy(model).eval(), example_inputs=x).convbn_report
    for outcomes in (report.outcomes, fold_report.outcomes):
        assert sorted(o.batchnorm for o in outcomes) == ["bn", "spare"]  # one outcome, under its first name
    (left,) = report.skipped
    (fold_left,) = fold_report.skipped
    assert left == fold_left and "not called in the traced forward pass of '<root>'" in left.reason
