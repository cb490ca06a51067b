"""The names of what a fused layer keeps for backward, as one family of ``Literal`` types.

Every API that takes a strategy spells it with these, so a name cannot drift. The public
names are the two types (``convbn.Strategy``, ``convbn.ConvertStrategy``); their values at
run time are ``typing.get_args(convbn.Strategy)``:

* :data:`LayerMode` -- what one layer of a chain keeps (the chains' own name, not exported
  from ``convbn``): ``"recompute_bn"`` keeps the conv output ``y`` (backward recomputes
  BN + activation), ``"recompute_conv"`` keeps nothing (backward recomputes the convolution too). :func:`keeps_conv_output` is the
  boolean the Functions use (``keep_y``).
* :data:`Strategy` -- a single fused layer (``FusedConvBN*d``, ``conv_bn_act``): a layer
  mode, or ``"frozen"`` (normalise with the running statistics, keep only the input).
* :data:`ConvertStrategy` -- :func:`convbn.convert`: a layer mode for every layer, or
  ``"auto"`` (the planner picks a mode per layer).

The tuples hold the same names at run time, for convbn's own checks and error messages
(built from the types: ``typing.get_args``).
"""
from __future__ import annotations

from typing import Literal, Sequence, Tuple, get_args

__all__ = [
    "CONVERT_STRATEGIES",
    "ConvertStrategy",
    "LAYER_MODES",
    "LayerMode",
    "STRATEGIES",
    "Strategy",
    "check_strategy",
    "keeps_conv_output",
]

LayerMode = Literal["recompute_bn", "recompute_conv"]
Strategy = Literal["recompute_conv", "recompute_bn", "frozen"]
ConvertStrategy = Literal["auto", "recompute_bn", "recompute_conv"]

#: What one layer of a chain may keep (see :data:`LayerMode`).
LAYER_MODES: Tuple[LayerMode, ...] = get_args(LayerMode)
#: Strategies a single fused layer accepts (``convert`` adds ``"auto"``).
STRATEGIES: Tuple[Strategy, ...] = get_args(Strategy)
#: Strategies :func:`convbn.convert` accepts.
CONVERT_STRATEGIES: Tuple[ConvertStrategy, ...] = get_args(ConvertStrategy)


def check_strategy(strategy: str, allowed: Sequence[str] = STRATEGIES) -> str:
    """Return ``strategy`` or raise ``ValueError`` listing the allowed names.

    Args:
        strategy: the name the caller passed.
        allowed: the names this API accepts (default: :data:`STRATEGIES`).

    Returns:
        ``strategy`` itself.

    Example:
        >>> check_strategy("frozen")
        'frozen'
    """
    if not isinstance(strategy, str) or strategy not in allowed:
        raise ValueError(f"strategy must be one of {tuple(allowed)}, but got strategy={strategy!r}")
    return strategy


def keeps_conv_output(mode: str) -> bool:
    """Whether a layer in ``mode`` keeps its conv output ``y`` for backward (``keep_y``).

    Args:
        mode: a :data:`LayerMode`.

    Returns:
        ``True`` for ``"recompute_bn"``, ``False`` for ``"recompute_conv"``.

    Example:
        >>> keeps_conv_output("recompute_bn"), keeps_conv_output("recompute_conv")
        (True, False)
    """
    return check_strategy(mode, LAYER_MODES) == "recompute_bn"
