"""Optional arguments left at their default are traced as the value they have, and guarded:
``forward(h, attention_mask=None)`` must record the ``None`` branch (a proxy is never
``None``), for ``convert`` (lazy and with ``example_inputs``) and for ``fold``; a call that
passes another value runs a variant captured for it (fold: the module's own forward)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import TOL, assert_same_state, step, twins
from fusion_checks import assert_chain_ran, assert_fused


class Masked(nn.Module):
    """Conv -> BN -> ReLU, then an optional mask and an optional flag, both at their defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()

    def forward(self, h, attention_mask=None, halve: bool = False):
        y = self.act(self.bn(self.conv(h)))
        if attention_mask is not None:
            y = y * attention_mask
        if halve:
            y = y / 2
        return y


def x_(seed: int = 1):
    return torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("validated", [False, True], ids=["lazy", "example_inputs"])
def test_convert_traces_the_default_branch(validated):
    eager, twin = twins(Masked)
    kw = {"example_inputs": x_()} if validated else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no first-call fallback, no off-default message
        fast = convbn.convert(twin, **kw)
        assert_fused(fast, pairs=1)
        for s in range(3):
            x = x_(s)
            ref = step(eager, x, seed=s)
            out = step(fast, x, seed=s)
            torch.testing.assert_close(out, ref, **TOL)
            assert_same_state(eager, fast)
    assert_chain_ran(fast(x_()), calls=1)
    assert_chain_ran(fast(x_(), attention_mask=None, halve=False), calls=1)  # keyword, same values


def test_convert_runs_a_variant_for_another_value():
    eager, twin = twins(Masked)
    fast = convbn.convert(twin)
    step(eager, x_()), step(fast, x_())  # the rewrite runs first, checked
    mask = torch.rand(4, 8, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # captured for the call: no message, no fallback
        out = step(fast, x_(2), mask, seed=2)
        ref = step(eager, x_(2), mask, seed=2)
        torch.testing.assert_close(out, ref, **TOL)
        torch.testing.assert_close(step(fast, x_(3), halve=True, seed=3), step(eager, x_(3), halve=True, seed=3),
                                   **TOL)
    assert_same_state(eager, fast)
    assert len(fast.convbn_report.variants) == 2, fast.convbn_report
    with torch.no_grad():
        torch.testing.assert_close(fast(x_(4), mask), eager(x_(4), mask), **TOL)
    assert_chain_ran(fast(x_(), mask), calls=1)  # the variants run fused
    assert_chain_ran(fast(x_(), halve=True), calls=1)
    assert_chain_ran(fast(x_()), calls=1)  # the default call is still fused


def test_fold_traces_the_default_branch():
    eager, twin = twins(Masked)
    step(eager, x_()), step(twin, x_())  # statistics to fold
    eager.eval(), twin.eval()
    folded = convbn.fold(twin, example_inputs=x_())
    report = folded.convbn_report
    assert [(o.batchnorm, o.result) for o in report.outcomes] == [("bn", "folded")], report
    assert report.check.passed, report
    fwd = folded.forward
    with torch.no_grad():
        fwd.original = None  # the default call must run the folded graph, not the module's own forward
        torch.testing.assert_close(folded(x_(2)), eager(x_(2)), **TOL)
        del fwd.original
        mask = torch.rand(4, 8, 6, 6, dtype=torch.float64)
        with pytest.warns(RuntimeWarning, match="attention_mask"):
            torch.testing.assert_close(folded(x_(2), mask), eager(x_(2), mask), **TOL)


class Residual(nn.Module):
    """An optional argument the code uses as a value: traced symbolically, as before."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

    def forward(self, h, residual=None):
        return torch.relu(self.bn(self.conv(h))) + residual


def test_an_argument_used_as_a_value_stays_symbolic():
    eager, twin = twins(Residual)
    fast = convbn.convert(twin)
    assert_fused(fast, pairs=1)
    assert fast.forward.defaults is None  # nothing specialised: every call runs the graph
    r = x_(7)
    for s in range(2):
        torch.testing.assert_close(step(fast, x_(s), r, seed=s), step(eager, x_(s), r, seed=s), **TOL)
        assert_same_state(eager, fast)
    assert_chain_ran(fast(x_(), r), calls=1)
