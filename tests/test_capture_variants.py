"""A converted module called unlike its capture (an optional argument given, a smaller last
batch of a model whose code reads shapes) runs a variant captured for that call, fused, not
the unfused original; variants are cached per module up to a limit."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convbn
from capture_helpers import TOL, assert_same_state, step, twins
from fusion_checks import assert_chain_ran, assert_fused
from test_capture_shapes import CASES, rand
from convbn.passes.convert.variants import MAX_VARIANTS


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x, mask=None):
        h = torch.relu(self.bn1(self.conv1(x)))
        if mask is not None:
            h = h * mask
        return self.bn2(self.conv2(h))


class Classifier(nn.Module):
    """Hugging Face style: ``labels`` given -> ``(loss, logits)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, pixel_values, labels=None, return_dict=True):
        logits = self.head(self.body(pixel_values).mean((2, 3)))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        if not return_dict:
            return (logits,) if loss is None else (loss, logits)
        return {"loss": loss, "logits": logits}


def ran_fused(fast, eager, *args, seed=0, **kwargs):
    """A forward of both twins (their state stays equal); the converted one's output came from a chain."""
    for m in (eager, fast):
        torch.manual_seed(seed)
        out = m(*args, **kwargs)
    if isinstance(out, dict):
        out = out["logits"] if out["loss"] is None else out["loss"]
    out = out[0] if isinstance(out, tuple) else out
    assert_chain_ran(out)


@pytest.mark.parametrize("validated", [False, True])
def test_an_optional_argument_given_runs_a_fused_variant(validated):
    eager, twin = twins(Masked)
    x = rand((4, 3, 8, 8), 0)
    fast = convbn.convert(twin, example_inputs=x if validated else None)
    assert_fused(fast, pairs=2)
    mask = (torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(5)) > 0.5).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback, no off-default message
        for s in range(4):
            kw = {"mask": mask} if s % 2 else {}
            xs = rand((4, 3, 8, 8), s)
            torch.testing.assert_close(step(fast, xs, seed=s, **kw), step(eager, xs, seed=s, **kw), **TOL)
            assert_same_state(eager, fast)
            ran_fused(fast, eager, xs, **kw)
            ran_fused(fast, eager, xs, mask)  # positional too
    report = fast.convbn_report
    assert len(report.variants) == 1 and "mask=<given>" in report.variants[0], report
    assert "variant captured for a call" in str(report)


def test_a_top_level_model_called_with_labels_runs_fused():
    eager, twin = twins(Classifier)
    fast = convbn.convert(twin)
    labels = torch.tensor([0, 3, 1, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for s in range(3):
            x = rand((4, 3, 8, 8), s)
            for m in (fast, eager):
                torch.manual_seed(s)
                out = m(x, labels=labels)
                out["loss"].backward()
            assert_same_state(eager, fast)
            torch.testing.assert_close(fast(x, labels=labels)["loss"], eager(x, labels=labels)["loss"], **TOL)
            ran_fused(fast, eager, x, labels=labels)
            ran_fused(fast, eager, x, labels, False)
            ran_fused(fast, eager, x)
            assert_same_state(eager, fast)
    assert [v.split(":")[1].strip() for v in fast.convbn_report.variants] == [
        "labels=<given>, return_dict=True (1 chain)", "labels=<given>, return_dict=False (1 chain)"]


@pytest.mark.parametrize("case", CASES)
def test_a_smaller_last_batch_runs_fused(case):
    make, shape, bns = CASES[case]
    eager, twin = twins(make)
    fast = convbn.convert(twin, example_inputs=rand(shape, 0))
    assert_fused(fast, pairs=bns)
    last = (shape[0] - 1, *shape[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no off-shape message, no failed first-call check
        for s, sh in enumerate([shape, shape, last, shape, last]):
            x = rand(sh, s)
            torch.testing.assert_close(step(fast, x, seed=s), step(eager, x, seed=s), **TOL)
            assert_same_state(eager, fast)
            ran_fused(fast, eager, x, seed=s)
    assert len(fast.convbn_report.variants) >= 1, fast.convbn_report
    assert any(str(list(last)) in v for v in fast.convbn_report.variants), fast.convbn_report.variants


def test_past_the_limit_the_original_runs_with_one_message():
    make, shape, _ = CASES["inline_drop_path"]
    eager, twin = twins(make)
    fast = convbn.convert(twin, example_inputs=rand(shape, 0))
    sizes = list(range(1, MAX_VARIANTS + 4))
    sizes.remove(shape[0])
    for s, n in enumerate(sizes):
        x = rand((n, *shape[1:]), s)
        if s == MAX_VARIANTS:
            with pytest.warns(RuntimeWarning, match=f"more than {MAX_VARIANTS} different ways"):
                out = step(fast, x, seed=s)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # one message only
                out = step(fast, x, seed=s)
        torch.testing.assert_close(out, step(eager, x, seed=s), **TOL)
        assert_same_state(eager, fast)
    report = fast.convbn_report
    assert len(report.variants) == MAX_VARIANTS, report
    assert any(f"more than {MAX_VARIANTS}" in c for c in report.changes), report
    ran_fused(fast, eager, rand((sizes[0], *shape[1:]), 0))  # a cached variant still runs fused


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor, return_dict: Optional[bool] = None) -> Any:
        y = torch.relu(self.bn(self.conv(x)))
        if not return_dict:
            return (y,)
        return {"features": y}


class _Outer(nn.Module):
    """Calls its inner module with ``return_dict=True`` where the inner signature says ``None``
    (Hugging Face models do), and reads the output only the dict way."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x, return_dict=True)["features"]
        if float(y.sum()) > -1e9:  # data-dependent Python: the outer module does not trace at all
            y = y * 2
        return y


def test_with_example_inputs_inner_modules_are_traced_as_their_parent_calls_them() -> None:
    torch.manual_seed(0)
    eager = _Outer().double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "runs its original (unfused) forward"
        fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
        out = fast(x)
    assert fast.convbn_report.variants == []  # the first capture is the one the calls need
    assert_chain_ran(out)
    ref = eager(x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(fast.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)
