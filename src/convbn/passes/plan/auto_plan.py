"""Planning glue for ``convert(strategy="auto")``: measure a converted model's chains
(saved bytes, shapes, MACs, what is alive around each chain's backward) and hand them to
the pure planner in :mod:`convbn.passes.plan.planner`, then write the chosen modes back.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import Tensor, nn

from ...memory import saved_bytes, timeline
from ...nn.chain import ChainLayer, FusedChain
from .planner import (ChainCost, all_keep_bytes, chain_backward_peak, plan_for_peak, plan_layers, plan_on_first_call,
                      plan_within_peak, step_peak, drops_needed)
from ..graph.graph_module import fused_modules
from .first_call_peak import peak_above_eager
from ..report.convert_report import ConvertReport
from ..check.validate import StateSnapshot

__all__ = ["as_inputs", "measure_saved", "plan_auto", "measure_peak"]


def as_inputs(example_inputs: Any) -> Tuple[Any, ...]:
    if isinstance(example_inputs, Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a Tensor or a tuple of inputs, but got {type(example_inputs).__name__}")


def measure_saved(model: nn.Module, inputs: Tuple[Any, ...]) -> int:
    """Saved *activation* bytes of one training forward (parameters excluded: eager
    autograd saves weights, convbn holds them by reference; either way they are alive).
    A model already in training mode is measured as it is: BatchNorms the user froze
    (``.eval()`` inside a training model) stay frozen."""
    if not model.training:
        model.train()
    return saved_bytes(model, *inputs).activation_bytes


def _chains(model: nn.Module) -> List[FusedChain]:
    return [m for _, m in fused_modules(model) if isinstance(m, FusedChain)]


def _names(model: nn.Module) -> Dict[int, str]:
    """Qualified names of ``model``'s modules and of the fused modules a rewrite added."""
    names = {id(m): n for n, m in model.named_modules()}
    names.update({id(m): n for n, m in fused_modules(model)})
    return names


def _chain_layers(model: nn.Module) -> List[List[ChainLayer]]:
    return [m.layers for m in _chains(model)]


def _chain_costs(converted: nn.Module, inputs: Tuple[Any, ...]
                 ) -> Tuple[List[FusedChain], List[ChainCost], int, List[int]]:
    """The chains in forward order with their :class:`ChainCost`, and the floor's saved
    activation bytes; measured with every layer keeping nothing.

    A chain's ``prefix`` is what is alive besides it when its backward runs: activations
    saved before it, the gradients of the parameters used after it (their backward has
    run by then, and with ``zero_grad(set_to_none=True)`` they did not exist at the end of
    forward), and whatever autograd holds for the ops around it (a residual branch's
    gradient, an output another op saved). It is measured (:func:`_calibrate`): one
    recorded step of this all-recompute plan gives each chain's peak, less its replayed
    transient. Where a chain's backward cannot be told apart in the recording, it is
    estimated from the saved bytes: activations saved before it plus the gradients of the
    parameters used after it. The chain's own parameter gradients are ``w_bytes``.
    """
    converted.train()
    rec = saved_bytes(converted, *inputs, per_module=True)
    names = _names(converted)
    chain_params = {names[id(m)]: _chain_param_bytes(m) for m in _chains(converted)}
    # walk the saves in forward order: a chain's prefix = activations saved before it +
    # gradients of every parameter used after it (saved ones, and later chains' own)
    first: Dict[str, Tuple[int, int]] = {}
    order: Dict[str, int] = {}
    acts_before, params_before = 0, 0
    for (mod, _, _, nbytes), is_param in zip(rec.shapes, rec.is_param):
        if mod not in first:
            first[mod], order[mod] = (acts_before, params_before), len(order)
            params_before += chain_params.get(mod, 0)
        if is_param:
            params_before += nbytes
        else:
            acts_before += nbytes
    total_params = params_before
    prefix = {m: a + total_params - p - chain_params.get(m, 0) for m, (a, p) in first.items()}
    chains = [m for m in _chains(converted) if names.get(id(m)) in first]
    chains.sort(key=lambda m: order[names[id(m)]])  # forward order
    costs = [
        ChainCost(
            y_bytes=tuple(l.y_bytes() for l in c.layers),
            x_bytes=tuple(l.x_bytes() for l in c.layers),
            macs=tuple(l.recompute_cost() for l in c.layers),
            acts=tuple(l.tail_kind() for l in c.layers),
            prefix=prefix[names[id(c)]],
            w_bytes=tuple(_layer_param_bytes(l) for l in c.layers),
            head=c.layers[0].is_head,
            end=c.layers[-1].is_end,
            s_bytes=tuple(_stat_bytes(l) for l in c.layers),
        )
        for c in chains
    ]
    calibrated, gaps = _calibrate(converted, inputs, chains, costs)
    return chains, calibrated, rec.activation_bytes, gaps


def _calibrate(converted: nn.Module, inputs: Tuple[Any, ...], chains: Sequence[FusedChain],
               costs: Sequence[ChainCost]) -> Tuple[List[ChainCost], List[int]]:
    """``costs`` with each ``prefix`` measured: the peak of the chain's backward in one
    recorded step (every layer keeping nothing, as now) less the replayed transient of that
    plan. A chain's backward is found by its autograd node (its output's ``grad_fn``), its
    forward by the module running. Also the moments outside every chain's backward, as
    ``gaps[m]``: the most bytes in use while the first ``m`` chains in forward order may
    hold kept outputs (Note: [moments outside the chains] in passes/planner.py)."""
    nodes: Dict[int, int] = {}
    held: List[Any] = []  # the nodes stay alive (their ids unique) until the step is read

    def record(j: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, Tensor) and out.grad_fn is not None:
                nodes[id(out.grad_fn)] = j
                held.append(out.grad_fn)
        return hook

    handles = [c.register_forward_hook(record(j)) for j, c in enumerate(chains)]
    try:
        tl = measure_peak(converted, inputs)
    finally:
        for h in handles:
            h.remove()
    peaks: Dict[int, int] = {}
    gaps = [0] * (len(chains) + 1)
    names = _names(converted)
    chain_of = {names[id(c)]: j for j, c in enumerate(chains) if id(c) in names}
    ran = -1  # the last chain (forward order) whose forward has started
    done = set()  # chains whose backward has started
    for pt in tl.points:
        j = nodes.get(pt.node) if pt.node else None
        if j is not None:
            peaks[j] = max(peaks.get(j, 0), pt.bytes)
            done.add(j)
            continue
        if pt.phase == "backward":
            alive = max((i for i in range(len(chains)) if i not in done), default=-1)
        else:
            owner = chain_of.get(pt.module.split(".")[0]) if pt.module else None
            if owner is None:  # a chain nested in a submodule: match by its dotted name
                owner = next((i for n, i in chain_of.items() if pt.module == n or pt.module.startswith(n + ".")), None)
            if owner is not None:
                ran = max(ran, owner)
            alive = ran if pt.phase in ("forward", "loss") else -1
        gaps[alive + 1] = max(gaps[alive + 1], pt.bytes)
    del held
    out = []
    for j, cost in enumerate(costs):
        if j in peaks:
            own = chain_backward_peak(cost, [False] * len(cost.y_bytes))[0]
            cost = replace(cost, prefix=max(0, peaks[j] - own))
        out.append(cost)
    return out, gaps


def _stat_bytes(layer: ChainLayer) -> int:
    """Bytes of the mean and inverse std a layer's BatchNorm saves (float32, freed after its
    BN backward: Note: [never above eager])."""
    return 0 if layer.bn is None else 2 * 4 * int(layer.bn.num_features)


def _chain_param_bytes(chain: FusedChain) -> int:
    """Bytes of the gradients a chain's parameters get (conv weight and bias, BN weight and bias)."""
    return sum(_layer_param_bytes(l) for l in chain.layers)


def _layer_param_bytes(layer: ChainLayer) -> int:
    """Bytes of the gradients one layer's parameters get (conv, BN and tail parameters)."""
    return sum(t.numel() * t.element_size() for t in layer.parameters() if t.requires_grad)


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
        eager = measure_saved(original, inputs)
        eager_peak = measure_peak(original, inputs).peak
        for l in layers:
            l.mode = "recompute_conv"
        for m in _chains(converted):
            m.plan_on_first_call = None
            m.guard_on_first_call = None  # measured here, on the example inputs
        floor = measure_saved(converted, inputs)
        ordered, costs, floor_total, gaps = _chain_costs(converted, inputs)
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
        keeps, low, reached = plan_within_peak(costs, floor_total, extra, report.target_peak_bytes, gaps)
        report.lowest_peak_bytes = low
        if not reached:
            warnings.warn(
                f"{asked} asks for a step peak of {report.target_peak_bytes} bytes, below the "
                f"lowest any plan reaches{' within memory_budget' if memory_budget is not None else ''}: {low} "
                f"bytes = {low / eager_peak:.3f} of eager's {eager_peak} (predicted); planned for that lowest peak",
                stacklevel=3)
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
    for m in _chains(converted):
        if id(m) not in reached:  # not run by example_inputs: plan when it runs
            for l in m.layers:
                l.mode = "recompute_bn"
            m.plan_on_first_call = plan_on_first_call
            m.guard_on_first_call = peak_above_eager
    may_drop = drops_needed(costs, keeps, floor_total, gaps)  # Note: [drops only where the step peaks]
    for c, kp, md in zip(ordered, keeps, may_drop):
        for l, k in zip(c.layers, kp):
            l.mode = "recompute_bn" if k else "recompute_conv"
            l.may_drop = md
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
            for m in _chains(converted):  # registered or added by the in-place rewrite
                m.eager = True
                m.eager_reason = (f"the fused step measured {fused_peak} bytes at its peak on example_inputs, above "
                                  f"eager's {eager_peak}: its layers run as eager modules")
            report.eager_fallback = True
    peak, where = step_peak(costs, keeps, floor_total, may_drop=may_drop, gaps=gaps)
    report.predicted_peak_bytes = peak
    names = _names(converted)
    report.predicted_peak_where = "end of forward" if where == -1 else "outside the chains" if where == -2 else (
        f"backward, in {names.get(id(ordered[where]), '?')!r} ({ordered[where].layers[0].names[0]} ...)")
    if memory_budget is not None:  # the default and a peak budget alone set no saved-bytes target
        report.target_saved_bytes = floor + extra
    report.saved_bytes = floor + sum(l.keep_bytes() for l in layers if l.mode == "recompute_bn")


def measure_peak(model: nn.Module, inputs: Tuple[Any, ...]) -> Any:
    """Timeline of one training step of ``model`` (loss: mean output); gradients, buffers,
    modes and RNG are put back afterwards."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with StateSnapshot(model):
            model.train()
            return timeline(model, *inputs)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
