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
chain. Within that memory the default plan is also checked for the step's *peak*
(:func:`plan_for_peak`): where a chain's backward transient would push the step above
the memory asked, layers are re-planned to the least recompute whose predicted peak is
lowest. An explicit ``memory_budget`` (saved bytes) gets the least recompute that fits
(:func:`plan_layers`).

# Note: [predicting the peak of a step]
# A step's live memory peaks either at the end of forward (everything saved) or inside
# some chain's backward: the bytes saved *before* that chain (still alive) plus the
# chain's own transient. :func:`chain_backward_peak` replays the chain's backward order
# (autograd/chain.py, Note: [chain backward order]) on buffer sizes only: kept and
# recomputed conv outputs, rebuilt inputs, the incoming gradient, grad_y and grad_x.
# The bytes alive beside a chain (activations saved before it, gradients of the layers
# after it) are measured once (``ChainCost.prefix``); parameters and the loss are the
# same for every plan and left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from ..autograd.chain_memory import choose_drops, replay

if TYPE_CHECKING:  # pragma: no cover
    from ..nn.chain import ChainLayer

__all__ = ["plan_layers", "tutorial_bytes", "all_keep_bytes", "ChainCost", "chain_backward_peak",
           "step_peak", "plan_for_peak"]


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
    """Bytes on top of the floor when every layer keeps its conv output (a head's BN input is
    the chain input, in the floor; an end layer without tail needs none: see ``keep_bytes``)."""
    return sum(l.keep_bytes() for chain in chains for l in chain)


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
    used = sum(l.keep_bytes() for l in layers)
    if used <= extra_budget:
        return used
    # Drop kept outputs that free the most bytes per recomputed MAC first.
    order = sorted(layers, key=lambda l: (l.flops() / max(1, l.keep_bytes()), -l.keep_bytes()))
    dropped: List["ChainLayer"] = []
    for l in order:
        if used <= extra_budget:
            break
        l.mode = "recompute_conv"
        used -= l.keep_bytes()
        dropped.append(l)
    # Re-admit the most expensive dropped layers that still fit.
    for l in sorted(dropped, key=lambda l: -l.flops()):
        if used + l.keep_bytes() <= extra_budget:
            l.mode = "recompute_bn"
            used += l.keep_bytes()
    return used


# --------------------------------------------------------------------------- planning for the peak


@dataclass(frozen=True)
class ChainCost:
    """What the peak planner knows of one chain (all plain numbers: the planner is pure).

    Attributes:
        y_bytes: bytes of each layer's conv output.
        x_bytes: bytes of each layer's conv input (``x_bytes[0]`` is the chain input, always kept).
        macs: each layer's convolution multiply-accumulates (recomputed when ``y`` is not kept).
        acts: each layer's activation kind: ``"identity"``, ``"output"`` (derivative from the
            output: the ReLU family) or ``"smooth"``.
        prefix: bytes alive besides the chain during its backward that no plan changes:
            activations saved before it (every earlier chain keeping nothing) and the
            gradients of the parameters used after it.
        head: layer 0 has no conv: its BN input (``y_bytes[0]``) is the chain input, always
            kept and in the floor; it recomputes nothing.
        end: the last layer has no BN: without a tail (kind ``"identity"``) it keeps nothing
            whatever its flag.
    """

    y_bytes: Tuple[int, ...]
    x_bytes: Tuple[int, ...]
    macs: Tuple[int, ...]
    acts: Tuple[str, ...]
    prefix: int = 0
    head: bool = False
    end: bool = False

    def kept_bytes(self, keep: Sequence[bool]) -> int:
        """Bytes the chain keeps above the floor under ``keep``."""
        k = len(self.y_bytes)
        return sum(y for i, (y, f) in enumerate(zip(self.y_bytes, keep))
                   if f and not (self.head and i == 0) and not (self.end and i == k - 1 and self.acts[i] == "identity"))


def chain_backward_peak(cost: ChainCost, keep: Sequence[bool]) -> Tuple[int, int]:
    """Peak bytes during the chain's backward under ``keep`` (Note: [predicting the peak of a
    step]): :func:`convbn.autograd.chain_memory.replay` with the drops the backward itself
    chooses. Counts the kept conv outputs, the incoming gradient and every buffer the
    backward creates (not the chain input, not parameters).

    Returns:
        ``(peak_bytes, layer)``: the peak and the layer whose backward reaches it.
    """
    drop = choose_drops(cost.y_bytes, cost.x_bytes, keep, cost.acts, cost.head, cost.end)
    return replay(cost.y_bytes, cost.x_bytes, keep, cost.acts, drop, cost.head, cost.end)


def step_peak(costs: Sequence[ChainCost], keeps: Sequence[Sequence[bool]], floor: int,
              _cache: Optional[dict] = None) -> Tuple[int, int]:
    """Predicted peak of a step's plan-dependent bytes: the end of forward
    (``floor`` + every kept conv output) or a chain's backward (its prefix, the kept
    outputs of the chains before it, its own transient). Chains in forward order.

    Returns:
        ``(peak_bytes, where)``: ``where`` is ``-1`` for the end of forward, else the chain index.
    """
    kept = [c.kept_bytes(kp) for c, kp in zip(costs, keeps)]
    best, where = floor + sum(kept), -1
    before = 0
    for j, (c, kp) in enumerate(zip(costs, keeps)):
        key = (j, tuple(kp))
        own = _cache.get(key) if _cache is not None else None
        if own is None:
            own = chain_backward_peak(c, kp)[0]
            if _cache is not None:
                _cache[key] = own
        p = c.prefix + before + own
        if p > best:
            best, where = p, j
        before += kept[j]
    return best, where


def plan_for_peak(costs: Sequence[ChainCost], start: Sequence[Sequence[bool]], floor: int,
                  extra_budget: int, max_rounds: int = 8) -> List[List[bool]]:
    """The least-recompute plan whose predicted step peak is lowest for the memory asked.

    The memory asked is ``floor + extra_budget`` (saved bytes with kept conv outputs up to
    the budget); the peak allowed is that, or the lowest peak any plan within the budget
    reaches where that is higher (a chain's backward transient can exceed the end of
    forward). ``start`` is the least-recompute plan within the budget (:func:`plan_layers`);
    it is returned when its peak is allowed. Otherwise a local search first finds a plan
    of lowest peak, then trades recompute back while the peak stays allowed; a move
    re-plans one chain (every plan of a short chain, one flipped flag of a long one).

    Args:
        costs: the chains in forward order.
        start: the least-recompute plan within the budget (one keep flag per layer per chain).
        floor: saved bytes with nothing kept (the end-of-forward baseline).
        extra_budget: bytes allowed for kept conv outputs.
        max_rounds: passes over the chains per search.

    Returns:
        The keep flags, chain by chain.

    Example:
        >>> c = ChainCost((4, 8), (1, 4), (10, 100), ("output", "output"))
        >>> plan_for_peak([c], [[False, True]], 0, 8)
        [[False, True]]
    """
    def recompute(ks: List[List[bool]]) -> int:
        return sum(m for c, kp in zip(costs, ks) for m, f in zip(c.macs, kp) if not f)

    def kept(ks: List[List[bool]]) -> int:
        return sum(c.kept_bytes(kp) for c, kp in zip(costs, ks))

    cache: dict = {}  # (chain, plan) -> its backward peak

    def peak(ks: List[List[bool]]) -> int:
        return step_peak(costs, ks, floor, cache)[0]

    def search(ks: List[List[bool]], key: Any, allowed: Any) -> List[List[bool]]:
        ks = [list(k) for k in ks]
        best = key(ks)
        for _ in range(max_rounds):
            improved = False
            for j in range(len(costs)):
                for move in _moves(ks[j]):
                    old, ks[j] = ks[j], move
                    s = key(ks)
                    if kept(ks) <= extra_budget and allowed(ks) and s < best:
                        best, improved = s, True
                    else:
                        ks[j] = old
            if not improved:
                break
        return ks

    keeps = [list(k) for k in start]
    lowest = search(keeps, lambda ks: (peak(ks), recompute(ks)), lambda ks: True)
    cap = max(peak(lowest), floor + extra_budget)
    if peak(keeps) <= cap:
        return keeps
    return search(lowest, lambda ks: (recompute(ks), peak(ks)), lambda ks: peak(ks) <= cap)


def _moves(keep: List[bool], exhaustive: int = 10) -> List[List[bool]]:
    """Every other plan of a chain of up to ``exhaustive`` layers, else single flips."""
    k = len(keep)
    if k <= exhaustive:
        return [[bool(m >> i & 1) for i in range(k)] for m in range(1 << k)]
    return [[f if i != j else not f for i, f in enumerate(keep)] for j in range(k)]
