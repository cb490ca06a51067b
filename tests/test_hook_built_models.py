"""Models assembled with forward hooks: a decoder reading activations its encoder's hooks stored.

``convert`` and ``fold`` must capture such a model with its hooks' effect or leave the part
whole, with and without ``example_inputs``: the result computes what eager computes on any
later input, in training (outputs, every gradient, running statistics) and in eval. Two ways
this broke: a copy whose hooks still wrote into the original's store (Note: [a copy that runs
like the model] in ``passes/graph/model_copy.py``), and a trace that recorded the activation a
previous call stored as a constant (Note: [a tensor read from the model's state is not a
constant] in ``passes/graph/state_tensors.py``).
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import assert_steps_match, randomise_batchnorms
from bn_calls import assert_report_matches_calls
from fusion_checks import assert_fused


def _cbr(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())


class Stored:
    """What a hook keeps: the output as an attribute of a record."""

    def __init__(self, orig: torch.Tensor) -> None:
        self.orig = orig


class HookUNet(nn.Module):
    """The decoder concatenates what a forward hook on ``enc1`` stored in ``self.store``; with
    ``replace``, the hook also replaces ``enc1``'s output (the encoder path sees half of it);
    with ``record``, the hook stores a :class:`Stored` the decoder reads ``.orig`` of."""

    def __init__(self, replace: bool = False, record: bool = False) -> None:
        super().__init__()
        self.enc1, self.enc2, self.dec = _cbr(3, 4), _cbr(4, 8), _cbr(8 + 4, 4)
        self.pool, self.up, self.head = nn.MaxPool2d(2), nn.Upsample(scale_factor=2), nn.Conv2d(4, 2, 1)
        self.store: Dict[str, Any] = {}

        def keep(module: nn.Module, inputs: Any, out: torch.Tensor) -> Any:
            self.store["e1"] = Stored(out) if record else out
            return out * 0.5 if replace else None

        self.enc1.register_forward_hook(keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc2(self.pool(self.enc1(x)))
        skip = self.store["e1"].orig if isinstance(self.store["e1"], Stored) else self.store["e1"]
        return self.head(self.dec(torch.cat([self.up(e), skip], 1)))


def _pair(replace: Any) -> Any:
    """The model and its eager twin: built alike (a deepcopy's hook would write into the
    original's store), float64, BatchNorms drawn."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(randomise_batchnorms(HookUNet(replace == "replace", replace == "record")))
    return models


@pytest.mark.parametrize("replace", ["store", "replace", "record"])
@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_convert_captures_a_hook_built_unet(replace: str, with_inputs: bool, inplace: bool) -> None:
    model, eager = _pair(replace)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(model, example_inputs=x if with_inputs else None, inplace=inplace)
    assert_fused(fast, pairs=3)
    assert_steps_match(eager, fast, x, steps=2)
    # another input, another size: nothing of an earlier call stands in for this one's activation
    assert_steps_match(eager, fast, torch.randn(2, 3, 16, 16, dtype=torch.float64), steps=1)
    assert all(isinstance(v, (torch.Tensor, Stored)) for v in model.store.values())  # no proxy left in the user's state


@pytest.mark.parametrize("replace", ["store", "replace", "record"])
@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.expect_unfused("fold: inference")
def test_fold_keeps_a_hook_built_unet_exact_on_new_inputs(replace: str, with_inputs: bool, inplace: bool) -> None:
    model, eager = _pair(replace)
    model.eval(), eager.eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    folded = convbn.fold(model, example_inputs=x if with_inputs else None, inplace=inplace)
    assert len(folded.convbn_report.folded) == 3, folded.convbn_report
    with torch.no_grad():
        for shape in ((2, 3, 8, 8), (3, 3, 16, 16), (2, 3, 8, 8)):
            y = torch.randn(*shape, dtype=torch.float64)
            torch.testing.assert_close(folded(y), eager(y), rtol=1e-9, atol=1e-9)
    calls = []
    for m in folded.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.register_forward_pre_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        folded(x)
    assert not calls, f"{len(calls)} BatchNorm calls still ran after folding all 3"


@pytest.mark.expect_unfused("the rewrite is made to fail: the module's own forward runs")
def test_a_hooked_rewrite_that_raises_on_its_first_call_falls_back() -> None:
    """With hooks under the module, the first call runs the rewrite unchecked (a check would call
    the hooks twice); where that rewrite raises, the module's own forward runs instead, from then on,
    and the report says so -- the user never sees the rewrite's exception."""
    from convbn.passes.graph.graph_module import installed

    def make() -> nn.Module:
        torch.manual_seed(0)
        net = randomise_batchnorms(nn.Sequential(_cbr(3, 4), _cbr(4, 4)))
        net[0].register_forward_hook(lambda *a: None)  # a logging hook under the root
        return net

    model, eager = make(), make()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(model)
    fwd = installed(fast)
    assert fwd is not None and fwd.pending is not None

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError("'Tensor' object has no attribute 'orig'")

    fwd.fn = broken
    with pytest.warns(RuntimeWarning, match="the rewrite raised AttributeError"):
        out = fast(x)
    torch.testing.assert_close(out, eager(x), rtol=1e-10, atol=1e-10)
    assert fwd.fallback and "raised" in fwd.fallback_reason
    torch.testing.assert_close(fast(x), eager(x), rtol=1e-10, atol=1e-10)
    outcomes = {o.batchnorm: o for o in fast.convbn_report.outcomes}
    assert outcomes["1.1"].result == "left" and "raised" in outcomes["1.1"].reason, fast.convbn_report
    assert_report_matches_calls(2, fast, x)  # the hooked child, converted on its own, still runs fused
