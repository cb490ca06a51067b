"""The plans for a step's peak: the lowest reachable, and the least recompute under a peak.

The default plan of ``convert(strategy="auto")`` (:func:`plan_for_peak`), and the plan for a
peak asked for (:func:`plan_within_peak`: ``peak_budget``, ``memory_limit``, ``max_batch``),
searched over per-chain options (:func:`chain_options`) with the prediction of
:mod:`convbn.passes.plan.peak_model`. Pure: numbers in, keep flags out.

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

# Note: [a byte of peak against the chains' work]
# A fixed price per byte (``PEAK_BYTE_COST``) and a tolerance of the whole peak miss a lower
# peak that is cheap next to the step, where weight gradients make most of the peak. MONAI's
# ResNet-18 at batch 8, 112² (SGD): lowest peak 62.9 MiB, 42.6 of it weight gradients every
# plan makes; 8 % of it (5.0 MiB) let the default keep 4.3 MiB more (67.3 MiB, 0.838x eager's
# peak against 0.784x) to save 265 M MAC equivalents of recompute, 58 per byte: above 16 per
# byte, but 6 % of the chains' forward convolution work (4.38 G) for 6.9 % of the peak. So a
# byte of peak is also worth ``PEAK_WORK_SHARE`` times the chains' convolution work (each
# layer's recompute cost once, what recomputing every conv costs) over the lowest peak: a
# fraction of the peak is worth that fraction of the work, whichever price is higher. On the
# nets of BENCHMARKS.md this moves MONAI's ResNet-18 (66 per byte: to its lowest peak) and
# DenseNet-121 (141 per byte: 0.231x -> 0.216x for 0.36 G more); ResNet-50's next lower peak
# costs 302 per byte (its price: 142), EfficientNet-B0's price stays 16, and the per-sample
# norm nets (diffusion, 3-D U-Net, ConvNeXt) keep their plans. A higher price only lowers the
# chosen peak (never raises it: the minimum of ``recompute + price * peak`` moves down as the
# price goes up), inside the same tolerance. The peaks are live tensor bytes: by the CPU
# allocator ResNet-18's step peaks in its stem conv's backward (about 6.1 MiB of kernel scratch
# no tensor shows) under either plan, 0.850x -> 0.848x (BENCHMARKS.md, "## Issue 24").

# Note: [a planner that scales]
# The default plan walks the staircase of Note [cheap peak]: up to ~33 least-recompute
# searches, each a dynamic programme over the chains whose front holds up to 4096 entries.
# As a Python loop over (front entry, option) pairs that was 112 s of a 378 s convert on an
# HRNet-style net of 172 chains; :func:`least_recompute` runs each chain's step as tensor
# operations (the candidates, the stable sort, the Pareto pruning, the thinning), the same
# programme with the same ties, tested against the loop (:func:`least_recompute_reference`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...functional.conv import COST_PER_BYTE
from .peak_model import ChainCost, gaps_of, chain_backward_peak, step_peak

__all__ = ["PEAK_TOLERANCE", "PEAK_BYTE_COST", "PEAK_WORK_SHARE", "ChainOption", "chain_options", "lowest_peak",
           "least_recompute", "least_recompute_reference", "peak_byte_cost", "plan_for_peak", "plan_within_peak"]


#: How far above the lowest reachable peak the default plan may go to recompute less, as a
#: fraction of that peak (the predicted step peak: Note: [a step's peak] in
#: convbn/memory/timelines.py, weight gradients counted). Recompute costs step time and the
#: last bytes of peak are the dearest. On torchvision's ResNet-50 (batch 8, 224², SGD) the
#: lowest peak is 0.38x eager's; 30 % above it (the value until issue 24, chosen when the
#: bench's meter left weight gradients out) gave 0.49x at 11.5 GMAC of conv recompute per
#: step, 10 % 0.42x at 19.1 GMAC, 8 % 0.41x (BENCHMARKS.md "## Issue 24"). Where parameter
#: gradients make most of the peak (ResNet-18 at 112²) 8 % of it is much of the activations:
#: there a lower peak that is cheap next to the chains' work is taken inside the tolerance
#: (:data:`PEAK_WORK_SHARE`); ``peak_budget`` / ``memory_limit`` ask for a lower peak.
PEAK_TOLERANCE = 0.08

#: What a byte of step peak is worth in recompute cost (MAC equivalents) inside the
#: tolerance: twice :data:`convbn.functional.conv.COST_PER_BYTE`, about the cost of writing
#: and reading that byte once (Note: [cheap peak]).
PEAK_BYTE_COST = 2 * COST_PER_BYTE

#: What a fraction of the lowest step peak is worth inside the tolerance, as that fraction of
#: the chains' convolution work (the recompute cost of every layer once) times this share:
#: a byte of peak costs ``max(PEAK_BYTE_COST, PEAK_WORK_SHARE * work / lowest peak)``
#: (Note: [a byte of peak against the chains' work]).
PEAK_WORK_SHARE = 1.0


@dataclass(frozen=True)
class ChainOption:
    """One plan of one chain, as numbers: its keep flags, the conv output bytes it keeps
    from forward (``kept``), its backward transient (``own``, :func:`chain_backward_peak`;
    or its own forward's moments less its prefix where higher) and the MACs it recomputes."""

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
        # the chain's own forward moments are checked with its backward's (both above what
        # the chains before it keep): Note: [a moment inside a chain's forward] in peak_model.py
        own = max(chain_backward_peak(cost, kp)[0], cost.forward_peak(kp) - cost.prefix)
        opts.append(ChainOption(kp, cost.kept_bytes(kp), own, cost.recompute(kp)))
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
    gap = gaps_of(gaps, len(costs))

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

    The dynamic programme of Note: [least recompute under a peak] (in
    :func:`least_recompute_reference`, which runs it as a plain loop) on tensors: each chain's
    candidates (front x options), their filter, the stable sort by (bytes kept, recompute), the
    Pareto pruning and the thinning are whole-array operations, so a model of hundreds of chains
    with fronts of thousands plans in a fraction of a second (Note: [a planner that scales]).
    """
    gap = gaps_of(gaps, len(costs))
    limit = min(extra_budget, peak - floor)
    if gap[0] > peak:
        return None
    dtype = torch.float64 if any(isinstance(o.recompute, float) for opts in options for o in opts) else torch.int64
    kept_b, rec = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=dtype)
    parents: List[Tensor] = []  # per chain: each new front entry's flat (front entry, option) index
    for j, (c, opts) in enumerate(zip(costs, options)):
        o_kept = torch.tensor([o.kept for o in opts], dtype=torch.int64)
        o_own = torch.tensor([o.own for o in opts], dtype=torch.int64)
        o_rec = torch.tensor([o.recompute for o in opts], dtype=dtype)
        b = (kept_b[:, None] + o_kept[None, :]).flatten()  # row-major: the reference's loop order
        own = (kept_b[:, None] + o_own[None, :]).flatten()
        idx = ((b <= limit) & (c.prefix + own <= peak) & (gap[j + 1] + b <= peak)).nonzero().squeeze(1)
        if idx.numel() == 0:
            return None
        b, r = b[idx], (rec[:, None] + o_rec[None, :]).flatten()[idx]
        by_r = torch.sort(r, stable=True).indices  # (bytes, recompute), ties in loop order
        order = by_r[torch.sort(b[by_r], stable=True).indices]
        b, r, idx = b[order], r[order], idx[order]
        keep = torch.ones(r.numel(), dtype=torch.bool)
        keep[1:] = r[1:] < torch.cummin(r, 0).values[:-1]  # below every cheaper-in-bytes entry's
        b, r, idx = b[keep], r[keep], idx[keep]
        if b.numel() > max_front:  # the last (cheapest) entry of each byte bucket
            bucket = b // max(1, limit // max_front + 1)
            last = torch.ones(b.numel(), dtype=torch.bool)
            last[:-1] = bucket[:-1] != bucket[1:]
            b, r, idx = b[last], r[last], idx[last]
        parents.append(idx)
        kept_b, rec = b, r
    at = int(torch.nonzero(rec == rec.min())[0])  # least recompute; bytes ascend, so the fewest bytes
    keeps: List[List[bool]] = []
    for j in reversed(range(len(costs))):
        flat = int(parents[j][at])
        keeps.append(list(options[j][flat % len(options[j])].keep))
        at = flat // len(options[j])
    keeps.reverse()
    return keeps


def least_recompute_reference(costs: Sequence[ChainCost], options: Sequence[Sequence[ChainOption]], floor: int,
                    extra_budget: int, peak: int, max_front: int = 4096,
                    gaps: Optional[Sequence[int]] = None) -> Optional[List[List[bool]]]:
    """:func:`least_recompute` as a plain Python loop: the obviously right reference its
    vectorised programme is tested against (the same front, the same ties, the same plan).

    # Note: [least recompute under a peak]
    # The step's peak constraint, chain by chain: prefix_j + kept before j + own_j <= peak,
    # and floor + all kept <= peak. Only "kept before j" links the chains, so a dynamic
    # programme over the chains in forward order keeps, for each reachable amount kept so
    # far, the least recompute reaching it (a Pareto front of (bytes kept, MACs); the
    # front is thinned to ``max_front`` byte buckets on very long models, which can only
    # miss an optimum by one bucket's bytes, never break the constraint).
    """
    gap = gaps_of(gaps, len(costs))
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


def peak_byte_cost(costs: Sequence[ChainCost], lowest: int, byte_cost: float = PEAK_BYTE_COST,
                   work_share: float = PEAK_WORK_SHARE) -> float:
    """What a byte of step peak is worth in recompute cost (MAC equivalents) inside the
    tolerance: ``max(byte_cost, work_share * work / lowest)``, ``work`` the chains' convolution
    work (every layer's recompute cost once). Note: [a byte of peak against the chains' work].

    Args:
        costs: the chains.
        lowest: the lowest reachable step peak (:func:`lowest_peak`), in bytes.
        byte_cost: the least a byte is worth (Note: [cheap peak]).
        work_share: how much of the chains' work a fraction of the lowest peak is worth, as a
            share of that fraction (0: ``byte_cost`` alone).

    Example:
        >>> c = ChainCost((4, 8), (1, 4), (1000, 3000), ("output", "output"))
        >>> peak_byte_cost([c], 100), peak_byte_cost([c], 100, work_share=0), peak_byte_cost([c], 1000)
        (40.0, 16, 16)
    """
    _check_prices(byte_cost, work_share)
    work = sum(sum(c.macs) for c in costs)
    if work_share == 0 or lowest <= 0 or work_share * work / lowest <= byte_cost:
        return byte_cost
    return work_share * work / lowest


def _check_prices(byte_cost: float, work_share: float) -> None:
    if byte_cost < 0:
        raise ValueError(f"byte_cost must be >= 0, but got {byte_cost}")
    if work_share < 0:
        raise ValueError(f"work_share must be >= 0, but got {work_share}")


def plan_for_peak(costs: Sequence[ChainCost], floor: int, extra_budget: int,
                  tolerance: float = PEAK_TOLERANCE, gaps: Optional[Sequence[int]] = None,
                  byte_cost: float = PEAK_BYTE_COST, work_share: float = PEAK_WORK_SHARE) -> List[List[bool]]:
    """The plan of least ``recompute cost + price * predicted step peak`` among those whose
    peak is within ``tolerance`` of the lowest reachable, ``price`` the worth of a byte of peak
    (:func:`peak_byte_cost`; with ``byte_cost=0`` and ``work_share=0``: the least-recompute
    plan within it).

    Plans keep at most ``extra_budget`` bytes of conv outputs (``convert``'s default passes
    every layer's: no saved-bytes limit). The peak allowed is ``(1 + tolerance)`` times the
    lowest peak any of them reaches (:func:`lowest_peak`); among the plans within it, the one
    of least recompute cost (:func:`least_recompute`, exact up to
    :func:`chain_options` on chains longer than ten layers). Notes: [the default plans for
    the peak alone], [cheap peak], [a byte of peak against the chains' work] (above).

    Args:
        costs: the chains in forward order.
        floor: saved bytes with nothing kept (the end-of-forward baseline).
        extra_budget: bytes allowed for kept conv outputs.
        tolerance: fraction of the lowest peak the plan may exceed it by to recompute less.
        gaps: the moments outside every chain's backward (Note: [moments outside the chains]).
        byte_cost: the least recompute cost (MAC equivalents) a byte of lower peak is worth
            inside the tolerance (Note: [cheap peak]).
        work_share: a fraction of the lowest peak is worth this share of the same fraction of
            the chains' convolution work, where that is more than ``byte_cost`` per byte.

    Returns:
        The keep flags, chain by chain.

    Example:
        >>> c = ChainCost((4, 8), (1, 4), (10, 100), ("output", "output"))
        >>> plan_for_peak([c], 0, 8)
        [[False, True]]
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, but got {tolerance}")
    _check_prices(byte_cost, work_share)
    options = [chain_options(c) for c in costs]
    low = lowest_peak(costs, options, floor, extra_budget, gaps)
    cap = int(low * (1 + tolerance))
    best = _reachable_plan(costs, options, floor, extra_budget, cap, gaps)
    price = peak_byte_cost(costs, low, byte_cost, work_share)
    if price == 0:
        return best
    return _cheapest_on_staircase(costs, options, floor, extra_budget, gaps, best, low, cap, price)


def _cheapest_on_staircase(costs: Sequence[ChainCost], options: Sequence[Sequence[ChainOption]], floor: int,
                           extra_budget: int, gaps: Optional[Sequence[int]], best: List[List[bool]], low: int,
                           cap: int, price: float) -> List[List[bool]]:
    """From ``best`` (the least recompute under ``cap``) down the staircase of least-recompute
    plans under falling peaks to ``low``: the plan of least ``recompute + price * peak``
    (Note: [cheap peak])."""
    def recompute(keeps: Sequence[Sequence[bool]]) -> int:
        return sum(c.recompute(kp) for c, kp in zip(costs, keeps))

    peak = step_peak(costs, best, floor, gaps=gaps)[0]
    score = recompute(best) + price * peak
    stride = max(1, (cap - low) // 32)
    while peak > low:
        p = max(low, min(peak - 1, cap - stride * ((cap - peak) // stride + 1)))
        keeps = _reachable_plan(costs, options, floor, extra_budget, p, gaps)
        peak = step_peak(costs, keeps, floor, gaps=gaps)[0]
        s = recompute(keeps) + price * peak
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
