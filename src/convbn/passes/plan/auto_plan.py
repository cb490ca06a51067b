"""Planning glue for ``convert(strategy="auto")``: measure a converted model's chains
(saved bytes, shapes, MACs, what is alive around each chain's backward) and hand them to
the pure planner in :mod:`convbn.passes.plan.planner`, then give each chain its plan
(:mod:`convbn.passes.plan.chain_plans`).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from torch import nn

from ...memory import saved_bytes
from ...nn.chain import ChainLayer, FusedChain
from ...progress import stage
from .chain_plans import apply_plan, lazy_plan
from .peak_model import ChainCost, drops_needed, step_peak
from .peak_planner import plan_for_peak, plan_within_peak
from .planner import plan_layers
from .plan_inputs import PlanInputs, chains_of, measure_peak
from .sliced_measure import record_eager_and_chains, recorded_on_slices
from . import step_costs
from .time_planner import plan_within_time
from ..graph.graph_module import fused_modules
from .first_call_peak import peak_above_eager
from ..report.convert_report import ConvertReport
from ..check.validate import StateSnapshot

__all__ = ["measure_saved", "plan_auto", "measure_peak", "plan_to_target", "PeakPlan", "apply_plan"]


def measure_saved(model: nn.Module, inputs: Tuple[Any, ...]) -> int:
    """Saved *activation* bytes of one training forward (parameters excluded: eager
    autograd saves weights, convbn holds them by reference; either way they are alive).
    A model already in training mode is measured as it is: BatchNorms the user froze
    (``.eval()`` inside a training model) stay frozen."""
    if not model.training:
        model.train()
    return saved_bytes(model, *inputs).activation_bytes


@dataclass(frozen=True)
class PeakPlan:
    """A plan for a step peak asked for: the keep flags and may-drop flags chain by chain,
    its predicted step peak, the lowest peak any plan reaches, and whether the one asked
    for is reached."""

    keeps: List[List[bool]]
    may_drop: List[bool]
    peak: int
    lowest: int
    reached: bool


def plan_to_target(costs: Sequence[ChainCost], floor: int, extra: int, target: int,
                   gaps: Optional[Sequence[int]] = None) -> PeakPlan:
    """The plan ``convert(memory_limit=...)`` / ``peak_budget`` makes for a predicted step
    peak of at most ``target`` bytes (:func:`plan_within_peak`), with its drops
    (:func:`drops_needed`) and its predicted peak (:func:`step_peak`)."""
    keeps, low, reached = plan_within_peak(costs, floor, extra, target, gaps)
    may_drop = drops_needed(costs, keeps, floor, gaps)
    peak = step_peak(costs, keeps, floor, may_drop=may_drop, gaps=gaps)[0]
    return PeakPlan(keeps, may_drop, peak, low, reached)


@dataclass(frozen=True)
class _Measured:
    """What :func:`plan_auto` measures before planning: the eager model's saved bytes and
    step peak, the all-recompute floor, the chains the example inputs reach (forward order)
    and the planner's inputs."""

    eager: int
    eager_peak: int
    floor: int
    ordered: List[FusedChain]
    inputs: PlanInputs


# Note: [a step the meters cannot measure]
# The meters (torch's MemTracker under ``tensor_peak`` / ``timeline``) read every tensor's
# storage; a sparse tensor counts as its indices and values, but a layout they do not know
# (a nested tensor) has none, and they raise NotImplementedError. That is
# a limit of the measurement, not of the model: the chains then plan as without
# ``example_inputs`` (a lazy plan each, resolved on its first training call) and the report
# says why (``ConvertReport.planning_note``).


def _measure(original: nn.Module, converted: nn.Module, inputs: Tuple[Any, ...],
             shapes_at: Optional[int] = None) -> _Measured:
    """Measure the eager step and every chain of ``converted`` recomputing all (state restored):
    at two slices of the batch where their lines hold (Note: [measured on two slices of the
    batch] in sliced_measure.py), else at the example batch; ``shapes_at``: the batch the
    layers' shapes were recorded at by the check (``None``: the example batch)."""
    rec = recorded_on_slices(original, converted, inputs, shapes_at)
    if rec is None:
        stage(f"plan: measuring the eager step and {len(chains_of(converted))} chains")
        # one recorded step gives both the peak and, from its forward, the saved bytes (the
        # mean loss and the backward save nothing): no second forward of the eager model;
        # every layer recomputing (no plan or guard on the first call); ``floor`` is the
        # saved bytes of that plan, from the same run
        rec = record_eager_and_chains(original, converted, inputs)
    return _Measured(rec.eager_saved, rec.eager_peak, rec.inputs.floor, rec.ordered, rec.inputs)


def _extra_bytes(m: _Measured, memory_budget: Optional[float], layers: Sequence[ChainLayer]) -> int:
    """Saved bytes allowed above the floor: every layer's kept output without a budget (the
    default and a peak budget plan for the peak alone: Note: [the default plans for the peak
    alone] in peak_planner.py), else what ``memory_budget`` leaves."""
    if memory_budget is None:
        return sum(l.keep_bytes() for l in layers)
    target = int(round(memory_budget * m.eager, 6))  # budget == floor / eager must reach the floor
    if target < m.floor:
        least = math.ceil(m.floor / m.eager * 1000) / 1000  # rounded *up*: the suggestion must work
        raise ValueError(
            f"memory_budget={memory_budget} asks for {target} saved bytes, below the lowest reachable with "
            f"per-layer strategies: {m.floor} bytes = {m.floor / m.eager:.3f} of eager ({m.eager} bytes); "
            f"use memory_budget >= {least:.3f}"
        )
    return target - m.floor


def _keeps(m: _Measured, extra: int, memory_budget: Optional[float], peak_budget: Optional[float],
           peak_target: Optional[int], report: ConvertReport, layers: Sequence[ChainLayer]) -> List[List[bool]]:
    """The keep flags of the reached chains for what was asked (Note: [saved bytes or peak]);
    ``layers``: every chain's, the knapsack's items under ``memory_budget``."""
    costs, gaps, floor = m.inputs.costs(), m.inputs.gaps(), m.inputs.floor
    if peak_budget is not None or peak_target is not None:
        asked = f"peak_budget={peak_budget}" if peak_target is None else "memory_limit"
        report.target_peak_bytes = int(peak_budget * m.eager_peak) if peak_target is None else peak_target
        chosen = plan_to_target(costs, floor, extra, report.target_peak_bytes, gaps)
        report.lowest_peak_bytes = low = chosen.lowest
        if not chosen.reached:
            warnings.warn(
                f"{asked} asks for a step peak of {report.target_peak_bytes} bytes, below the "
                f"lowest any plan reaches{' within memory_budget' if memory_budget is not None else ''}: {low} "
                f"bytes = {low / m.eager_peak:.3f} of eager's {m.eager_peak} (predicted); planned for that lowest peak",
                stacklevel=6)  # _keeps <- plan_auto <- _plan <- _convert_model <- convert <- the caller
        return chosen.keeps
    if memory_budget is None:
        # the default plans for the step's peak (planner docstring), never above eager's.
        # Note: [never above eager]
        # A converted step could peak above eager's where weights dominate: a chain held
        # all its weight gradients (fixed: Note: [weight gradients as eager releases them])
        # and its BatchNorms' saved statistics (now freed after each BN backward) to its end.
        # What remains is a plan whose recompute transient is not paid for by what it stops
        # keeping: eager's peak is measured on the example inputs (the same meter as the
        # prediction), and where the default plan's predicted peak is above it, the least
        # recompute whose predicted peak is not (keeping everything, ``recompute_bn``,
        # saves no more than eager and recomputes only element-wise).
        keeps = plan_for_peak(costs, floor, extra, gaps=gaps)
        if step_peak(costs, keeps, floor, gaps=gaps)[0] > m.eager_peak:
            keeps = plan_within_peak(costs, floor, extra, m.eager_peak, gaps)[0]
        return keeps
    flags = iter(plan_layers(layers, extra))
    by_layer = {id(l): next(flags) for l in layers}
    return [[by_layer[id(l)] for l in c.layers] for c in m.ordered]


def _time_keeps(original: nn.Module, converted: nn.Module, inputs: Tuple[Any, ...], m: _Measured, extra: int,
                time_budget: float, report: ConvertReport) -> List[List[bool]]:
    """The lowest-peak plan predicted within ``time_budget`` of the unconverted step (Note: [a
    plan's step time] in time_planner.py), from step costs measured here, once; the costs and
    the prediction go into the report."""
    stage("plan: measuring step costs for time_budget")
    costs = step_costs.measure_step_costs(original, converted, m.ordered, inputs)
    chosen = plan_within_time(m.inputs.costs(), m.inputs.floor, extra, costs, time_budget, m.inputs.gaps())
    report.step_costs, report.time_budget = costs, time_budget
    report.predicted_time_ratio = chosen.seconds / costs.eager
    if not chosen.reached:
        warnings.warn(
            f"time_budget={time_budget} asks for a step within {time_budget}x the unconverted step's time "
            f"({costs.eager * 1e3:.2f} ms measured), but the fastest plan is predicted at "
            f"{report.predicted_time_ratio:.3f}x: planned for the fastest", stacklevel=6)
    return chosen.keeps


def _eager_if_above(converted: nn.Module, inputs: Tuple[Any, ...], eager_peak: int, report: ConvertReport) -> None:
    """Note: [never above eager], last resort: a step measured above eager's (what a chain
    recomputes outweighs what it stops keeping, e.g. tiny weight-dominated models) runs its
    chains as eager modules, with the same peak as eager's."""
    with StateSnapshot(converted):
        fused_peak = measure_peak(converted, inputs, backward_modules=False).peak  # as eager_peak was
    if fused_peak > eager_peak:
        why = (f"the fused step measured {fused_peak} bytes at its peak on example_inputs, above "
               f"eager's {eager_peak}: its layers run as eager modules")
        for m in chains_of(converted):  # registered or added by the in-place rewrite
            m.apply_plan(m.plan.running_eager(why))
        report.eager_fallback = True


def plan_auto(original: nn.Module, converted: nn.Module, inputs: Tuple[Any, ...], memory_budget: Optional[float],
              report: ConvertReport, peak_budget: Optional[float] = None, peak_target: Optional[int] = None,
              time_budget: Optional[float] = None, shapes_at: Optional[int] = None) -> None:
    """Plan every chain of ``converted`` (``convert(strategy="auto")``) and give each its plan.

    Args:
        original: the eager model (measured for the budgets' denominators).
        converted: its conversion; each chain gets its plan here (``FusedChain.apply_plan``).
        inputs: the example inputs.
        memory_budget: saved activation bytes allowed, as a fraction of eager's; ``None``: no
            saved-bytes limit (the default plans for the peak alone).
        report: filled with the measured and predicted figures.
        peak_budget: the step's peak allowed, as a fraction of eager's measured step peak
            (Note: [saved bytes or peak]); ``None``: no peak asked for.
        peak_target: the step's peak allowed in bytes (``convert(memory_limit=...)`` less
            the resident bytes); ``None``: none.
        time_budget: the step time allowed as a ratio of the unconverted step's: the lowest
            predicted peak within it (Note: [a plan's step time]); not with a peak asked for.
        shapes_at: the batch the check left the layers' shapes at (``None``: the example batch).

    # Note: [saved bytes or peak]
    # ``memory_budget`` limits the *saved* bytes (held from forward to backward): the
    # knapsack of :func:`plan_layers`, blind to the backward's transients. ``peak_budget``
    # limits the step's *peak* (what decides an out-of-memory error), predicted exactly by
    # the planner and compared with eager's peak measured the same way
    # (:func:`measure_peak`: one step, gradients set to None first, parameters not counted).
    # Given both, both are limits: the least recompute whose saved bytes and predicted peak
    # both fit; a peak no plan within the saved bytes reaches gives the lowest one that
    # is reached, and the report says so. Given neither, the default plans for the peak
    # with a tolerance, and no saved-bytes limit (:func:`plan_for_peak`).
    """
    layers = [l for m in chains_of(converted) for l in m.layers]
    try:
        m = _measure(original, converted, inputs, shapes_at)
    except NotImplementedError as exc:  # Note: [a step the meters cannot measure]
        for c in chains_of(converted):
            c.apply_plan(lazy_plan(c, peak_above_eager))
        report.planning_note = (f"the step could not be measured on example_inputs ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:120]}); each chain plans on its first training call")
        return
    report.eager_saved_bytes, report.floor_saved_bytes = m.eager, m.floor
    extra = _extra_bytes(m, memory_budget, layers)
    report.eager_peak_bytes = m.eager_peak
    if time_budget is not None:
        keeps = _time_keeps(original, converted, inputs, m, extra, time_budget, report)
    else:
        keeps = _keeps(m, extra, memory_budget, peak_budget, peak_target, report, layers)
    costs, gaps, floor = m.inputs.costs(), m.inputs.gaps(), m.inputs.floor
    may_drop = _apply(converted, m, keeps)
    # measured only where the prediction (exact on the models measured, BENCHMARKS.md
    # "## Issue 24") is within 10 % of eager's: elsewhere one more recorded step would only confirm it
    peak, where = step_peak(costs, keeps, floor, may_drop=may_drop, gaps=gaps)
    if peak_target is None and peak_budget is None and memory_budget is None and time_budget is None \
            and peak > 0.9 * m.eager_peak:
        _eager_if_above(converted, inputs, m.eager_peak, report)
    report.predicted_peak_bytes = peak
    report.predicted_peak_where = _where(converted, m.ordered, where)
    if memory_budget is not None:  # the default and a peak budget alone set no saved-bytes target
        report.target_saved_bytes = m.floor + extra
    report.saved_bytes = m.floor + sum(l.keep_bytes() for l in layers if l.mode == "recompute_bn")


def _apply(converted: nn.Module, m: _Measured, keeps: List[List[bool]]) -> List[bool]:
    """Give the reached chains their plans (with the drops their step peak needs) and the others
    a plan made on their first call; returns the may-drop flags."""
    costs, gaps, floor = m.inputs.costs(), m.inputs.gaps(), m.inputs.floor
    may_drop = drops_needed(costs, keeps, floor, gaps)  # Note: [drops only where the step peaks]
    reached = {id(c) for c in m.ordered}
    for c in chains_of(converted):
        if id(c) not in reached:  # not run by example_inputs: planned when it runs
            c.apply_plan(lazy_plan(c, peak_above_eager))
    apply_plan(m.ordered, keeps, may_drop)  # the planner is pure; its plans are applied here
    return may_drop


def _where(converted: nn.Module, ordered: Sequence[FusedChain], where: int) -> str:
    """Where the predicted peak falls, for the report."""
    if where in (-1, -2):
        return "end of forward" if where == -1 else "outside the chains"
    names = {id(m): n for n, m in converted.named_modules()}
    names.update({id(m): n for n, m in fused_modules(converted)})
    return f"backward, in {names.get(id(ordered[where]), '?')!r} ({ordered[where].layers[0].names[0]} ...)"
