"""Measuring what :mod:`convbn.passes.plan.time_planner` predicts step times from, on the
device at hand: the unconverted step, the converted step keeping every conv output, and one
forward of each fused layer's convolution (Note: [a plan's step time] in time_planner.py).

Measured once per ``convert(time_budget=...)`` call, then the choice is made on these numbers
alone; they go into the report (``ConvertReport.step_costs``). Steps run with the model's
state restored afterwards (buffers, modes, gradients, RNG: the measurement's random numbers
are its own). Thread CPU time where torch runs one CPU thread (the rest of a loaded machine
does not count), else wall time, after a synchronize on CUDA.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, List, Sequence, Tuple

import torch
from torch import nn

from ...functional.conv import conv_forward
from ...nn.chain import ChainLayer, FusedChain
from ..check.validate import StateSnapshot
from .chain_plans import chain_plan
from .plan_inputs import trained_outputs_loss
from .time_planner import StepCosts

__all__ = ["measure_step_costs", "STEP_ROUNDS", "CONV_REPEATS"]

#: Interleaved rounds of the eager and the converted step (after one warm-up step each).
STEP_ROUNDS = 7
#: Timed calls of each layer's convolution (after one warm-up call); the median is kept.
CONV_REPEATS = 5


def _clock(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":
        def wall() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return wall
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _device(model: nn.Module) -> torch.device:
    return next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))


def _step_seconds(model: nn.Module, inputs: Tuple[Any, ...], clock: Callable[[], float]) -> float:
    for p in model.parameters():  # zero_grad(set_to_none=True), as a training step does
        p.grad = None
    t = clock()
    trained_outputs_loss(model(*inputs)).backward()
    return clock() - t


def _interleaved(original: nn.Module, converted: nn.Module, inputs: Tuple[Any, ...], rounds: int) -> Tuple[float, float]:
    """Median step seconds of ``original`` and ``converted``, in alternating order each round."""
    clock = _clock(_device(original))
    times: List[List[float]] = [[], []]
    models = [original, converted]
    for m in models:  # warm-up
        _step_seconds(m, inputs, clock)
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for i in order:
            times[i].append(_step_seconds(models[i], inputs, clock))
    return statistics.median(times[0]), statistics.median(times[1])


def _conv_seconds(layer: ChainLayer, repeats: int) -> float:
    """One forward of ``layer``'s convolution at the shape it last ran at (0 for a head)."""
    w = layer.weight
    if layer.conv is None or w is None or layer.x_shape is None:
        return 0.0
    dtype = layer.y_dtype or w.dtype
    clock = _clock(w.device)
    with torch.no_grad():
        x = torch.zeros(layer.x_shape, dtype=dtype, device=w.device)
        wd = w.detach().to(dtype)
        b = layer.bias.detach().to(dtype) if layer.bias is not None else None
        conv_forward(x, wd, b, layer.conv)
        times = []
        for _ in range(repeats):
            t = clock()
            conv_forward(x, wd, b, layer.conv)
            times.append(clock() - t)
    return statistics.median(times)


def measure_step_costs(original: nn.Module, converted: nn.Module, chains: Sequence[FusedChain],
                       inputs: Tuple[Any, ...], rounds: int = STEP_ROUNDS, repeats: int = CONV_REPEATS) -> StepCosts:
    """The step costs of ``converted`` (its ``chains`` in forward order) against ``original``
    (sharing its parameters) on ``inputs``: every chain keeps all its conv outputs while the
    steps are timed, then has its plan back; state and gradients are restored."""
    params = list({id(p): p for m in (original, converted) for p in m.parameters()}.values())
    grads = [p.grad for p in params]
    plans = [c.plan for c in chains]
    try:
        with StateSnapshot(original), StateSnapshot(converted):
            original.train()
            converted.train()
            for c in chains:  # a chain running as eager modules keeps doing so
                if not c.eager:
                    c.apply_plan(chain_plan([True] * len(c.layers), list(c.plan.may_drop)))
            eager, base = _interleaved(original, converted, inputs, rounds)
    finally:
        for c, plan in zip(chains, plans):
            c.apply_plan(plan)
        for p, g in zip(params, grads):
            p.grad = g
    conv = tuple(tuple(_conv_seconds(l, repeats) for l in c.layers) for c in chains)
    names = tuple(tuple(l.names[0] for l in c.layers) for c in chains)
    return StepCosts(max(eager, 1e-9), base, conv, names)
