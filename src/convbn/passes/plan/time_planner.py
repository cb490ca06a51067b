"""The plan for a step time: the lowest predicted peak whose predicted step time fits.

``convert(time_budget=T)`` asks for the lowest step peak whose step takes at most ``T``
times the unconverted model's. The time side is predicted from measured costs
(:class:`StepCosts`, measured once per call by :mod:`convbn.passes.plan.step_costs`), the
peak side by :mod:`convbn.passes.plan.peak_model`; the search is the peak planner's, with
recompute counted in nanoseconds instead of MAC equivalents. Pure: numbers in, flags out.

# Note: [a plan's step time]
# What a plan changes in a step's time is which convolutions run twice: a layer keeping
# its conv output recomputes only element-wise work (BN + tail), which every plan does
# alike; a layer not keeping it runs its conv forward once more in backward (in a
# per-sample-norm chain once per later layer rebuilt from it: Note: [a conv run once per
# rebuild] in autograd/norm_chain_memory.py). So
#     time(plan) = base + sum of conv(i) x runs(i) over the layers not keeping their output,
# ``base`` the converted step with every layer keeping its output, ``conv(i)`` one forward
# of layer i's convolution at its shape, both measured on the device at hand, and
# ``eager`` the unconverted step measured in the same interleaved rounds. The budget is a
# ratio of ``eager``; a plan fits when its predicted time is at most
# ``(time_budget - TIME_MARGIN) * eager``: the margin keeps the choice off the edge where a
# re-measurement could flip it. Given the measured costs the choice is deterministic, and
# the costs are in the report (``ConvertReport.step_costs``) to explain it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from .peak_model import ChainCost, step_peak
from .peak_planner import chain_options, least_recompute, lowest_peak

__all__ = ["TIME_MARGIN", "StepCosts", "timed_costs", "plan_within_time", "TimePlan"]

#: How far under ``time_budget`` (as a fraction of eager's step) a plan's predicted time must be.
TIME_MARGIN = 0.01


@dataclass(frozen=True)
class StepCosts:
    """Measured step costs, seconds (Note: [a plan's step time]).

    Attributes:
        eager: one training step of the unconverted model (median of interleaved rounds).
        base: the converted model's step with every layer keeping its conv output.
        conv: per chain (forward order), per layer: one forward of its convolution (what
            recomputing it costs); 0 for a layer without one (a pre-activation head).
        names: per chain, per layer, the convolution's name (for the report).
    """

    eager: float
    base: float
    conv: Tuple[Tuple[float, ...], ...]
    names: Tuple[Tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        values = [self.eager, self.base] + [c for chain in self.conv for c in chain]
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 for v in values) or self.eager <= 0:
            raise ValueError(f"step costs must be non-negative seconds (eager > 0), but got eager={self.eager!r}, "
                             f"base={self.base!r}, conv={self.conv!r}")

    def predict(self, keeps: Sequence[Sequence[bool]]) -> float:
        """Predicted step seconds of the plan ``keeps`` (per chain, per layer: keeps its conv output)."""
        return self.base + sum(c for chain, kp in zip(self.conv, keeps) for c, k in zip(chain, kp) if not k)

    def lines(self) -> List[str]:
        """The measured costs in words, for the report."""
        total = sum(c for chain in self.conv for c in chain)
        out = [f"  step costs measured: eager {self.eager * 1e3:.2f} ms, converted keeping every conv output "
               f"{self.base * 1e3:.2f} ms ({self.base / self.eager:.3f}x), recomputing every conv "
               f"+{total * 1e3:.2f} ms"]
        for names, chain in zip(self.names, self.conv):
            out += [f"    {n or '-'}: conv {c * 1e3:.3f} ms" for n, c in zip(names, chain) if c > 0]
        return out


def timed_costs(costs: Sequence[ChainCost], step: StepCosts) -> List[ChainCost]:
    """``costs`` with each layer's recompute cost replaced by its measured conv time in
    nanoseconds (the peak planner's searches then minimise time)."""
    if len(costs) != len(step.conv) or any(len(c.y_bytes) != len(t) for c, t in zip(costs, step.conv)):
        raise ValueError(f"step costs for {[len(t) for t in step.conv]} layers per chain do not match the chains' "
                         f"{[len(c.y_bytes) for c in costs]}")
    return [replace(c, macs=tuple(int(round(t * 1e9)) for t in ts)) for c, ts in zip(costs, step.conv)]


@dataclass(frozen=True)
class TimePlan:
    """The plan for a time budget: keep flags, predicted peak and seconds, and whether it fits."""

    keeps: List[List[bool]]
    peak: int
    seconds: float
    reached: bool


def _recompute(costs: Sequence[ChainCost], keeps: Sequence[Sequence[bool]]) -> int:
    return sum(c.recompute(kp) for c, kp in zip(costs, keeps))


def _seconds(timed: Sequence[ChainCost], keeps: Sequence[Sequence[bool]], step: StepCosts) -> float:
    """The predicted step seconds of ``keeps``: ``step.base`` and every conv run again, as often
    as its chain's backward runs it (``ChainCost.recompute`` on the timed costs)."""
    return step.base + _recompute(timed, keeps) / 1e9


def plan_within_time(costs: Sequence[ChainCost], floor: int, extra_budget: int, step: StepCosts,
                     time_budget: float, gaps: Optional[Sequence[int]] = None) -> TimePlan:
    """The lowest-peak plan whose predicted step time is within ``time_budget`` (less
    :data:`TIME_MARGIN`) of ``step.eager``; where none is, the fastest plan.

    The least recompute under a peak falls as the peak allowed rises, so the lowest peak
    whose least-recompute plan fits the time is found by bisection over the peak, between
    the lowest reachable and the fastest plan's.

    Example:
        >>> a = ChainCost((8,), (4,), (0,), ("output",))  # two one-layer chains, costs in seconds below
        >>> s = StepCosts(eager=1.0, base=1.0, conv=((0.02,), (0.2,)))
        >>> plan_within_time([a, a], 0, 16, s, 1.05)  # recomputing the first conv lowers the peak in time
        TimePlan(keeps=[[False], [True]], peak=24, seconds=1.02, reached=True)
        >>> plan_within_time([a, a], 0, 16, s, 1.0).reached  # no plan within eager's time less the margin
        False
    """
    timed = timed_costs(costs, step)
    allowed = int(((time_budget - TIME_MARGIN) * step.eager - step.base) * 1e9)
    options = [chain_options(c) for c in timed]
    fastest = least_recompute(timed, options, floor, extra_budget, 1 << 62, max_front=1 << 62, gaps=gaps)
    if fastest is None:  # pragma: no cover - with no peak limit every plan within extra_budget is one
        raise RuntimeError("no plan keeps within the saved bytes allowed")
    if _recompute(timed, fastest) > allowed:
        return TimePlan(fastest, step_peak(timed, fastest, floor, gaps=gaps)[0], _seconds(timed, fastest, step), False)
    lo = lowest_peak(timed, options, floor, extra_budget, gaps)
    hi = max(lo, step_peak(timed, fastest, floor, gaps=gaps)[0])
    best = fastest
    while lo < hi:  # the lowest peak whose least-recompute plan fits the time
        mid = (lo + hi) // 2
        keeps = least_recompute(timed, options, floor, extra_budget, mid, max_front=1 << 62, gaps=gaps)
        if keeps is not None and _recompute(timed, keeps) <= allowed:
            best, hi = keeps, mid
        else:
            lo = mid + 1
    if step_peak(timed, best, floor, gaps=gaps)[0] > lo:  # the bisection ended on a peak it had not planned
        keeps = least_recompute(timed, options, floor, extra_budget, lo, max_front=1 << 62, gaps=gaps)
        if keeps is not None and _recompute(timed, keeps) <= allowed:
            best = keeps
    return TimePlan(best, step_peak(timed, best, floor, gaps=gaps)[0], _seconds(timed, best, step), True)
