"""One tolerance rule (Note: [one tolerance rule] in passes/check/validate.py): every check
that compares a rewrite with eager -- convert's first-call and first-backward checks, the
whole-model step check on ``example_inputs``, fold's check and fold's first-call check --
reads the one table ``validate.TOLERANCES`` when it runs, and its numbers are the ones the
checks had before they were gathered there.

A fused ReLU made off by a relative 1e-5 (forward or backward, through the activation table)
is within every default row; with the check's row patched to allow nothing, the same check
refuses it. A check holding a constant of its own would pass under the patched row too.
"""
from __future__ import annotations

import dataclasses
from typing import Dict

import pytest
import torch
from torch import nn

import convbn
from convbn.functional import activations as A
from convbn.passes.check import validate
from convbn.passes.graph.graph_module import installed

aten = torch.ops.aten
OFF = 1 + 1e-5  # a rewrite off by a relative 1e-5: rounding-sized for float32's rows


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())


def x() -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _off_forward(mp: pytest.MonkeyPatch) -> None:
    mp.setitem(A._TABLE, "relu", dataclasses.replace(A._TABLE["relu"], forward=lambda a, z, ip: torch.relu(z) * OFF))


def _off_backward(mp: pytest.MonkeyPatch) -> None:
    rec = A._TABLE["relu"]
    mp.setitem(A._TABLE, "relu", dataclasses.replace(
        rec, backward=lambda a, g, z: aten.threshold_backward(g, z, 0) * OFF,
        backward_=lambda a, g, z: aten.threshold_backward(g, z, 0) * OFF,
        backward_from_output_=lambda a, g, o: aten.threshold_backward(g, o, 0) * OFF))


def convert_first_call(mp: pytest.MonkeyPatch) -> bool:
    _off_forward(mp)
    fast = convbn.convert(net(), strategy="recompute_bn")
    fast(x())
    return not installed(fast).fallback


def convert_first_backward(mp: pytest.MonkeyPatch) -> bool:
    _off_backward(mp)
    fast = convbn.convert(net(), strategy="recompute_bn")
    fast(x()).square().sum().backward()
    return not installed(fast).fallback


def convert_step_check(mp: pytest.MonkeyPatch) -> bool:
    _off_forward(mp)
    fast = convbn.convert(net(), strategy="recompute_bn", example_inputs=x())
    return installed(fast) is not None and len(fast.convbn_report.pairs) == 2


def fold_check(mp: pytest.MonkeyPatch) -> bool:
    try:
        folded = convbn.fold(net().eval(), example_inputs=x(), check=True)
    except RuntimeError:
        return False
    return folded.convbn_report.check.passed


def fold_first_call(mp: pytest.MonkeyPatch) -> bool:
    folded = convbn.fold(net().eval(), check=False)
    folded(x())
    return not installed(folded).fallback


# check -> (the row it reads, run it: did the rewrite pass?)
CHECKS: Dict[str, tuple] = {
    "convert first call": ("step", convert_first_call),
    "convert first backward": ("step", convert_first_backward),
    "convert step check (example_inputs)": ("step", convert_step_check),
    "fold check": ("fold", fold_check),
    "fold first call": ("step", fold_first_call),
}


def _params():
    for name, (row, _) in CHECKS.items():
        yield pytest.param(name, False, id=f"{name}-default")
        marks = [pytest.mark.expect_unfused("the check refuses the rewrite")] if name.startswith("convert") else []
        yield pytest.param(name, True, id=f"{name}-nothing allowed", marks=marks)


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
@pytest.mark.parametrize("check,strict", list(_params()))
def test_each_check_reads_the_one_rule(check: str, strict: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    row, run = CHECKS[check]
    if strict:
        monkeypatch.setitem(validate.TOLERANCES, row, validate.ToleranceRule({}, 0.0, 0.0))
    assert run(monkeypatch) is (not strict)


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
@pytest.mark.parametrize("check", list(CHECKS))
def test_a_check_ignores_the_other_row(check: str, monkeypatch: pytest.MonkeyPatch) -> None:
    row, run = CHECKS[check]
    other = "fold" if row == "step" else "step"
    monkeypatch.setitem(validate.TOLERANCES, other, validate.ToleranceRule({}, 0.0, 0.0))
    assert run(monkeypatch)


def test_the_numbers_are_the_checks_own() -> None:
    """Gathering the rules changed no number (convert's rows and fold's as they were)."""
    step, fold = validate.tolerance_rule("step"), validate.tolerance_rule("fold")
    f64, f32, f16 = torch.float64, torch.float32, torch.float16
    assert (step(f64), step(f32), step(f16), step.eager_error_factor) == (1e-7, 1e-3, 5e-2, 4.0)
    assert (fold(f64), fold(f32), fold(f16), fold.eager_error_factor) == (1e-10, 1e-4, 1e-2, 4.0)
    with pytest.raises(ValueError, match="check must be one of"):
        validate.tolerance_rule("train")  # type: ignore[arg-type]
