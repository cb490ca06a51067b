"""A converted model round-trips (``torch.save`` / ``torch.load`` of the whole model, ``pickle``,
``copy.deepcopy``) whenever the user's model does, whatever its class does in ``__getattr__`` /
``__getstate__`` / ``__setstate__``; the loaded model still runs fused and matches eager."""
from __future__ import annotations

import copy
import io
import pickle
import threading
from typing import Any, Callable, Dict

import pytest
import torch
from torch import nn

import convbn
from bn_calls import eager_bn_calls
from capture_helpers import assert_steps_match, randomise_batchnorms


class Config:
    def __init__(self) -> None:
        self.hidden = 4


class _Body(nn.Module):
    def _build(self) -> None:
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn(self.conv(x)))))).mean((2, 3))


class ConfigLookup(_Body):
    """Hugging Face style: an unknown name is looked up on the config; ``from_pretrained`` a class method."""

    def __init__(self) -> None:
        super().__init__()
        self.config = Config()
        self._build()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            config = self.__dict__.get("config")
            if config is not None and name in vars(config):
                return getattr(config, name)
            raise

    @classmethod
    def from_pretrained(cls, path: str) -> "ConfigLookup":
        return cls()


class KnownNamesOnly(_Body):
    """``__getattr__`` answers only the names ``__init__`` set up (and registered children)."""

    def __init__(self) -> None:
        super().__init__()
        self._build()
        self._known = frozenset(self.__dict__) | {"_known"}

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        if name in d.get("_known", ()) or any(name in d.get(k, {}) for k in ("_parameters", "_buffers", "_modules")):
            return super().__getattr__(name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


class OwnState(_Body):
    """Its own ``__getstate__`` / ``__setstate__``: a handle dropped and rebuilt."""

    def __init__(self) -> None:
        super().__init__()
        self._build()
        self.handle = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        del state["handle"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.handle = threading.Lock()


def _torch_round_trip(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


ROUND_TRIPS: Dict[str, Callable[[nn.Module], nn.Module]] = {
    "torch.save": _torch_round_trip,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("trip", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.parametrize("cls", [ConfigLookup, KnownNamesOnly, OwnState])
def test_converted_model_round_trips_and_runs_fused(cls: type, with_inputs: bool, trip: str) -> None:
    torch.manual_seed(0)
    model = randomise_batchnorms(cls())
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ROUND_TRIPS[trip](model)(x)  # the user's model round-trips
    fast = convbn.convert(model, example_inputs=x if with_inputs else None)
    assert_steps_match(copy.deepcopy(model), fast, x)  # checks done, statistics moved: a trained model
    loaded = ROUND_TRIPS[trip](fast)
    assert type(loaded) is cls
    assert [n for n, _ in convbn.fused_modules(loaded)] == [n for n, _ in convbn.fused_modules(fast)] != []
    eager = ROUND_TRIPS[trip](copy.deepcopy(model))  # the same state, never converted
    from convbn.passes.graph.graph_module import eager as run_eager
    with run_eager(eager):
        assert_steps_match(eager, loaded, x)
    assert eager_bn_calls(loaded, x) == 0  # both BatchNorms fused after the round trip
    assert [o.result for o in loaded.convbn_report.outcomes] == ["fused", "fused"]
