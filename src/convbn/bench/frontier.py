"""The (peak, time) plane: measured points and the frontier among them.

A point is one way of training the model (eager, ``torch.compile`` with or without an
activation-memory budget, per-block checkpointing, a convbn plan, with or without compile)
measured as its training step's peak and its step time. A point is *on the frontier* when
no other point is at least as good on both axes and better on one (the non-dominated set):
the choices worth making, whatever weight a user gives memory against time.
Pure: numbers in, flags and text out (:mod:`convbn.bench.frontier_run` measures).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

__all__ = ["FrontierPoint", "dominates", "pareto_front", "mark_frontier", "frontier_table"]


@dataclass(frozen=True)
class FrontierPoint:
    """One configuration on the (peak, time) plane.

    Attributes:
        name: what was measured (``"eager"``, ``"torch.compile budget=0.5"`` ...).
        peak: the training step's peak, bytes (Note: [a step's peak]).
        time: the step time, seconds (median of interleaved rounds).
        on_frontier: no other point is at least as low on both axes and lower on one.
        note: what the configuration did (chains, blocks, a failure).
        chosen: the plan ``convert(time_budget=...)`` picked (drawn apart).
    """

    name: str
    peak: float
    time: float
    on_frontier: bool = False
    note: str = ""
    chosen: bool = False


def dominates(a: Tuple[float, float], b: Tuple[float, float]) -> bool:
    """Whether ``a`` (peak, time) is at least as low as ``b`` on both axes and lower on one."""
    return a[0] <= b[0] and a[1] <= b[1] and (a[0] < b[0] or a[1] < b[1])


def pareto_front(points: Sequence[Tuple[float, float]]) -> List[int]:
    """Indices of the non-dominated ``(peak, time)`` points, by rising peak (ties by time,
    then index). Equal points are both on the frontier (neither dominates the other); a point
    with a NaN coordinate (a configuration that failed) never is.

    Example:
        >>> pareto_front([(10, 1.0), (5, 2.0), (6, 2.5), (10, 1.0)])
        [1, 0, 3]
    """
    ok = [i for i, (p, t) in enumerate(points) if p == p and t == t]
    order = sorted(ok, key=lambda i: (points[i][0], points[i][1], i))
    front: List[int] = []
    best_time = float("inf")
    for i in order:  # by rising peak: on the frontier exactly when faster than every lower peak
        p, t = points[i]
        if t < best_time or (front and (p, t) == tuple(points[front[-1]])):
            front.append(i)
            best_time = min(best_time, t)
    return front


def mark_frontier(points: Sequence[FrontierPoint]) -> List[FrontierPoint]:
    """``points`` with ``on_frontier`` set from :func:`pareto_front`, in the same order."""
    on = set(pareto_front([(p.peak, p.time) for p in points]))
    return [replace(p, on_frontier=i in on) for i, p in enumerate(points)]


def _ratio(a: float, b: Optional[float]) -> str:
    return "-" if not b or a != a else f"{a / b:.3f}"


def frontier_table(points: Sequence[FrontierPoint], baseline: str = "eager", markdown: bool = True) -> str:
    """The points as a table (markdown or plain text): peak MiB, step ms, both as ratios of
    ``baseline``'s, the frontier marked ``*`` and the time-budget choice ``<-``."""
    base = next((p for p in points if p.name == baseline), None)
    head = ["config", "peak MiB", "peak x eager", "step ms", "time x eager", "frontier", "note"]
    rows = []
    for p in points:
        mark = ("*" if p.on_frontier else "") + (" <- time_budget" if p.chosen else "")
        rows.append([p.name, f"{p.peak / 2**20:.1f}", _ratio(p.peak, base.peak if base else None),
                     f"{p.time * 1e3:.1f}", _ratio(p.time, base.time if base else None), mark.strip(), p.note])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * 4 + ["---", "---"]) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows)
