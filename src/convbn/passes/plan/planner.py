"""Per-layer strategy planner for :func:`convbn.convert` (``strategy="auto"``).

Inside a chain (see :mod:`convbn.autograd.chain`) each layer either keeps its conv
output ``y_i`` (``recompute_bn``: element-wise recompute only) or keeps nothing and
recomputes its convolution (``recompute_conv``). Layer inputs are never kept inside a
chain, so the choices are independent and the saved bytes of a plan are *exactly*

.. math::
    M(\\text{plan}) = M_\\text{floor} + \\sum_{i \\,\\text{keeps}\\, y_i} \\mathrm{bytes}(y_i)

where ``M_floor`` is the measured saved bytes with every layer on ``recompute_conv``.
Minimising recompute under a byte target is a 0/1 knapsack; the planner drops kept
outputs in order of least cost per byte freed, then re-admits any dropped layer that
still fits (dearest first). A layer's cost is what running its conv again costs, in MAC
equivalents: its MACs plus the bytes it moves plus a fixed cost per call
(:func:`convbn.functional.conv.recompute_cost`, Note: [what a recompute costs]); the
numbers below named ``macs`` are that cost.

The default plan is made for the step's *peak*
(:func:`~convbn.passes.plan.peak_planner.plan_for_peak`): the least
recompute among the plans whose predicted peak is within :data:`PEAK_TOLERANCE` of the
lowest reachable, whatever their saved bytes (Note: [the default plans for the peak
alone]). An explicit ``memory_budget`` (saved bytes) gets the least recompute that fits
(:func:`plan`); without ``example_inputs`` (no peak to predict) a chain planned on its
first call keeps the memory of the tutorial's method (every layer keeps its own input),
``M_floor + sum(bytes(x_i))`` over layers whose input is produced inside their chain.
Every function here is pure: numbers (or the shapes layers recorded) in, keep flags out;
:mod:`convbn.passes.plan.chain_plans` makes them each chain's plan value.

The peak planner lives beside this one: :mod:`convbn.passes.plan.peak_model` predicts a
step's peak under a plan, :mod:`convbn.passes.plan.peak_planner` searches the plans by it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ...nn.chain import ChainLayer

__all__ = ["plan", "plan_layers", "plan_on_first_call", "tutorial_bytes", "all_keep_bytes"]


def tutorial_bytes(chains: Sequence[Sequence["ChainLayer"]]) -> int:
    """Bytes the tutorial's method keeps on top of the floor: every chain-internal layer input."""
    return sum(l.x_bytes() for chain in chains for l in chain[1:])


def all_keep_bytes(chains: Sequence[Sequence["ChainLayer"]]) -> int:
    """Bytes on top of the floor when every layer keeps its conv output (a head's BN input is
    the chain input, in the floor; an end layer without tail needs none: see ``keep_bytes``)."""
    return sum(l.keep_bytes() for chain in chains for l in chain)


def plan(y_bytes: Sequence[int], macs: Sequence[int], budget: int) -> List[bool]:
    """Which conv outputs to keep: at most ``budget`` bytes of them, at the least recompute
    cost (a 0/1 knapsack, solved greedily). Pure: numbers in, flags out.

    Args:
        y_bytes: bytes of each layer's conv output.
        macs: each layer's recompute cost, in MAC equivalents (recomputed when not kept).
        budget: bytes allowed for kept conv outputs (on top of the all-recompute floor).

    Returns:
        One flag per layer, ``True`` where the layer keeps its conv output.

    Example:
        >>> plan([8, 8, 8], [10, 1, 5], 16)
        [True, False, True]
    """
    if len(y_bytes) != len(macs):
        raise ValueError(f"plan expects one MAC count per layer ({len(y_bytes)}), but got {len(macs)}")
    k = len(y_bytes)
    keep = [True] * k
    used = sum(y_bytes)
    if used <= budget:
        return keep
    # Drop kept outputs that free the most bytes per recomputed MAC first.
    order = sorted(range(k), key=lambda i: (macs[i] / max(1, y_bytes[i]), -y_bytes[i]))
    dropped: List[int] = []
    for i in order:
        if used <= budget:
            break
        keep[i] = False
        used -= y_bytes[i]
        dropped.append(i)
    # Re-admit the most expensive dropped layers that still fit.
    for i in sorted(dropped, key=lambda i: -macs[i]):
        if used + y_bytes[i] <= budget:
            keep[i] = True
            used += y_bytes[i]
    return keep


def plan_layers(layers: Sequence["ChainLayer"], extra_budget: int) -> List[bool]:
    """:func:`plan` on the sizes ``layers`` recorded at their last call (reads, never
    changes them).

    Args:
        layers: every layer being planned (shapes recorded by a forward pass).
        extra_budget: bytes allowed on top of the all-``recompute_conv`` floor.

    Returns:
        One keep flag per layer (``True``: ``recompute_bn``, ``False``: ``recompute_conv``).
    """
    return plan([l.keep_bytes() for l in layers], [l.recompute_cost() for l in layers], extra_budget)


def plan_on_first_call(layers: Sequence["ChainLayer"]) -> List[bool]:
    """The plan of a chain converted without ``example_inputs``: the tutorial method's
    memory for this chain, with the least conv recompute. :func:`convbn.convert` gives each
    chain a lazy plan that calls it once (:func:`convbn.passes.plan.chain_plans.lazy_plan`), on
    its first training call, when its layers know their shapes."""
    return plan_layers(layers, tutorial_bytes([layers]))
