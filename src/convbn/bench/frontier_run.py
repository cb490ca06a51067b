"""Measuring the (peak, time) plane for one model and input: every configuration a user
could train with, side by side in one process (:mod:`convbn.bench.frontier` marks the frontier).

Configurations (:func:`frontier_configs`), each a deep copy of the same model with its own
SGD optimizer: ``eager``; ``torch.compile``; ``torch.compile budget=B`` (AOTAutograd's
activation-memory budget, :mod:`convbn.bench.compile_budget`); ``checkpoint per block``
(:mod:`convbn.bench.checkpointing`); convbn's plans from the lowest peak to eager's
(``convert peak=X``: ``convert(peak_budget=X)``, X from the lowest reachable fraction up to
1; ``convert auto``: the default plan; ``convert time=T``: ``convert(time_budget=T)``), each
also under ``torch.compile`` (``... + compile``).

Measured (:func:`measure_points`): the training step (``zero_grad(set_to_none=True)``,
forward under the precision's autocast, mean-of-output loss, backward, ``SGD.step()``; fp16
scales the loss with ``GradScaler``) after ``warmup`` untimed steps (compilation happens
there). Its **peak**: on CPU the most bytes live at the CPU allocator during the step above
what was live after ``zero_grad`` (:func:`convbn.memory.allocator_peak`: exact, and it sees
compiled code's buffers), on CUDA ``max_memory_allocated`` above the same baseline; weight
gradients count. Its **time**: the median over interleaved rounds (Note: [Round-robin
timing] in :mod:`convbn.bench.training`), thread CPU time where torch runs one CPU thread
(the rest of a loaded machine does not count), else wall time after a synchronize.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from convbn.bench.common import backward_and_step
from convbn.bench.checkpointing import checkpoint_blocks, find_blocks
from convbn.bench.compile_budget import budget_backend, inductor_layout_optimization, raise_recompile_limit
from convbn.bench.frontier import FrontierPoint, mark_frontier
from convbn.memory import allocator_peak
from convbn.passes.convert.api import convert, explain

__all__ = ["PRECISIONS", "FrontierSettings", "Config", "frontier_configs", "plan_fractions", "measure_points",
           "run_frontier"]

#: Precisions: fp32 as is; bf16 under autocast (CPU and CUDA); fp16 under autocast with GradScaler (CUDA only).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FrontierSettings:
    """What :func:`run_frontier` measures.

    Attributes:
        precision: a key of :data:`PRECISIONS`.
        compile: add the ``torch.compile`` configurations (each convbn plan also compiled).
        compile_budgets: activation-memory budgets of ``torch.compile budget=B``.
        plans: how many ``convert peak=X`` plans from the lowest reachable peak to eager's.
        time_budgets: ``convert time=T`` configurations (``convert(time_budget=T)``).
        rounds: timed interleaved rounds; warmup: untimed steps per configuration first.
        lr: the SGD learning rate of every configuration.
        layout_optimization: inductor's layout optimisation for every compiled configuration
            alike (``None``: inductor's default; on the CPU it saves channels-last weight copies).
    """

    precision: str = "fp32"
    compile: bool = True
    compile_budgets: Tuple[float, ...] = (0.5, 0.3)
    plans: int = 3
    time_budgets: Tuple[float, ...] = ()
    rounds: int = 5
    warmup: int = 2
    lr: float = 1e-4
    layout_optimization: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, but got {self.precision!r}")
        for name in ("plans", "rounds", "warmup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name != "rounds" else 1):
                raise ValueError(f"{name} must be an integer >= {0 if name != 'rounds' else 1}, but got {v!r}")
        for b in self.compile_budgets:
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 1:
                raise ValueError(f"compile budgets must be fractions in (0, 1], but got {b!r}")


@dataclass
class Config:
    """One configuration under test: its model, optimizer and the note for the table."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    note: str = ""
    scaler: Any = None
    times: List[float] = field(default_factory=list)


def plan_fractions(model: nn.Module, x: Tensor, n: int) -> List[float]:
    """``n`` peak budgets (fractions of eager's step peak) from the lowest any convbn plan
    reaches (predicted by :func:`convbn.explain`) up to 1, evenly spaced."""
    if n <= 0:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget of 0.01 is below the lowest: planned for the lowest
        report = explain(model, x, peak_budget=0.01, progress=False)
    low = (report.lowest_peak_bytes or 0) / max(1, report.eager_peak_bytes or 1)
    low = min(max(low, 0.01), 1.0)
    if n == 1:
        return [round(low + 0.0005, 3)]
    return [round(min(1.0, low + (1 - low) * i / (n - 1)) + (0.0005 if i == 0 else 0), 3) for i in range(n)]


def _converted(base: nn.Module, x: Tensor, kind: str, value: Optional[float]) -> nn.Module:
    model = copy.deepcopy(base).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "peak":
            return convert(model, example_inputs=x, peak_budget=value, progress=False)
        if kind == "time":
            return convert(model, example_inputs=x, time_budget=value, progress=False)
        return convert(model, example_inputs=x, progress=False)


def frontier_configs(base: nn.Module, x: Tensor, settings: FrontierSettings) -> Dict[str, Callable[[], nn.Module]]:
    """Name -> factory (untimed) of every configuration :data:`FrontierSettings` asks for, in table order."""
    out: Dict[str, Callable[[], nn.Module]] = {"eager": lambda: copy.deepcopy(base).train()}
    if settings.compile:
        out["torch.compile"] = lambda: torch.compile(copy.deepcopy(base).train())
        for b in settings.compile_budgets:
            out[f"torch.compile budget={b:g}"] = (
                lambda b=b: torch.compile(copy.deepcopy(base).train(), backend=budget_backend(b)))
    out["checkpoint per block"] = lambda: checkpoint_blocks(copy.deepcopy(base).train(), find_blocks(base))
    plans: List[Tuple[str, str, Optional[float]]] = [("convert auto", "auto", None)]
    plans += [(f"convert peak={f:g}", "peak", f) for f in plan_fractions(base, x, settings.plans)]
    plans += [(f"convert time={t:g}", "time", t) for t in settings.time_budgets]
    for name, kind, value in plans:
        out[name] = lambda kind=kind, value=value: _converted(base, x, kind, value)
        if settings.compile:
            out[f"{name} + compile"] = lambda kind=kind, value=value: torch.compile(_converted(base, x, kind, value))
    return out


def _autocast(device: torch.device, precision: str) -> ContextManager[Any]:
    dtype = PRECISIONS[precision]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _step(c: Config, x: Tensor, precision: str) -> None:
    """One training step of ``c`` (its gradients already set to None)."""
    with _autocast(x.device, precision):
        out = c.model(x)
    backward_and_step(out.float().mean(), c.optimizer, c.scaler)


def _peak(c: Config, x: Tensor, precision: str) -> int:
    """The step's peak above what is live after ``zero_grad(set_to_none=True)``."""
    c.optimizer.zero_grad(set_to_none=True)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(c, x, precision)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    return allocator_peak(lambda: _step(c, x, precision))


def _timed(c: Config, x: Tensor, precision: str) -> float:
    c.optimizer.zero_grad(set_to_none=True)
    cuda = x.device.type == "cuda"
    clock = time.thread_time if not cuda and torch.get_num_threads() == 1 else time.perf_counter
    if cuda:
        torch.cuda.synchronize()
    t = clock()
    _step(c, x, precision)
    if cuda:
        torch.cuda.synchronize()
    return clock() - t


def _build(name: str, make: Callable[[], nn.Module], x: Tensor, settings: FrontierSettings) -> Config:
    model = make()
    fp16 = settings.precision == "fp16"
    scaler = torch.amp.GradScaler(x.device.type) if fp16 else None
    report = getattr(model, "convbn_report", None) or getattr(getattr(model, "_orig_mod", None), "convbn_report", None)
    note = f"{len(report.pairs)} pairs, {report.num_chains} chains" if report is not None else ""
    return Config(name, model, torch.optim.SGD(model.parameters(), lr=settings.lr), note, scaler)


def _check_device(x: Tensor, settings: FrontierSettings) -> None:
    if settings.precision == "fp16" and x.device.type != "cuda":
        raise ValueError("precision 'fp16' (autocast float16 with GradScaler) needs a CUDA input; on CPU use 'bf16'")


def measure_points(configs: Dict[str, Callable[[], nn.Module]], x: Tensor, settings: FrontierSettings,
                   progress: Optional[Callable[[str], None]] = None) -> List[FrontierPoint]:
    """Build each configuration (untimed), warm it up, measure its step peak, then time all
    of them in interleaved rounds (the order rotated each round); the frontier marked."""
    _check_device(x, settings)
    built: List[Config] = []
    peaks: Dict[str, float] = {}
    with raise_recompile_limit(8 * len(configs) + 8), inductor_layout_optimization(settings.layout_optimization):
        for name, make in configs.items():
            if progress:
                progress(f"building and warming up {name}")
            c = _build(name, make, x, settings)
            for _ in range(settings.warmup):
                _timed(c, x, settings.precision)
            peaks[name] = _peak(c, x, settings.precision)
            built.append(c)
        for r in range(settings.rounds):
            if progress:
                progress(f"round {r + 1}/{settings.rounds}")
            k = r % len(built)
            for c in built[k:] + built[:k]:
                c.times.append(_timed(c, x, settings.precision))
    points = [FrontierPoint(c.name, float(peaks[c.name]), statistics.median(c.times), note=c.note,
                            chosen=c.name.startswith("convert time=") and not c.name.endswith("+ compile"))
              for c in built]
    return mark_frontier(points)


def run_frontier(model: nn.Module, x: Tensor, settings: FrontierSettings = FrontierSettings(),
                 progress: Optional[Callable[[str], None]] = None) -> List[FrontierPoint]:
    """The (peak, time) points of every configuration of ``model`` on input ``x`` (the model is
    not changed: each configuration trains a deep copy), the frontier marked."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"run_frontier expects an nn.Module, but got {type(model).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"run_frontier expects the input as a Tensor, but got {type(x).__name__}")
    _check_device(x, settings)
    return measure_points(frontier_configs(model, x, settings), x, settings, progress)
