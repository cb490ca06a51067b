"""Grad-mode regions inside a traced forward (``torch.no_grad()``, ``torch.set_grad_enabled``,
``@torch.no_grad()`` helpers, ``torch.inference_mode()``) are recorded, so the rewrite runs
each op in eager's grad mode: a parameter used only under ``no_grad`` gets no ``.grad``, and
nothing is fused across a region's border."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import TOL, assert_same_state, step, twins
from fusion_checks import assert_chain_ran, assert_fused


def cbn(cin: int = 3, cout: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout))


class Gate(nn.Module):
    """A trained branch, and a gate branch computed without grad (``how`` picks the spelling)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.main, self.gate = cbn(), cbn(8, 8)

    @torch.no_grad()
    def gated(self, y):
        return self.gate(y)

    def forward(self, x):
        y = torch.relu(self.main(x))
        if self.how == "no_grad":
            with torch.no_grad():
                t = self.gate(y)
        elif self.how == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                t = self.gate(y)
        elif self.how == "decorator":
            t = self.gated(y)
        else:
            with torch.inference_mode():
                t = self.gate(y.detach())
            t = t.clone()
        return y * t.sigmoid()


def x_(seed: int = 1):
    return torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("validated", [False, True], ids=["lazy", "example_inputs"])
@pytest.mark.parametrize("how", ["no_grad", "set_grad_enabled", "decorator", "inference_mode"])
def test_no_grad_region_keeps_eager_grad_mode(how, validated):
    eager, twin = twins(lambda: Gate(how))
    kw = {"example_inputs": x_()} if validated else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no check falls back
        fast = convbn.convert(twin, **kw)
        assert_fused(fast, pairs=2, chains=2)
        for s in range(3):
            torch.testing.assert_close(step(fast, x_(s), seed=s), step(eager, x_(s), seed=s), **TOL)
            assert_same_state(eager, fast)  # gate's parameters: .grad None in both
    assert fast.gate[0].weight.grad is None and fast.gate[1].weight.grad is None
    assert fast.main[0].weight.grad is not None
    out = fast(x_())
    assert_chain_ran(out, calls=1)  # the trained chain; the gate's ran without grad (no autograd node)
    assert fast.forward.fallback is False


def test_model_called_without_grad_stays_without_grad():
    eager, twin = twins(lambda: Gate("no_grad"))
    fast = convbn.convert(twin)
    with torch.no_grad():
        out, ref = fast(x_()), eager(x_())
    assert not out.requires_grad and not ref.requires_grad
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.is_grad_enabled()
    assert_same_state(eager, fast)
    assert_chain_ran(fast(x_()), calls=1)


class Border(nn.Module):
    """A conv computed with grad, its BatchNorm without: not one fused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.conv, self.bn = cbn(), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        y = self.conv(h)
        with torch.no_grad():
            z = self.bn(y)
        return h * z.sigmoid()


def test_no_fusion_across_a_grad_mode_border():
    eager, twin = twins(Border)
    fast = convbn.convert(twin)
    report = assert_fused(fast, pairs=1)
    left = {o.batchnorm: o.reason for o in report.outcomes if o.result == "left"}
    assert "grad modes" in left["bn"], report
    for s in range(2):
        torch.testing.assert_close(step(fast, x_(s), seed=s), step(eager, x_(s), seed=s), **TOL)
        assert_same_state(eager, fast)
    assert_chain_ran(fast(x_()), calls=1)
