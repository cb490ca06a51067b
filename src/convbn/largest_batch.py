"""The largest batch that trains within a memory limit, for eager and for ``convbn.convert``.

:func:`max_batch` answers "will it fit?" before a run: it steps copies of the model (the
standard loop, see Note: [a step's peak] in ``memory/timelines.py``) at candidate batch
sizes and reports the largest whose ``resident + peak`` stays within the limit, eager's and
the converted model's, each with the peak it measured at that batch.

# Note: [searching the batch]
# For a fixed plan a step's peak is the most of lines in the batch (Note: [predicting the
# batch] in batch_predict.py), but the converted model's plan is made for the batch
# (``convert(memory_limit=...)``) and changes with it. By default the answer is predicted
# (eager: the step's lines; convbn: the planner's inputs as lines, and at each batch the
# plan ``convert`` would make) from steps at batches 2 and 4, checked at 3, then confirmed
# by real steps at the answer and the batch above it where they are affordable. Where a
# check fails, and with ``method="measure"``, the search measures, never extrapolates a
# result: two small batches give a line, the line's crossing of the limit is the next
# probe, and every probe (a batch that fits raises the lower bound, one that does not
# lowers the upper) refits the line through the two nearest measured points, until the
# bounds are adjacent: the answer ``b`` was measured within the limit and ``b + 1`` above it.
"""
from __future__ import annotations

import copy
import inspect
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple

import torch
from torch import Tensor, nn

from .batch_predict import PROBE_BATCHES, StepLines, largest_fitting, step_seconds
from .memory import Timeline, timeline
from .memory.timelines import default_loss
from .memory.budget import parse_memory, resident_bytes, usable_bytes
from .memory.saved import format_bytes
from .passes.check.validate import as_args
from .passes.convert.api import check_args, convert
from .passes.plan.auto_plan import apply_plan, plan_to_target
from .passes.plan.plan_inputs import PlanInputs, measure_peak, measure_plan_inputs, plan_inputs_at
from .progress import check_progress, progress_scope, stage
from .functional.deprecation import renamed_kwargs

__all__ = ["BatchFit", "max_batch", "CONFIRM_SECONDS"]

#: With ``confirm=None``, :func:`max_batch` confirms a predicted answer by real steps at it
#: and the batch above it where those are estimated (from the small steps' times) to take
#: at most this many seconds per side.
CONFIRM_SECONDS = 20.0


@dataclass
class BatchFit:
    """What :func:`max_batch` found.

    Attributes:
        memory: the limit, bytes.
        usable: bytes the step's tensors may use (the limit, less the CUDA margin).
        resident: parameters, buffers and optimizer state, bytes (alive between steps).
        eager_batch / convbn_batch: the largest batch that trains within the limit (0: not
            even one sample).
        eager_peak / convbn_peak: the step's peak at that batch, above ``resident``
            (as :func:`convbn.timeline` measures it); ``resident + peak <= usable``.
        probes: ``{"eager": {batch: peak}, "convbn": {batch: peak}}``, every batch whose
            step was measured as trained (for convbn: converted for that batch).
        device: where it was measured.
        how: ``{"eager": ..., "convbn": ...}``: how each answer was found: measured at the
            answer and the batch above it, or predicted from steps at small batches.
    """

    memory: int
    usable: int
    resident: int
    eager_batch: int = 0
    eager_peak: int = 0
    convbn_batch: int = 0
    convbn_peak: int = 0
    probes: Dict[str, Dict[int, int]] = field(default_factory=dict)
    device: str = "cpu"
    how: Dict[str, str] = field(default_factory=dict)

    @property
    def gain(self) -> float:
        """``convbn_batch / eager_batch`` (``inf`` where eager fits no batch)."""
        return self.convbn_batch / self.eager_batch if self.eager_batch else float("inf")

    def summary(self) -> str:
        """``"in 16.0 GiB: eager trains batch 96, convbn batch 210 (2.19x)"``."""
        return (f"in {format_bytes(self.memory)}: eager trains batch {self.eager_batch}, "
                f"convbn batch {self.convbn_batch} ({self.gain:.2f}x)")

    def __str__(self) -> str:
        return (f"{self.summary()}\n  resident (parameters, buffers, optimizer state) {format_bytes(self.resident)}; "
                f"step peak at those batches: eager {format_bytes(self.eager_peak)}, convbn "
                f"{format_bytes(self.convbn_peak)}; usable {format_bytes(self.usable)} on {self.device}"
                + "".join(f"\n  {side}: {how}" for side, how in self.how.items()))


def _batch_of(sample: Tuple[Any, ...], b: int) -> Tuple[Any, ...]:
    """``sample``'s tensors taken to batch ``b`` along dim 0 (their rows repeated in turn)."""
    out = []
    for t in sample:
        if isinstance(t, Tensor) and t.dim() > 0:
            idx = torch.arange(b, device=t.device) % t.shape[0]
            out.append(t.index_select(0, idx))
        else:
            out.append(t)
    return tuple(out)


def _search(peak_at: Callable[[int], int], usable: int, upper: int,
            seen: Optional[Dict[int, int]] = None) -> Tuple[int, int, Dict[int, int]]:
    """The largest batch ``b <= upper`` with ``peak_at(b) <= usable``, by measurement (Note:
    [searching the batch]); ``(b, peak_at(b), probes)``, ``(0, 0, probes)`` where batch 1 does
    not fit. ``seen``: batches measured already (``peak_at`` of each)."""
    seen = {} if seen is None else seen

    def probe(b: int) -> int:
        if b not in seen:
            seen[b] = peak_at(b)
        return seen[b]

    lo, hi = 0, upper + 1  # lo fits (0: nothing yet), hi does not
    for b in (2, 4):  # BatchNorm needs more than one value per channel: start from 2
        if b >= hi:
            break
        if probe(b) <= usable:
            lo = b
        else:
            hi = b
            break
    if lo == 0 and hi == 2:  # 2 does not fit: maybe 1 does (BatchNorm permitting)
        try:
            if probe(1) <= usable:
                lo = 1
        except ValueError:
            pass
        return (lo, seen.get(lo, 0), seen)
    while hi - lo > 1:
        pts = sorted(seen.items(), key=lambda kv: abs(kv[0] - (lo + hi) / 2))[:2]
        (b1, p1), (b2, p2) = sorted(pts)
        slope = (p2 - p1) / (b2 - b1) if b2 != b1 else 0.0
        guess = b2 + (usable - p2) / slope if slope > 0 else 2 * lo
        nxt = int(min(max(guess, lo + 1), hi - 1))
        if hi > upper and nxt >= upper:
            nxt = upper
        if probe(nxt) <= usable:
            lo = nxt
        else:
            hi = nxt
        if lo == upper:
            break
    return lo, seen.get(lo, 0), seen


class _Search:
    """One :func:`max_batch` call's copies and limits, and the two searches (eager, convbn)."""

    def __init__(self, base: nn.Module, opt: Optional[torch.optim.Optimizer], inputs: Tuple[Any, ...],
                 loss_fn: Optional[Callable[[Any], Tensor]], limit: int, usable: int, upper: int,
                 device: torch.device, confirm: Optional[bool], convert_kwargs: Dict[str, Any]) -> None:
        self.base, self.opt, self.inputs, self.loss_fn = base, opt, inputs, loss_fn
        self.limit, self.usable, self.upper, self.device = limit, usable, upper, device
        self.confirm, self.convert_kwargs = confirm, convert_kwargs
        self.resident = resident_bytes(base, opt)
        self.state = self.resident - resident_bytes(base)  # optimizer state: not known to convert

    # ------------------------------------------------------------------ measured probes
    def step(self, m: nn.Module, o: Optional[torch.optim.Optimizer], b: int) -> Timeline:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return timeline(m, *_batch_of(self.inputs, b), loss_fn=self.loss_fn, optimizer=o)

    def eager(self, b: int) -> int:
        """``resident + peak`` of a real eager step at batch ``b``."""
        stage(f"eager: a step at batch {b}")
        m, o = copy.deepcopy((self.base, self.opt))
        return self.resident + self.step(m, o, b).peak

    def fused(self, b: int) -> int:
        """``resident + peak`` of a real step of the model converted for batch ``b``."""
        stage(f"convbn: converting for batch {b} and a step")
        m, o = copy.deepcopy((self.base, self.opt))
        x = _batch_of(self.inputs, b)
        with warnings.catch_warnings():  # a batch no plan fits warns: here it is only a probe
            warnings.simplefilter("ignore")
            m = convert(m, example_inputs=x, memory_limit=max(1, self.limit - self.state), **self.convert_kwargs)
        return self.resident + self.step(m, o, b).peak

    def measured(self, side: str, seen: Optional[Dict[int, int]] = None, why: str = "") -> Tuple[int, int, Dict[int, int], str]:
        probe = self.eager if side == "eager" else self.fused
        b, total, seen = _search(probe, self.usable, self.upper, seen)
        return b, total, seen, f"measured at batch {b} and the batch above it{why}"

    # ------------------------------------------------------------------ predictions
    def _confirmed(self, side: str, b: int, predicted: int, seconds: float, seen: Dict[int, int],
                   how: str) -> Tuple[int, int, Dict[int, int], str]:
        """Confirm a predicted answer ``b`` by real steps at ``b`` and ``b + 1`` where
        affordable; measure instead where they disagree with it."""
        if b <= PROBE_BATCHES[1]:  # within the measured batches: measuring is cheap and exact
            return self.measured(side, seen if side == "eager" else None)
        if not (self.confirm if self.confirm is not None else seconds <= CONFIRM_SECONDS):
            stage(f"{side}: batch {b} predicted; not confirmed (a step there would take about {seconds:.0f} s)")
            return b, predicted, seen, how + "; not confirmed by a step at that batch (too slow here)"
        stage(f"{side}: batch {b} predicted; confirming with steps at {b} and {b + 1}")
        probe = self.eager if side == "eager" else self.fused
        for c in (b, b + 1) if b < self.upper else (b,):
            seen[c] = probe(c)
        if seen[b] <= self.usable and (b == self.upper or seen[b + 1] > self.usable):
            return b, seen[b], seen, f"measured at batch {b} and the batch above it (predicted alike)"
        return self.measured(side, seen if side == "eager" else None, " (the prediction was off)")

    def eager_predicted(self) -> Tuple[int, int, Dict[int, int], str]:
        seen: Dict[int, int] = {}
        tls: Dict[int, Timeline] = {}
        times = []
        for b in PROBE_BATCHES:
            stage(f"eager: a recorded step at batch {b}")
            m, o = copy.deepcopy((self.base, self.opt))
            t = time.perf_counter()
            tls[b] = self.step(m, o, b)
            times.append((b, time.perf_counter() - t))
            seen[b] = self.resident + tls[b].peak
        b1, b2, b3 = PROBE_BATCHES
        try:
            lines = StepLines(tls[b1], b1, tls[b2], b2)
        except ValueError:
            return self.measured("eager", seen, " (the step's memory is not a line in the batch)")
        if not lines.agrees(tls[b3], b3):
            return self.measured("eager", seen, f" (the step at batch {b3} is off the line)")
        b = largest_fitting(lambda n: self.resident + lines.peak_at(n) <= self.usable, self.upper)
        how = f"predicted from steps at batches {b1} and {b2} (exact at {b3})"
        return self._confirmed("eager", b, self.resident + lines.peak_at(b), 2 * step_seconds(times, b + 1), seen, how)

    def fused_predicted(self) -> Tuple[int, int, Dict[int, int], str]:
        b1, b2, b3 = PROBE_BATCHES
        stage(f"convbn: converting at batch {b1}")
        m, o = copy.deepcopy((self.base, self.opt))
        t = time.perf_counter()
        with warnings.catch_warnings():  # the chains and layers only: their modes are planned below
            warnings.simplefilter("ignore")
            conv = convert(m, example_inputs=_batch_of(self.inputs, b1),
                           **{**self.convert_kwargs, "strategy": "recompute_conv"})
        t_convert = time.perf_counter() - t
        if not conv.convbn_report.pairs or self.convert_kwargs.get("memory_budget") is not None:
            return self.measured("convbn")
        measured: Dict[int, PlanInputs] = {}
        times = []
        chains: List[Any] = []
        for b in (b1, b2):
            stage(f"convbn: measuring the chains at batch {b}")
            t = time.perf_counter()
            chains, measured[b] = measure_plan_inputs(conv, _batch_of(self.inputs, b), optimizer=o, loss_fn=self.loss_fn)
            times.append((b, time.perf_counter() - t))
        target = usable_bytes(max(1, self.limit - self.state), self.device) - resident_bytes(self.base)

        def plan_at(n: int) -> Any:
            p = plan_inputs_at(measured[b1], measured[b2], n)
            return plan_to_target(p.costs(), p.floor, p.extra, target, p.gaps())

        try:
            plan = plan_at(b3)
        except ValueError:
            return self.measured("convbn", None, " (the planner's inputs are not lines in the batch)")
        # the whole prediction at b3: the plan convert makes there, stepped for real
        stage(f"convbn: a recorded step at batch {b3}, planned as predicted")
        apply_plan(chains, plan.keeps, plan.may_drop)
        seen = {b3: self.resident + measure_peak(conv, _batch_of(self.inputs, b3), optimizer=o, loss_fn=self.loss_fn).peak}
        if seen[b3] != self.resident + plan.peak:
            return self.measured("convbn", None, f" (the predicted peak at batch {b3} is off)")
        b = largest_fitting(lambda n: self.resident + plan_at(n).peak <= self.usable, self.upper)
        how = f"predicted from the planner's inputs at batches {b1} and {b2} (exact at {b3})"
        seconds = 2 * (t_convert + 8 * step_seconds(times, b + 1))
        return self._confirmed("convbn", b, self.resident + plan_at(b).peak if b else 0, seconds, seen, how)


def _warm_up(model: nn.Module, opt: torch.optim.Optimizer, inputs: Tuple[Any, ...],
             loss_fn: Optional[Callable[[Any], Tensor]]) -> None:
    """One unrecorded training step (the optimizer's state made), gradients set to None after."""
    opt.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = model(*inputs)
        (default_loss(out) if loss_fn is None else loss_fn(out)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = None


def _check_convert_kwargs(model: nn.Module, inputs: Tuple[Any, ...], limit: int, kwargs: Dict[str, Any]) -> None:
    """The arguments ``max_batch`` passes on to :func:`convert`, checked before any work."""
    own = sorted({"example_inputs", "memory_limit", "inplace", "progress"} & set(kwargs))
    if own:
        raise TypeError(f"max_batch sets {', '.join(own)} of convert itself; do not pass {own[0]}")
    try:
        inspect.signature(convert).bind(model, **kwargs)
    except TypeError as err:
        raise TypeError(f"max_batch passes its other keyword arguments to convbn.convert, which says: {err}") from None
    check_args(model, kwargs.get("strategy", "auto"), kwargs.get("memory_budget"), inputs,
               kwargs.get("peak_budget"), limit)


@renamed_kwargs(sample="example_inputs")
def max_batch(  # over 60 lines for its public docstring (Args, Raises, Example); the body is ~40
    model: nn.Module,
    example_inputs: Any,
    memory: Any,
    *,
    optimizer: Optional[torch.optim.Optimizer] = None,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    upper: int = 1 << 16,
    method: Literal["predict", "measure"] = "predict",
    confirm: Optional[bool] = None,
    progress: Optional[bool] = None,
    **convert_kwargs: Any,
) -> BatchFit:
    """The largest batch that trains within ``memory``, eager and converted.

    A training step needs the resident bytes (parameters, buffers, optimizer state) plus
    its peak (the standard loop, gradients set to None first, weight gradients counted, as
    :func:`convbn.timeline` measures it). Copies of ``model`` (and of ``optimizer``, one
    warm-up step made so its state exists) take real steps at small batches (2, 4 and 3);
    the answer is predicted from them exactly where a step's memory is a line in the batch,
    which the step at 3 checks, and confirmed by real steps at the answer and the batch above
    it where that is affordable (``how`` says which). The converted model is planned for each
    batch within the limit as ``convert(memory_limit=...)`` plans it. ``model`` and
    ``optimizer`` are not changed. On CPU the peaks are exact live tensor bytes; on CUDA the
    allocator's peak (cuDNN workspaces included) against the limit less a 10 % margin for
    allocator fragmentation (not yet verified on a GPU).

    Args:
        model: the model, on the device to train on.
        example_inputs: an input batch (a tensor, or a tuple of the model's positional
            inputs), any batch size: batches are built by repeating its rows along dim 0
            (``sample=``, its old name, is deprecated).
        memory: the memory available for training on the device: bytes, or text such as
            ``"16GiB"`` or ``"512 MiB"`` (:func:`convbn.memory.parse_memory`).
        optimizer: the optimizer to be used, built on ``model``'s parameters (its state
            counts as resident); ``None``: no optimizer step, no state.
        loss_fn: maps the output to a scalar loss (default: mean of the first output).
        upper: the largest batch tried.
        method: ``"predict"`` (default: small steps, a prediction, confirmed where
            affordable) or ``"measure"`` (real steps at every batch the search tries: slow
            on large batches, the reference the prediction is tested against).
        confirm: with ``"predict"``, confirm the answer by real steps at it and the batch
            above it: ``None`` where they should take at most 20 seconds each
            side, ``True`` always, ``False`` never. ``BatchFit.how`` says which was done.
        progress: print a line per stage on stderr: ``None`` where stderr is a terminal.
        **convert_kwargs: passed to :func:`convbn.convert` (e.g. ``chain=False``).

    Returns:
        :class:`BatchFit`; ``str()`` of it, or ``.summary()``, reads
        "in 16.0 GiB: eager trains batch A, convbn batch B".

    Raises:
        TypeError: ``model`` is not a module, ``optimizer`` not an optimizer, ``loss_fn`` not
            callable, ``memory`` neither a number nor a string, a keyword ``convert`` does not take.
        ValueError: ``memory`` not positive or not readable, ``upper < 1``, an unknown
            ``method``, ``convert_kwargs`` ``convert`` would refuse.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> fit = max_batch(net, torch.randn(2, 3, 16, 16), "2MiB")
        >>> fit.convbn_batch >= fit.eager_batch > 0
        True
    """
    limit, inputs = _check_arguments(model, example_inputs, memory, optimizer, loss_fn, upper, method, confirm, progress)
    _check_convert_kwargs(model, inputs, limit, convert_kwargs)
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    usable = usable_bytes(limit, device)
    with progress_scope("max_batch", progress):
        # the copies: the optimizer copied with the model keeps referring to the copy's parameters
        base, opt = copy.deepcopy((model, optimizer))
        base.train()
        if opt is not None:  # one warm-up step: its state (momentum, Adam moments) exists from here on
            stage("a warm-up step (the optimizer's state)")
            _warm_up(base, opt, _batch_of(inputs, 2), loss_fn)
        search = _Search(base, opt, inputs, loss_fn, limit, usable, upper, device, confirm, convert_kwargs)
        fit = BatchFit(memory=limit, usable=usable, resident=search.resident, device=str(device))
        if method == "measure":
            eager, fused = search.measured("eager"), search.measured("convbn")
        else:
            eager, fused = search.eager_predicted(), search.fused_predicted()
        stage(f"eager batch {eager[0]}, convbn batch {fused[0]}")
    resident = search.resident
    fit.eager_batch, e_total, e_probes, fit.how["eager"] = eager
    fit.convbn_batch, c_total, c_probes, fit.how["convbn"] = fused
    fit.eager_peak = e_total - resident if fit.eager_batch else 0
    fit.convbn_peak = c_total - resident if fit.convbn_batch else 0
    fit.probes = {"eager": {b: p - resident for b, p in sorted(e_probes.items())},
                  "convbn": {b: p - resident for b, p in sorted(c_probes.items())}}
    return fit


def _check_arguments(model: Any, example_inputs: Any, memory: Any, optimizer: Any, loss_fn: Any, upper: Any, method: Any,
                     confirm: Any, progress: Any) -> Tuple[int, Tuple[Any, ...]]:
    """:func:`max_batch`'s arguments checked before any work; returns the limit in bytes and
    ``example_inputs`` as a tuple of positional inputs."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"max_batch expects an nn.Module, but got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, but got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output -> scalar loss), but got {type(loss_fn).__name__}")
    if isinstance(upper, bool) or not isinstance(upper, int) or upper < 1:
        raise ValueError(f"upper must be a positive int, but got {upper!r}")
    if method not in ("predict", "measure"):
        raise ValueError(f"method must be 'predict' or 'measure', but got {method!r}")
    if confirm is not None and not isinstance(confirm, bool):
        raise TypeError(f"confirm must be None, True or False, but got {confirm!r}")
    check_progress(progress)
    limit = parse_memory(memory)
    inputs = as_args(example_inputs, "example_inputs")
    if not any(isinstance(t, Tensor) and t.dim() > 0 for t in inputs):
        raise TypeError("example_inputs must be a tensor or a tuple of inputs with at least one batched tensor, "
                        f"but got {type(example_inputs).__name__}")
    return limit, inputs
