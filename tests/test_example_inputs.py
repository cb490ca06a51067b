"""One normalisation of sample inputs (``passes/check/validate.as_args``): a tensor, a tuple,
a list, ``None``, a dict and a value of the wrong type give the same result -- or the same
error, naming the value and what is accepted -- in ``convert``, ``explain``, ``fold`` and
``max_batch``."""
from __future__ import annotations

from typing import Any, Callable, Dict

import pytest
import torch
from torch import nn

import convbn
from convbn.passes.check.validate import as_args


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1))


X = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
KINDS: Dict[str, Any] = {"tensor": X, "tuple": (X,), "list": [X], "None": None}
WRONG: Dict[str, Any] = {"dict": {"x": X}, "int": 3, "str": "x.pt"}

PASSES: Dict[str, Callable[[nn.Module, Any], Any]] = {
    "convert": lambda m, inputs: convbn.convert(m, example_inputs=inputs),
    "explain": lambda m, inputs: convbn.explain(m, example_inputs=inputs),
    "fold": lambda m, inputs: convbn.fold(m.eval(), example_inputs=inputs),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("run", list(PASSES))
def test_accepted_kinds(kind: str, run: str) -> None:
    out = PASSES[run](net(), KINDS[kind])
    assert out is not None
    if run == "fold":
        assert out.convbn_report.folded  # and checked on the inputs given, or on inferred ones
        assert out.convbn_report.check.passed


def _error(run: Callable[[], Any]) -> str:
    with pytest.raises(TypeError) as info:
        run()
    return str(info.value)


@pytest.mark.parametrize("kind", list(WRONG))
def test_refused_kinds_raise_one_error(kind: str) -> None:
    """The same TypeError from every pass, naming the value and what is accepted."""
    value = WRONG[kind]
    errors = {name: _error(lambda: run(net(), value)) for name, run in PASSES.items()}
    assert len(set(errors.values())) == 1, errors
    message = next(iter(errors.values()))
    assert message.startswith("example_inputs must be a Tensor, or a tuple or list of positional arguments")
    assert ("dict with keys ['x']" if kind == "dict" else repr(value)) in message
    assert message == _error(lambda: as_args(value))
    assert _error(lambda: convbn.max_batch(net(), value, "1GiB")) == message  # the same argument name too


def test_a_dict_as_one_argument() -> None:
    """A model taking a dict gets it as one positional argument, wrapped in a tuple, in both passes."""

    class DictNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = net()

        def forward(self, d: Dict[str, torch.Tensor]) -> torch.Tensor:
            return self.body(d["x"])

    fast = convbn.convert(DictNet(), example_inputs=({"x": X},))
    assert [p.bn for p in fast.convbn_report.pairs][0] == "body.1"
    folded = convbn.fold(DictNet().eval(), example_inputs=({"x": X},))
    assert folded.convbn_report.check.passed
