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

The default plan is made for the step's *peak* (:func:`plan_for_peak`): the least
recompute among the plans whose predicted peak is within :data:`PEAK_TOLERANCE` of the
lowest reachable, whatever their saved bytes (Note: [the default plans for the peak
alone]). An explicit ``memory_budget`` (saved bytes) gets the least recompute that fits
(:func:`plan`); without ``example_inputs`` (no peak to predict) a chain planned on its
first call keeps the memory of the tutorial's method (every layer keeps its own input),
``M_floor + sum(bytes(x_i))`` over layers whose input is produced inside their chain.
Every function here is pure: numbers (or the shapes layers recorded) in, keep flags out;
``convert`` applies the flags to the layers.

# Note: [predicting the peak of a step]
# A step's live memory peaks either at the end of forward (everything saved) or inside
# some chain's backward: the bytes saved *before* that chain (still alive) plus the
# chain's own transient. :func:`chain_backward_peak` replays the chain's backward order
# (autograd/chain.py, Note: [chain backward order]) on buffer sizes only: kept and
# recomputed conv outputs, rebuilt inputs, the incoming gradient, grad_y and grad_x.
# The chain's own parameter gradients are made by its conv backwards and held until the
# Function returns them (``ChainCost.w_bytes``: on ResNet-50's last stage they outweigh
# the activations). Everything else alive beside a chain (activations saved before it,
# gradients of the layers after it, whatever autograd holds for the ops around it) is
# the same for every plan: ``convert`` measures it once (``ChainCost.prefix``), from a
# recorded step of the all-recompute plan, as that step's peak inside the chain minus the
# replayed transient. Parameters themselves (alive before the step) are left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from ...autograd.chain_memory import choose_drops, replay
from ...functional.conv import COST_PER_BYTE

if TYPE_CHECKING:  # pragma: no cover
    from ...nn.chain import ChainLayer

__all__ = ["plan", "plan_layers", "plan_on_first_call", "tutorial_bytes", "all_keep_bytes", "ChainCost", "chain_backward_peak",
           "step_peak", "drops_needed", "plan_for_peak", "plan_within_peak", "lowest_peak", "least_recompute", "chain_options",
           "ChainOption", "PEAK_TOLERANCE"]


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
    memory for this chain, with the least conv recompute. :func:`convbn.convert` attaches
    it to each chain (``FusedChain.plan_on_first_call``), which calls it once, on its first
    training call, when its layers know their shapes."""
    return plan_layers(layers, tutorial_bytes([layers]))


# --------------------------------------------------------------------------- planning for the peak


@dataclass(frozen=True)
class ChainCost:
    """What the peak planner knows of one chain (all plain numbers: the planner is pure).

    Attributes:
        y_bytes: bytes of each layer's conv output.
        x_bytes: bytes of each layer's conv input (``x_bytes[0]`` is the chain input, always kept).
        macs: each layer's cost of recomputing its conv when ``y`` is not kept, in MAC
            equivalents (``ChainLayer.recompute_cost``; plain MACs work too).
        acts: each layer's activation kind: ``"identity"``, ``"output"`` (derivative from the
            output: the ReLU family) or ``"smooth"``.
        prefix: bytes alive besides the chain during its backward that no plan changes:
            activations saved before it (every earlier chain keeping nothing) and the
            gradients of the parameters used after it.
        s_bytes: each layer's saved BatchNorm statistics (mean, inverse std), freed after
            its BN backward (empty: not counted).
        w_bytes: each layer's parameter-gradient bytes, made during the chain's backward
            and held until it returns (empty: not counted).
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
    w_bytes: Tuple[int, ...] = ()
    head: bool = False
    end: bool = False
    s_bytes: Tuple[int, ...] = ()

    def kept_bytes(self, keep: Sequence[bool]) -> int:
        """Bytes the chain keeps above the floor under ``keep``."""
        k = len(self.y_bytes)
        return sum(y for i, (y, f) in enumerate(zip(self.y_bytes, keep))
                   if f and not (self.head and i == 0) and not (self.end and i == k - 1 and self.acts[i] == "identity"))

    def recompute(self, keep: Sequence[bool]) -> int:
        """Recompute cost (``macs`` of the layers not keeping their conv output) under ``keep``."""
        return sum(m for m, f in zip(self.macs, keep) if not f)


def chain_backward_peak(cost: ChainCost, keep: Sequence[bool], may_drop: bool = True) -> Tuple[int, int]:
    """Peak bytes during the chain's backward under ``keep`` (Note: [predicting the peak of a
    step]): :func:`convbn.autograd.chain_memory.replay` with the drops the backward itself
    chooses. Counts the kept conv outputs, the incoming gradient, every buffer the
    backward creates and the chain's parameter gradients (``cost.w_bytes``); not the chain
    input, not the parameters themselves.

    Returns:
        ``(peak_bytes, layer)``: the peak and the layer whose backward reaches it.
    """
    # the drops the backward itself chooses (it does not count parameter gradients); none
    # where the chain may not drop (Note: [drops only where the step peaks])
    drop = choose_drops(cost.y_bytes, cost.x_bytes, keep, cost.acts, cost.head, cost.end) if may_drop \
        else [False] * len(keep)
    return replay(cost.y_bytes, cost.x_bytes, keep, cost.acts, drop, cost.w_bytes or None, cost.head, cost.end,
                  cost.s_bytes or None)


def step_peak(costs: Sequence[ChainCost], keeps: Sequence[Sequence[bool]], floor: int,
              _cache: Optional[dict] = None, may_drop: Optional[Sequence[bool]] = None,
              gaps: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """Predicted peak of a step's plan-dependent bytes: the end of forward
    (``floor`` + every kept conv output), a chain's backward (its prefix, the kept
    outputs of the chains before it, its own transient) or a moment outside every chain's
    backward (``gaps``, Note: [moments outside the chains]). Chains in forward order;
    ``may_drop`` per chain (default: every chain may drop, :func:`drops_needed`).

    Returns:
        ``(peak_bytes, where)``: ``where`` is ``-1`` for the end of forward, ``-2`` for a
        moment outside the chains' backwards (``gaps``), else the chain index.
    """
    kept = [c.kept_bytes(kp) for c, kp in zip(costs, keeps)]
    best, where = floor + sum(kept), -1
    if gaps:
        outside = max(g + sum(kept[:m]) for m, g in enumerate(gaps))
        if outside > best:
            best, where = outside, -2
    before = 0
    for j, (c, kp) in enumerate(zip(costs, keeps)):
        md = True if may_drop is None else bool(may_drop[j])
        key = (j, tuple(kp), md)
        own = _cache.get(key) if _cache is not None else None
        if own is None:
            own = chain_backward_peak(c, kp, md)[0]
            if _cache is not None:
                _cache[key] = own
        p = c.prefix + before + own
        if p > best:
            best, where = p, j
        before += kept[j]
    return best, where


def _gaps(gaps: Optional[Sequence[int]], n: int) -> List[int]:
    """``gaps`` padded to one entry per number of chains (0 .. n) alive; 0 where unmeasured.

    # Note: [moments outside the chains]
    # A step's peak can fall outside every chain's backward: in another op's backward (a
    # max-pool's gradient is as large as its input) while the conv outputs kept by the
    # chains not yet differentiated are all alive, or in forward after some chains ran. At
    # such a moment t the bytes are those measured in the recorded all-recompute step
    # (``base_t``) plus what the plan keeps in the chains alive at t: in forward the chains
    # already run, in backward those not yet differentiated. Counting, conservatively, the
    # first ``m`` chains in forward order (``m`` one past the last chain alive at t), the
    # moments give ``gaps[m] = max base_t``, and a plan's peak is at least
    # ``gaps[m] + kept(chains 0 .. m-1)`` for every ``m``. In forward order that is one
    # more check per chain in the searches below; without it, a plan keeping much (on the
    # tutorial's MNIST network, every conv output) was predicted 54 MiB under the peak
    # measured in its max-pool backward.
    """
    out = [0] * (n + 1)
    for m, g in enumerate(gaps or ()):
        out[min(m, n)] = max(out[min(m, n)], g)
    return out


def drops_needed(costs: Sequence[ChainCost], keeps: Sequence[Sequence[bool]], floor: int,
                 gaps: Optional[Sequence[int]] = None) -> List[bool]:
    """Per chain, whether its backward must drop rebuilt inputs for the step to peak where
    :func:`step_peak` predicts: ``False`` where the chain's backward, with no drop at all,
    stays within that peak.

    # Note: [drops only where the step peaks]
    # A drop (autograd/chain.py, Note: [chain backward order]) lowers its chain's own peak at
    # the price of one more element-wise rebuild (on ResNet-50, batch 8, 224², 13 drops over
    # 40 MiB cost 0.9 % of a CPU step). The backward cannot tell whether its chain is where
    # the step peaks; the planner can: a chain whose backward without drops stays within the
    # step's predicted peak gets ``may_drop=False``. The step peak is unchanged by
    # construction (each chain's moment stays within the maximum; ``step_peak`` with these
    # flags equals it), and the plan's recompute too.

    Example:
        >>> a = ChainCost((4, 8), (1, 4), (10, 100), ("output", "output"), prefix=0)
        >>> drops_needed([a], [[False, False]], floor=0), drops_needed([a], [[False, False]], floor=100)
        ([True], [False])
    """
    total = step_peak(costs, keeps, floor, gaps=gaps)[0]
    need = []
    before = 0
    for c, kp in zip(costs, keeps):
        need.append(c.prefix + before + chain_backward_peak(c, kp, may_drop=False)[0] > total)
        before += c.kept_bytes(kp)
    return need


#: How far above the lowest reachable peak the default plan may go to recompute less, as a
#: fraction of that peak (the predicted step peak: Note: [a step's peak] in
#: convbn/memory/timelines.py, weight gradients counted). Recompute costs step time and the
#: last bytes of peak are the dearest. On torchvision's ResNet-50 (batch 8, 224², SGD) the
#: lowest peak is 0.38x eager's; 30 % above it (the value until issue 24, chosen when the
#: bench's meter left weight gradients out) gave 0.49x at 11.5 GMAC of conv recompute per
#: step, 10 % 0.42x at 19.1 GMAC, 8 % 0.41x (BENCHMARKS.md "## Issue 24"). Where parameter
#: gradients make most of the peak (ResNet-18 at 112²) 8 % of it is much of the activations;
#: ``peak_budget`` / ``memory_limit`` ask for a lower peak.
PEAK_TOLERANCE = 0.08

#: What a byte of step peak is worth in recompute cost (MAC equivalents) inside the
#: tolerance: twice :data:`convbn.functional.conv.COST_PER_BYTE`, about the cost of writing
#: and reading that byte once (Note: [cheap peak]).
PEAK_BYTE_COST = 2 * COST_PER_BYTE


@dataclass(frozen=True)
class ChainOption:
    """One plan of one chain, as numbers: its keep flags, the conv output bytes it keeps
    from forward (``kept``), its backward transient (``own``, :func:`chain_backward_peak`)
    and the MACs it recomputes."""

    keep: Tuple[bool, ...]
    kept: int
    own: int
    recompute: int


def chain_options(cost: ChainCost, exhaustive: int = 10) -> List[ChainOption]:
    """The plans worth considering for one chain: every plan of a chain of up to
    ``exhaustive`` layers, else the knapsack's greedy order (keep the layers with most MACs
    per byte) cut at every length, and one flag flipped in each of those. Plans that another
    beats or ties on kept bytes, transient and recompute together are left out.
    """
    k = len(cost.y_bytes)
    if k <= exhaustive:
        plans = {tuple(bool(m >> i & 1) for i in range(k)) for m in range(1 << k)}
    else:
        order = sorted(range(k), key=lambda i: -cost.macs[i] / max(1, cost.y_bytes[i]))
        cuts = [tuple(i in set(order[:n]) for i in range(k)) for n in range(k + 1)]
        plans = set(cuts) | {tuple(f != (i == j) for i, f in enumerate(c)) for c in cuts for j in range(k)}
    opts = []
    for kp in sorted(plans):
        opts.append(ChainOption(kp, cost.kept_bytes(kp), chain_backward_peak(cost, kp)[0],
                                cost.recompute(kp)))
    opts.sort(key=lambda o: (o.kept, o.own, o.recompute))
    kept: List[ChainOption] = []
    for o in opts:  # Pareto: drop a plan some earlier (no more bytes kept) plan beats on both others
        if not any(p.own <= o.own and p.recompute <= o.recompute for p in kept):
            kept.append(o)
    return kept


def lowest_peak(costs: Sequence[ChainCost], options: Sequence[Sequence[ChainOption]], floor: int,
                extra_budget: int, gaps: Optional[Sequence[int]] = None) -> int:
    """The lowest predicted step peak (:func:`step_peak`) of any plan keeping at most
    ``extra_budget`` bytes of conv outputs.

    A peak ``P`` is reachable exactly when, chain by chain in forward order, some plan of
    the chain fits under ``P`` beside what the earlier chains keep, taking each time the
    fitting plan that keeps least (keeping less never hurts a later moment). The lowest
    such ``P`` is found by bisection.
    """
    gap = _gaps(gaps, len(costs))

    def reachable(p: int) -> bool:
        if gap[0] > p:
            return False
        before = 0
        for j, (c, opts) in enumerate(zip(costs, options)):
            fits = [o.kept for o in opts if c.prefix + before + o.own <= p and gap[j + 1] + before + o.kept <= p]
            if not fits:
                return False
            before += min(fits)
        return before <= extra_budget and floor + before <= p

    lo, hi = floor, step_peak(costs, [[False] * len(c.y_bytes) for c in costs], floor, gaps=gaps)[0]
    hi = max(hi, lo)
    while lo < hi:
        mid = (lo + hi) // 2
        if reachable(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def least_recompute(costs: Sequence[ChainCost], options: Sequence[Sequence[ChainOption]], floor: int,
                    extra_budget: int, peak: int, max_front: int = 4096,
                    gaps: Optional[Sequence[int]] = None) -> Optional[List[List[bool]]]:
    """The plan of least recompute cost whose predicted step peak is at most ``peak``
    and which keeps at most ``extra_budget`` bytes; ``None`` when there is none.

    # Note: [least recompute under a peak]
    # The step's peak constraint, chain by chain: prefix_j + kept before j + own_j <= peak,
    # and floor + all kept <= peak. Only "kept before j" links the chains, so a dynamic
    # programme over the chains in forward order keeps, for each reachable amount kept so
    # far, the least recompute reaching it (a Pareto front of (bytes kept, MACs); the
    # front is thinned to ``max_front`` byte buckets on very long models, which can only
    # miss an optimum by one bucket's bytes, never break the constraint).
    """
    gap = _gaps(gaps, len(costs))
    limit = min(extra_budget, peak - floor)
    if gap[0] > peak:
        return None
    front: List[Tuple[int, int, int, int]] = [(0, 0, -1, -1)]  # (kept so far, recompute, parent, option)
    history: List[List[Tuple[int, int, int, int]]] = []
    for j, (c, opts) in enumerate(zip(costs, options)):
        cand = [(b + o.kept, r + o.recompute, fi, oi)
                for fi, (b, r, _, _) in enumerate(front)
                for oi, o in enumerate(opts)
                if b + o.kept <= limit and c.prefix + b + o.own <= peak and gap[j + 1] + b + o.kept <= peak]
        if not cand:
            return None
        cand.sort(key=lambda t: (t[0], t[1]))
        pruned: List[Tuple[int, int, int, int]] = []
        for t in cand:
            if not pruned or t[1] < pruned[-1][1]:
                pruned.append(t)
        if len(pruned) > max_front:
            width = max(1, limit // max_front + 1)
            thin: Dict[int, Tuple[int, int, int, int]] = {}
            for t in pruned:  # ascending bytes, descending recompute: the last in a bucket is cheapest
                thin[t[0] // width] = t
            pruned = sorted(thin.values())
        history.append(front)
        front = pruned
    # the cheapest end state, then back through the parents
    best = min(range(len(front)), key=lambda i: (front[i][1], front[i][0]))
    keeps: List[List[bool]] = []
    idx = best
    for j in reversed(range(len(costs))):
        entry = front[idx] if j == len(costs) - 1 else history[j + 1][idx]
        keeps.append(list(options[j][entry[3]].keep))
        idx = entry[2]
    keeps.reverse()
    return keeps


def plan_for_peak(costs: Sequence[ChainCost], floor: int, extra_budget: int,
                  tolerance: float = PEAK_TOLERANCE, gaps: Optional[Sequence[int]] = None,
                  byte_cost: float = PEAK_BYTE_COST) -> List[List[bool]]:
    """The plan of least ``recompute cost + byte_cost * predicted step peak`` among those
    whose peak is within ``tolerance`` of the lowest reachable (with ``byte_cost=0``: the
    least-recompute one within it).

    Plans keep at most ``extra_budget`` bytes of conv outputs (``convert``'s default passes
    every layer's: no saved-bytes limit). The peak allowed is ``(1 + tolerance)`` times the
    lowest peak any of them reaches (:func:`lowest_peak`); among the plans within it, the one
    of least recompute cost (:func:`least_recompute`, exact up to
    :func:`chain_options` on chains longer than ten layers).

    # Note: [the default plans for the peak alone]
    # The default used to limit saved bytes to the tutorial method's as well, and to allow
    # any peak up to those bytes. Both tied the plan to a number that decides nothing: a
    # step fails at its peak. The saved-bytes limit forbade keeping a conv output that
    # costs no peak (the tutorial's MNIST network: its chain's backward peaks at the same
    # bytes whether the second conv output is kept or recomputed, so the limit bought
    # recomputing that conv, 0.68 GMAC per step at batch 64, for nothing), and the peak
    # allowance let the plan stop far above the lowest peak where the tutorial's bytes were
    # large (EfficientNet-B0 at batch 8, 224², as ``explain`` measures: 0.39x of eager's
    # peak where 0.30x costs 0.5 GMAC of recompute more). The peak
    # alone, with the tolerance, decides now; ``memory_budget`` still limits saved bytes
    # when asked.

    # Note: [cheap peak]
    # The least recompute within the tolerance alone is blind to how cheap a lower peak
    # can be: on the tutorial's MNIST network (batch 512) recomputing the first conv, 0.1
    # GMAC, lowers the peak from 262.8 to 220.5 MiB, and on the 3-D UNet 0.03 GMAC buys
    # 4 MiB of 38.8, yet both plans were within 30 % of the lowest (the tolerance then). So, inside the
    # tolerance, the plan minimises ``cost + byte_cost * peak``: a lower peak is taken
    # where each byte of it costs at most ``byte_cost`` MAC equivalents (default: writing
    # and reading the byte once, 16), which keeps ResNet-50's plan (its next lower peak
    # costs ~130 per byte) and EfficientNet's (~35). The minimum lies on the staircase of
    # least-recompute plans under falling peaks: walked from the cap down, each step the
    # least recompute strictly below the last plan's peak, in at most ~32 steps (a step
    # below the cap's 1/32 of the range jumps a full 1/32 on very long staircases).

    Args:
        costs: the chains in forward order.
        floor: saved bytes with nothing kept (the end-of-forward baseline).
        extra_budget: bytes allowed for kept conv outputs.
        tolerance: fraction of the lowest peak the plan may exceed it by to recompute less.
        gaps: the moments outside every chain's backward (Note: [moments outside the chains]).
        byte_cost: recompute cost (MAC equivalents) a byte of lower peak is worth inside the
            tolerance (Note: [cheap peak]); 0: the least recompute within it.

    Returns:
        The keep flags, chain by chain.

    Example:
        >>> c = ChainCost((4, 8), (1, 4), (10, 100), ("output", "output"))
        >>> plan_for_peak([c], 0, 8)
        [[False, True]]
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, but got {tolerance}")
    if byte_cost < 0:
        raise ValueError(f"byte_cost must be >= 0, but got {byte_cost}")
    options = [chain_options(c) for c in costs]
    low = lowest_peak(costs, options, floor, extra_budget, gaps)
    cap = int(low * (1 + tolerance))
    best = _reachable_plan(costs, options, floor, extra_budget, cap, gaps)
    if byte_cost == 0:
        return best

    def recompute(keeps: Sequence[Sequence[bool]]) -> int:
        return sum(c.recompute(kp) for c, kp in zip(costs, keeps))

    peak = step_peak(costs, best, floor, gaps=gaps)[0]
    score = recompute(best) + byte_cost * peak
    stride = max(1, (cap - low) // 32)
    while peak > low:  # Note: [cheap peak]
        p = max(low, min(peak - 1, cap - stride * ((cap - peak) // stride + 1)))
        keeps = _reachable_plan(costs, options, floor, extra_budget, p, gaps)
        peak = step_peak(costs, keeps, floor, gaps=gaps)[0]
        s = recompute(keeps) + byte_cost * peak
        if s < score:
            best, score = keeps, s
    return best


def _reachable_plan(costs: Sequence[ChainCost], options: Sequence[Sequence[ChainOption]], floor: int,
                    extra_budget: int, peak: int, gaps: Optional[Sequence[int]] = None) -> List[List[bool]]:
    """:func:`least_recompute` under a peak known to be reachable (at or above :func:`lowest_peak`)."""
    # a reachable peak has a plan: a search that never thins its front finds it
    keeps = least_recompute(costs, options, floor, extra_budget, peak, gaps=gaps) or least_recompute(
        costs, options, floor, extra_budget, peak, max_front=1 << 62, gaps=gaps)
    if keeps is None:  # pragma: no cover - would be a bug in lowest_peak
        raise RuntimeError(f"no plan reaches the peak {peak} that lowest_peak found reachable")
    return keeps


def plan_within_peak(costs: Sequence[ChainCost], floor: int, extra_budget: int,
                     peak: int, gaps: Optional[Sequence[int]] = None) -> Tuple[List[List[bool]], int, bool]:
    """The least-recompute plan whose predicted step peak (:func:`step_peak`) is at most
    ``peak`` bytes and which keeps at most ``extra_budget`` bytes of conv outputs; where no
    plan reaches ``peak``, the least-recompute plan at the lowest reachable peak instead.
    (``convert(peak_budget=...)``: a peak asked for, not a tolerance above the lowest.)

    Args:
        costs: the chains in forward order.
        floor: saved bytes with nothing kept (the end-of-forward baseline).
        extra_budget: bytes allowed for kept conv outputs (every layer's: no saved-bytes limit).
        peak: the predicted step peak allowed, in the unit of ``floor`` and the costs.

    Returns:
        ``(keeps, lowest, reached)``: the keep flags chain by chain, the lowest predicted peak
        any plan within ``extra_budget`` reaches, and whether ``peak`` was reachable.

    Example:
        >>> c = ChainCost((4, 8), (1, 4), (10, 100), ("output", "output"))
        >>> plan_within_peak([c], 0, 12, 30)  # keeping both peaks at 28
        ([[True, True]], 24, True)
        >>> plan_within_peak([c], 0, 12, 26)
        ([[False, True]], 24, True)
        >>> plan_within_peak([c], 0, 12, 20)  # below the lowest reachable: the lowest
        ([[False, True]], 24, False)
    """
    options = [chain_options(c) for c in costs]
    low = lowest_peak(costs, options, floor, extra_budget, gaps)
    reached = peak >= low
    return _reachable_plan(costs, options, floor, extra_budget, max(peak, low), gaps), low, reached
