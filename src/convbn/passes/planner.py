"""Per-layer strategy planner for :func:`convbn.convert` (``strategy="auto"``).

Inside a chain (see :mod:`convbn.autograd.chain`) each layer either keeps its conv
output ``y_i`` (``recompute_bn``: element-wise recompute only) or keeps nothing and
recomputes its convolution (``recompute_conv``). Layer inputs are never kept inside a
chain, so the choices are independent and the saved bytes of a plan are *exactly*

.. math::
    M(\\text{plan}) = M_\\text{floor} + \\sum_{i \\,\\text{keeps}\\, y_i} \\mathrm{bytes}(y_i)

where ``M_floor`` is the measured saved bytes with every layer on ``recompute_conv``.
Minimising recompute (convolution MACs) under a byte target is a 0/1 knapsack; the
planner drops kept outputs in order of fewest MACs per byte freed, then re-admits
any dropped layer that still fits (largest MACs first).

The default target is the memory of the tutorial's method (every layer keeps its own
input), ``M_floor + sum(bytes(x_i))`` over layers whose input is produced inside their
chain: the planner reaches that memory with the least convolution recompute.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ..nn.chain import ChainLayer

__all__ = ["plan_layers", "tutorial_bytes", "all_keep_bytes"]


def _bytes_of(shape: Optional[Sequence[int]], layer: "ChainLayer") -> int:
    if shape is None:
        return 0
    n = 1
    for s in shape:
        n *= int(s)
    return n * (layer.y_bytes() // max(1, _numel(layer.y_shape)))


def _numel(shape: Optional[Sequence[int]]) -> int:
    n = 1
    for s in shape or ():
        n *= int(s)
    return n


def tutorial_bytes(chains: Sequence[Sequence["ChainLayer"]]) -> int:
    """Bytes the tutorial's method keeps on top of the floor: every chain-internal layer input."""
    return sum(_bytes_of(l.x_shape, l) for chain in chains for l in chain[1:])


def all_keep_bytes(chains: Sequence[Sequence["ChainLayer"]]) -> int:
    """Bytes on top of the floor when every layer keeps its conv output."""
    return sum(l.y_bytes() for chain in chains for l in chain)


def plan_layers(layers: Sequence["ChainLayer"], extra_budget: int) -> int:
    """Set each layer's ``mode`` to spend at most ``extra_budget`` bytes above the floor
    on kept conv outputs, recomputing as few MACs as possible.

    Args:
        layers: every layer being planned (shapes recorded by a forward pass).
        extra_budget: bytes allowed on top of the all-``recompute_conv`` floor.

    Returns:
        The bytes the plan keeps above the floor (``<= extra_budget``).
    """
    for l in layers:
        l.mode = "recompute_bn"
    used = sum(l.y_bytes() for l in layers)
    if used <= extra_budget:
        return used
    # Drop kept outputs that free the most bytes per recomputed MAC first.
    order = sorted(layers, key=lambda l: (l.flops() / max(1, l.y_bytes()), -l.y_bytes()))
    dropped: List["ChainLayer"] = []
    for l in order:
        if used <= extra_budget:
            break
        l.mode = "recompute_conv"
        used -= l.y_bytes()
        dropped.append(l)
    # Re-admit the most expensive dropped layers that still fit.
    for l in sorted(dropped, key=lambda l: -l.flops()):
        if used + l.y_bytes() <= extra_budget:
            l.mode = "recompute_bn"
            used += l.y_bytes()
    return used
