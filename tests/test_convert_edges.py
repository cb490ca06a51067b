"""Edges of ``convert`` / ``fold`` a new user meets (issue 41 item 4): a model on the meta device,
``example_inputs`` of another dtype than the model's. Each is a clear ``ValueError`` naming the
value and the fix, or a documented behaviour, and the model is left exactly as it was."""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import assert_steps_match
from convbn.passes.report.live import awaiting_capture
from fusion_checks import assert_fused


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4))


def _fingerprint(model: nn.Module) -> Tuple[List[Any], Dict[str, Any]]:
    """What must not change: each module's class, instance attributes' keys (an installed
    forward would show), hooks, and every tensor's identity, device and (where it has values) value."""
    modules = [(type(m), sorted(vars(m)), len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    tensors = {k: (id(v), v.device, v.dtype, None if v.is_meta else v.detach().clone())
               for k, v in model.state_dict(keep_vars=True).items()}
    return modules, tensors


def _assert_unchanged(model: nn.Module, before: Tuple[List[Any], Dict[str, Any]]) -> None:
    modules, tensors = _fingerprint(model)
    assert modules == before[0]
    assert tensors.keys() == before[1].keys()
    for k, (ident, dev, dtype, value) in tensors.items():
        assert (ident, dev, dtype) == before[1][k][:3], k
        if value is not None:
            assert torch.equal(value, before[1][k][3]), k
    assert "convbn_report" not in vars(model)


def test_fold_on_meta_names_the_tensor_and_the_fix() -> None:
    with torch.device("meta"):
        model = _net().eval()
    before = _fingerprint(model)
    with pytest.raises(ValueError, match=r"'0\.weight' is on the meta device.*to_empty.*load_state_dict"):
        convbn.fold(model)
    _assert_unchanged(model, before)


def test_convert_with_example_inputs_on_meta_says_how() -> None:
    with torch.device("meta"):
        model = _net()
    before = _fingerprint(model)
    with pytest.raises(ValueError, match=r"example_inputs.*'0\.weight' is on the meta device.*without example_inputs"):
        convbn.convert(model, example_inputs=torch.randn(2, 3, 8, 8))
    _assert_unchanged(model, before)


@pytest.mark.parametrize("inplace", [False, True])
def test_example_inputs_of_another_dtype_is_one_line_naming_them(inplace: bool) -> None:
    model = _net()
    model(torch.randn(4, 3, 8, 8))  # running statistics that are not the defaults
    before = _fingerprint(model)
    with pytest.raises(ValueError) as err:
        convbn.convert(model, example_inputs=torch.randn(2, 3, 8, 8).double(), inplace=inplace)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("example_inputs do not match the model: tensor 0 is torch.float64 on cpu, "
                              "the model's parameters torch.float32 on cpu")
    assert isinstance(err.value.__cause__, RuntimeError)  # torch's own message kept as the cause
    _assert_unchanged(model, before)


def test_a_model_that_casts_its_inputs_itself_is_not_refused() -> None:
    class Casting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x.float())

    model = Casting()
    fast = convbn.convert(model, example_inputs=torch.randn(2, 3, 8, 8).double())
    assert_fused(fast, pairs=2)


@pytest.mark.parametrize("inplace", [False, True])
def test_meta_model_is_converted_on_its_first_call_once_materialised(inplace: bool) -> None:
    """Note: [a model converted on the meta device]: convert records; to_empty + load_state_dict
    materialise; the first call converts, and from then on the model trains as its eager twin
    (outputs, input and weight gradients, running statistics, num_batches_tracked), fused."""
    torch.manual_seed(0)
    eager = _net().double()
    with torch.no_grad():
        for m in eager.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    with torch.device("meta"):
        model = _net().double()
    fast = convbn.convert(model, inplace=inplace)
    assert not list(convbn.fused_modules(fast))  # nothing to trace yet: shapes without values
    assert awaiting_capture(fast) == [""]  # the live report lists the model as converted on its first call
    with torch.no_grad():
        fast(torch.randn(2, 3, 8, 8, device="meta", dtype=torch.float64))  # a meta call captures nothing
    assert not list(convbn.fused_modules(fast))
    fast.to_empty(device="cpu")
    fast.load_state_dict(eager.state_dict())
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    assert_steps_match(eager, fast, x, steps=3)
    assert_fused(fast, pairs=2, chains=1)
