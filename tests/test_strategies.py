"""The strategy / layer-mode names: one Literal family, the same names everywhere."""
from __future__ import annotations

from typing import get_args

import pytest

import convbn
from convbn.functional import strategies as s


@pytest.mark.parametrize(
    "literal, names",
    [(s.LayerMode, s.LAYER_MODES), (s.Strategy, s.STRATEGIES), (s.ConvertStrategy, s.CONVERT_STRATEGIES)],
)
def test_tuples_hold_the_literal_names(literal: object, names: tuple) -> None:
    assert get_args(literal) == names


def test_every_api_spells_the_same_names() -> None:
    # the sets are built from the layer modes: a single layer adds "frozen", convert "auto"
    assert set(s.STRATEGIES) == set(s.LAYER_MODES) | {"frozen"}
    assert set(s.CONVERT_STRATEGIES) == set(s.LAYER_MODES) | {"auto"}
    # the public names are the types; FusedChain checks with the same tuple
    from convbn.nn.chain import LAYER_MODES

    assert convbn.Strategy is s.Strategy and convbn.ConvertStrategy is s.ConvertStrategy
    assert LAYER_MODES is s.LAYER_MODES


@pytest.mark.parametrize("mode, keeps", [("recompute_bn", True), ("recompute_conv", False)])
def test_keeps_conv_output(mode: str, keeps: bool) -> None:
    assert s.keeps_conv_output(mode) is keeps


@pytest.mark.parametrize("bad", ["frozen", "auto", "fast", None])
def test_keeps_conv_output_rejects_other_names(bad: object) -> None:
    with pytest.raises(ValueError, match=r"strategy must be one of \('recompute_bn', 'recompute_conv'\), but got"):
        s.keeps_conv_output(bad)  # type: ignore[arg-type]


def test_check_strategy_names_value_and_choices() -> None:
    assert s.check_strategy("frozen") == "frozen"
    with pytest.raises(ValueError, match=r"one of \('auto', 'recompute_bn', 'recompute_conv'\), but got strategy='frozen'"):
        s.check_strategy("frozen", s.CONVERT_STRATEGIES)
