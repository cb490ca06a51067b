"""conv_bn_act's dispatch: each fused-module call checks its inputs once, before any state changes."""
from __future__ import annotations

from typing import Any, List

import pytest
import torch

import convbn.autograd.dispatch as dispatch
import convbn.nn.fused_conv_bn as fused_module
from convbn import FusedConvBN2d, conv_bn_act


def _counting(calls: List[str], name: str, fn: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv", "frozen"])
@pytest.mark.parametrize("grad", [True, False])
def test_module_forward_checks_inputs_once(monkeypatch: pytest.MonkeyPatch, strategy: str, grad: bool) -> None:
    calls: List[str] = []
    monkeypatch.setattr(fused_module, "check_inputs", _counting(calls, "module", fused_module.check_inputs))
    monkeypatch.setattr(dispatch, "check_inputs", _counting(calls, "dispatch", dispatch.check_inputs))
    m = FusedConvBN2d(3, 4, 3, padding=1, activation="relu", strategy=strategy, dtype=torch.float64)
    with torch.set_grad_enabled(grad):
        m(torch.randn(2, 3, 5, 5, dtype=torch.float64))
    assert calls == ["module"]


def test_functional_entry_checks_inputs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[str] = []
    monkeypatch.setattr(dispatch, "check_inputs", _counting(calls, "dispatch", dispatch.check_inputs))
    conv_bn_act(torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3, requires_grad=True), None, None, None, None, None)
    assert calls == ["dispatch"]


def test_bad_module_call_changes_no_state() -> None:
    m = FusedConvBN2d(3, 4, 3, dtype=torch.float64)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(RuntimeError, match="expected input of shape .* to have 3 channels, but got 2"):
        m(torch.randn(2, 2, 5, 5, dtype=torch.float64))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
