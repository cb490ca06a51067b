"""Planning glue for ``convert(strategy="auto")``: measure a converted model's chains
(saved bytes, shapes, MACs, what is alive around each chain's backward) and hand them to
the pure planner in :mod:`convbn.passes.plan.planner`, then write the chosen modes back.
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
from .planner import (ChainCost, all_keep_bytes, plan_for_peak, plan_layers, plan_on_first_call,
                      plan_within_peak, step_peak, drops_needed)
from .plan_inputs import chains_of, measure_peak, measure_plan_inputs
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


def _chain_layers(model: nn.Module) -> List[List[ChainLayer]]:
    return [m.layers for m in chains_of(model)]


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


def apply_plan(chains: Sequence[FusedChain], keeps: Sequence[Sequence[bool]], may_drop: Sequence[bool]) -> None:
    """Write a plan's flags into ``chains`` (forward order): each layer keeps its conv output
    (``recompute_bn``) or recomputes it (``recompute_conv``); ``may_drop`` per chain."""
    for c, kp, md in zip(chains, keeps, may_drop):
        for l, k in zip(c.layers, kp):
            l.mode = "recompute_bn" if k else "recompute_conv"
            l.may_drop = md


def plan_auto(original: nn.Module, converted: nn.Module, inputs: Tuple[Any, ...], memory_budget: Optional[float],
              report: ConvertReport, peak_budget: Optional[float] = None, peak_target: Optional[int] = None) -> None:
    """Plan every chain of ``converted`` (``convert(strategy="auto")``) and write the modes.

    Args:
        original: the eager model (measured for the budgets' denominators).
        converted: its conversion; its layers' modes are set here.
        inputs: the example inputs.
        memory_budget: saved activation bytes allowed, as a fraction of eager's; ``None``: no
            saved-bytes limit (the default plans for the peak alone).
        report: filled with the measured and predicted figures.
        peak_budget: the step's peak allowed, as a fraction of eager's measured step peak
            (Note: [saved bytes or peak]); ``None``: no peak asked for.
        peak_target: the step's peak allowed in bytes (``convert(memory_limit=...)`` less
            the resident bytes); ``None``: none.

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
    chains = _chain_layers(converted)
    layers = [l for c in chains for l in c]
    with StateSnapshot(original), StateSnapshot(converted):
        stage("plan: measuring the eager step")
        eager = measure_saved(original, inputs)
        eager_peak = measure_peak(original, inputs).peak
        for l in layers:
            l.mode = "recompute_conv"
        for m in chains_of(converted):
            m.plan_on_first_call = None
            m.guard_on_first_call = None  # measured here, on the example inputs
        stage(f"plan: measuring {len(chains)} chains")
        floor = measure_saved(converted, inputs)
        ordered, measured = measure_plan_inputs(converted, inputs)
    costs, gaps, floor_total = measured.costs(), measured.gaps(), measured.floor
    report.eager_saved_bytes, report.floor_saved_bytes = eager, floor
    if memory_budget is None:
        # no saved-bytes limit: the default and a peak budget plan for the peak alone
        # (Note: [the default plans for the peak alone] in planner.py)
        extra = all_keep_bytes(chains)
    else:
        target = int(round(memory_budget * eager, 6))  # budget == floor / eager must reach the floor
        if target < floor:
            least = math.ceil(floor / eager * 1000) / 1000  # rounded *up*: the suggestion must work
            raise ValueError(
                f"memory_budget={memory_budget} asks for {target} saved bytes, below the lowest reachable with "
                f"per-layer strategies: {floor} bytes = {floor / eager:.3f} of eager ({eager} bytes); "
                f"use memory_budget >= {least:.3f}"
            )
        extra = target - floor
    report.eager_peak_bytes = eager_peak
    if peak_budget is not None or peak_target is not None:
        asked = f"peak_budget={peak_budget}" if peak_target is None else "memory_limit"
        report.target_peak_bytes = int(peak_budget * eager_peak) if peak_target is None else peak_target
        chosen = plan_to_target(costs, floor_total, extra, report.target_peak_bytes, gaps)
        keeps, low, reached = chosen.keeps, chosen.lowest, chosen.reached
        report.lowest_peak_bytes = low
        if not reached:
            warnings.warn(
                f"{asked} asks for a step peak of {report.target_peak_bytes} bytes, below the "
                f"lowest any plan reaches{' within memory_budget' if memory_budget is not None else ''}: {low} "
                f"bytes = {low / eager_peak:.3f} of eager's {eager_peak} (predicted); planned for that lowest peak",
                stacklevel=4)  # plan_auto <- convert internals <- convert <- the caller
    elif memory_budget is None:
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
        keeps = plan_for_peak(costs, floor_total, extra, gaps=gaps)
        if step_peak(costs, keeps, floor_total, gaps=gaps)[0] > eager_peak:
            keeps = plan_within_peak(costs, floor_total, extra, eager_peak, gaps)[0]
    else:
        flags = iter(plan_layers(layers, extra))
        by_layer = {id(l): next(flags) for l in layers}
        keeps = [[by_layer[id(l)] for l in c.layers] for c in ordered]
    # the planner is pure; its flags are applied here
    reached = {id(c) for c in ordered}
    for m in chains_of(converted):
        if id(m) not in reached:  # not run by example_inputs: plan when it runs
            for l in m.layers:
                l.mode = "recompute_bn"
            m.plan_on_first_call = plan_on_first_call
            m.guard_on_first_call = peak_above_eager
    may_drop = drops_needed(costs, keeps, floor_total, gaps)  # Note: [drops only where the step peaks]
    apply_plan(ordered, keeps, may_drop)
    # Note: [never above eager], last resort: a step measured above eager's (what a chain
    # recomputes outweighs what it stops keeping, e.g. tiny weight-dominated models) runs
    # its chains as eager modules, with the same peak as eager's. Measured only where the
    # prediction (exact on the models measured, BENCHMARKS.md "## Issue 24") is within 10 %
    # of eager's: elsewhere one more recorded step would only confirm it.
    predicted = step_peak(costs, keeps, floor_total, may_drop=may_drop, gaps=gaps)[0]
    if peak_target is None and peak_budget is None and memory_budget is None and predicted > 0.9 * eager_peak:
        with StateSnapshot(converted):
            fused_peak = measure_peak(converted, inputs).peak
        if fused_peak > eager_peak:
            for m in chains_of(converted):  # registered or added by the in-place rewrite
                m.eager = True
                m.eager_reason = (f"the fused step measured {fused_peak} bytes at its peak on example_inputs, above "
                                  f"eager's {eager_peak}: its layers run as eager modules")
            report.eager_fallback = True
    peak, where = step_peak(costs, keeps, floor_total, may_drop=may_drop, gaps=gaps)
    report.predicted_peak_bytes = peak
    names = {id(m): n for n, m in converted.named_modules()}
    names.update({id(m): n for n, m in fused_modules(converted)})
    report.predicted_peak_where = "end of forward" if where == -1 else "outside the chains" if where == -2 else (
        f"backward, in {names.get(id(ordered[where]), '?')!r} ({ordered[where].layers[0].names[0]} ...)")
    if memory_budget is not None:  # the default and a peak budget alone set no saved-bytes target
        report.target_saved_bytes = floor + extra
    report.saved_bytes = floor + sum(l.keep_bytes() for l in layers if l.mode == "recompute_bn")
