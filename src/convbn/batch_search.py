"""The search behind :func:`convbn.max_batch`: steps of one copy of the model at a time, each
stopped where it goes over the limit, and the choice to confirm made from counted work.

# Note: [searching the batch]
# For a fixed plan a step's peak is the most of lines in the batch (Note: [predicting the
# batch] in batch_predict.py), but the converted model's plan is made for the batch
# (``convert(memory_limit=...)``) and changes with it. By default the answer is predicted
# (eager: the step's lines; convbn: the planner's inputs as lines, and at each batch the
# plan ``convert`` would make) from steps at batches 2 and 4, checked at 3, then confirmed
# by real steps at the answer and the batch above it (``confirm``). Where a check fails,
# and with ``method="measure"``, the search measures, never extrapolates a result: two small
# batches give a line, the line's crossing of the limit is the next probe, and every probe
# (a batch that fits raises the lower bound, one that does not lowers the upper) refits the
# line through the two nearest measured points, until the bounds are adjacent: the answer
# ``b`` was measured within the limit and ``b + 1`` above it.
#
# Note: [answering within the limit]
# The question is asked on a device that is nearly full, so answering it must not need more
# than the answer. One copy of the model and optimizer exists at a time (the user's own are
# only read): the eager side steps one warmed copy, which is dropped before the convbn side
# converts another at batch 2 (its chains' plans then set per batch, never a convert at the
# batch probed, with ``method="measure"`` too). Every step runs with ``stop_above`` (Note: [a
# step's peak]) set to the room the limit leaves after the copy's resident bytes and the
# step's batch of inputs: a batch that does not fit is stopped before the operator whose
# outputs would take the step over the limit (Note: [stopping before the operator that would
# cross]), so resident bytes, inputs and the step's live tensors never exceed the limit. Only
# ``memory_budget=`` (a saved-bytes budget, not a plan per batch) still converts a fresh copy
# at each batch it tries, whose ``convert`` check at that batch is not held to the limit.
#
# Note: [what the limit holds]
# ``memory`` holds, and the answer is the largest batch whose step fits in it: the model's
# parameters and buffers and the optimizer's state (resident between steps), the batch of
# inputs (alive before the step in a training loop, as the user's device must hold it: a batch
# whose inputs alone exceed the room is never made) and the step's peak (weight gradients
# counted), and on CPU the kernels' scratch while they run: every step is fitted and stopped
# with each convolution's and BatchNorm backward's scratch as the table of Note: [kernel
# scratch] bounds it (not tensors: no tensor meter sees it). Above ``memory`` the call
# allocates at most :data:`SMALL_ALLOCATIONS` (1 KiB, allocations no tensor meter sees) plus
# what is stated, not counted: on CUDA the workspace of an operator a step is stopped after
# (read when it has run) and what is outside the allocator (context, library handles), on CPU
# the scratch of an operator the table has no row for, and ``convert``'s check and the
# planner's steps at batches 2 and 4 (small batches, not stepped against the limit;
# ``convert``'s float64 comparison is weight-sized). Exact CPU allocator bytes over the whole
# call: within ``memory`` + 1 KiB on the strided net of tests/test_max_batch_scratch.py (the
# same call without the scratch goes over); ResNet-50 224² at 768 MiB: 758.8 MiB (BENCHMARKS.md).
# A stopped step is let go at once (the exception that stopped it is kept without its
# traceback, which held the step's frames, its batch and tensors, in a reference cycle beside
# the next step until a collection).
#
# Note: [a copy let go is freed before the next is made]
# A converted copy is held in reference cycles (its installed forwards refer to their
# modules), so dropping the last reference to it frees nothing until a collection. Wherever
# a side lets its copy go (the convbn side's prediction was off or could not be made, and the
# side is measured on a copy converted again; ``memory_budget=``'s copy per batch), the
# planner's closures and the converted copy were only unreachable, not freed, when the next
# copy was made and converted beside them (the path of a ResNet-50 224² run at 768 MiB that
# went 393.7 MiB over, with a scratch reserve since reverted; not reproduced without it).
# Every copy after the first is made after a collection, whoever let the one before go.
#
# Note: [the kernels' scratch in the convbn prediction]
# Every step is fitted and stopped with its kernels' scratch (Note: [kernel scratch] in
# memory/kernel_scratch.py; ``timeline(kernel_scratch=True)``). The eager side's prediction
# holds it exactly: each convolution's call is a line in the batch, its row chosen again at
# each batch (``StepLines.process_peak_at``). The planner's peak model counts live tensors, so
# the converted side takes a step at batch 3 planned without the scratch, reads from it which
# convolutions each chain's backward runs, and every plan after it (predicting, confirming,
# measuring) counts each chain's largest backward scratch at the batch as bytes alive beside
# that chain during its backward (its ``prefix``): a bound, since the scratch lives only while
# one convolution runs. Forward scratch and convolutions outside the chains are not in the
# plan: the confirming steps measure them; where they refute the answer, up to :data:`WALK` more
# steps walk from it (each a real step, stopped at the limit) before the side is measured.
#
# Note: [confirming by counted work]
# Whether the predicted answer is confirmed by real steps is decided from the work those
# steps would do, never from a clock: the eager step's floating-point operations are counted
# once at batch 2 (``step_flops``), scaled to the batches of the confirming steps (4/3 of
# it for the converted model, whose backward may recompute each convolution once), and
# compared with :data:`CONFIRM_FLOPS`. The same call gives the same answer, the same
# ``probes`` and the same ``how`` on an idle and on a loaded machine.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import warnings
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ._compat import mem_tracker_class
from .batch_predict import PROBE_BATCHES, StepLines, largest_fitting, step_flops
from .memory.budget import resident_bytes, usable_bytes
from .memory.kernel_scratch import scratch_bytes
from .memory.saved import _with_fused
from .memory.timelines import StepOverLimit, Timeline, TimelinePoint, default_loss, timeline
from .passes.convert.api import convert
from .passes.plan.auto_plan import apply_plan, plan_to_target
from .passes.plan.plan_inputs import PlanInputs, measure_peak, measure_plan_inputs, plan_inputs_at
from .progress import stage

__all__ = ["CONFIRM_FLOPS", "SMALL_ALLOCATIONS", "Search", "batch_of", "input_bytes", "measured_search", "young_heap"]

#: With ``confirm="auto"``, :func:`convbn.max_batch` confirms a predicted answer by real steps
#: at it and the batch above it where those two steps are counted to do at most this many
#: floating-point operations per side (Note: [confirming by counted work]). 2e12 is a training
#: step of a 224² ResNet-50 at about batch 40.
CONFIRM_FLOPS = 2e12

#: The stated constant of :func:`convbn.max_batch`'s bound: the bytes its call may allocate
#: above ``memory``, the kernels' scratch counted (Note: [what the limit holds]).
SMALL_ALLOCATIONS = 1024

#: How many batches a refuted prediction is walked, by a real step each, before the side is
#: measured instead (Note: [the kernels' scratch in the convbn prediction]).
WALK = 3

Result = Tuple[int, int, Dict[int, int], str]


def batch_of(sample: Tuple[Any, ...], b: int) -> Tuple[Any, ...]:
    """``sample``'s tensors taken to batch ``b`` along dim 0 (their rows repeated in turn)."""
    out = []
    for t in sample:
        if isinstance(t, Tensor) and t.dim() > 0:
            idx = torch.arange(b, device=t.device) % t.shape[0]
            out.append(t.index_select(0, idx))
        else:
            out.append(t)
    return tuple(out)


def measured_search(peak_at: Callable[[int], int], usable: int, upper: int,
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


def input_bytes(sample: Tuple[Any, ...], b: int) -> int:
    """Bytes of :func:`batch_of`'s ``(sample, b)``, without making it."""
    return sum(t[:1].numel() * t.element_size() * b for t in sample if isinstance(t, Tensor) and t.dim() > 0)


@contextlib.contextmanager
def young_heap() -> Iterator[None]:
    """Within the block, ``gc.collect()`` looks only at objects made in it: what existed
    before is frozen (``gc.freeze``), so freeing a copy held in reference cycles costs
    what the copy holds, not the whole interpreter's heap (1.4 s a collection in a test
    process). Left alone where the caller froze objects itself."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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


def _chain_scratch(tl: Timeline, model: nn.Module, chains: List[Any], b: int) -> Callable[[int], List[int]]:
    """Each chain's largest convolution-backward scratch at a batch ``n``, in forward order, from
    the calls a step recorded at batch ``b`` made in that chain's backward, their samples scaled
    by ``n / b`` and their rows chosen again (Note: [kernel scratch])."""
    names = {id(mod): name for name, mod in _with_fused(model)}
    keys = [names.get(id(c)) for c in chains]  # a chain without a name: no calls read as its own
    calls: Dict[str, List[Any]] = {k: [] for k in keys if k}
    for p in tl.points:
        if p.call is not None and p.call.backward and p.module in calls:
            calls[p.module].append(p.call)
    order = [calls[k] if k else [] for k in keys]

    def at(n: int) -> List[int]:
        return [max([0] + [scratch_bytes(c.at_batch(max(1, c.x_shape[0] * n // b))) for c in cs]) for cs in order]
    return at


class Search:
    """One :func:`convbn.max_batch` call: the one copy it steps at a time, the limits, and
    the two searches (eager, convbn); Note: [answering within the limit]."""

    def __init__(self, model: nn.Module, opt: Optional[torch.optim.Optimizer], inputs: Tuple[Any, ...],
                 loss_fn: Optional[Callable[[Any], Tensor]], limit: int, upper: int, device: torch.device,
                 confirm: Union[bool, str], convert_kwargs: Dict[str, Any]) -> None:
        self.model, self.opt, self.inputs, self.loss_fn = model, opt, inputs, loss_fn
        self.limit, self.usable, self.upper, self.device = limit, usable_bytes(limit, device), upper, device
        self.confirm, self.convert_kwargs = confirm, convert_kwargs
        self.held: Tuple[Any, ...] = ()
        self.last: Any = None  # the last step's Timeline, or the StepOverLimit that stopped it
        #: the converted side's chains' kernel scratch at a batch, planned around (Note: [the
        #: kernels' scratch in the convbn prediction]); the step at batch 3 that showed it
        self.chain_scratch: Callable[[int], List[int]] = lambda n: []
        self.scratch_step: Tuple[int, int, Any] = (0, 0, None)
        self.copies = 0  # copies made so far
        m, o = self.fresh()
        self.resident = resident_bytes(m, o)
        self.state = self.resident - resident_bytes(m)  # optimizer state: not known to convert
        self.flops: Optional[int] = None  # the eager step's at batch 2, counted once
        # the exact meter's module (and the Dynamo it imports) loaded here, not inside the first
        # step: that import leaves the frames below it in a reference cycle, which kept the first
        # probe's batch alive until the next garbage collection
        if device.type == "cpu":
            mem_tracker_class()

    def fresh(self) -> Tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        """A new copy of the model and optimizer (the one before it dropped first), in training
        mode, the optimizer's state made by one warm-up step at batch 2."""
        if self.copies:  # Note: [a copy let go is freed before the next is made]
            self.held = ()
            gc.collect()
        self.copies += 1
        m, o = copy.deepcopy((self.model, self.opt))  # the copied optimizer refers to the copy's parameters
        m.train()
        if o is not None:
            stage("a warm-up step (the optimizer's state)")
            _warm_up(m, o, batch_of(self.inputs, 2), self.loss_fn)
        self.held = (m, o)
        return m, o

    def let_go(self) -> None:
        """Free the copy held now (it may be held in reference cycles: a collection)."""
        self.held = ()
        gc.collect()

    def step(self, m: nn.Module, o: Optional[torch.optim.Optimizer], b: int, planned: bool = False) -> Any:
        """A recorded step at batch ``b`` (:func:`timeline`; ``planned``: ``measure_peak``, the
        converted copy's state put back), stopped above the limit (Note: [answering within the
        limit]): its :class:`Timeline`, or the :class:`StepOverLimit` that stopped it."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        room = self.usable - self.before(b)  # the batch's inputs are in the limit (Note: [what the limit holds])
        if room < 0:  # the batch alone is over: never made, no step (``before(b)`` alone is over the limit)
            return StepOverLimit(TimelinePoint(0, "forward", "", "the batch of inputs"), room, before=True)
        x = batch_of(self.inputs, b)
        try:  # the kernels' scratch counted and stopped at (Note: [kernel scratch])
            if planned:
                return measure_peak(m, x, optimizer=o, loss_fn=self.loss_fn, stop_above=room, kernel_scratch=True)
            return timeline(m, *x, optimizer=o, loss_fn=self.loss_fn, stop_above=room, kernel_scratch=True)
        except StepOverLimit as over:
            # without its traceback: it holds this frame (``x``) and the stopped step's frames (its
            # tensors) in a reference cycle with ``over``, alive beside the next step until a
            # collection (Note: [what the limit holds])
            return over.with_traceback(None)

    def before(self, b: int) -> int:
        """What is live before a step at batch ``b``: ``resident`` and the batch of inputs."""
        return self.resident + input_bytes(self.inputs, b)

    def total(self, m: nn.Module, o: Optional[torch.optim.Optimizer], b: int, planned: bool = False) -> int:
        """:meth:`before` + the step's peak at ``b`` with its kernels' scratch (+ the bytes where it
        was stopped, over the limit); the step's outcome kept as :attr:`last`."""
        self.last = out = self.step(m, o, b, planned)
        return self.before(b) + (out.bytes if isinstance(out, StepOverLimit) else out.process_peak)

    # ------------------------------------------------------------------ measured probes
    def eager(self, b: int) -> int:
        """``resident + inputs + peak`` of a real eager step at batch ``b`` (of the one eager copy)."""
        stage(f"eager: a step at batch {b}")
        m, o = self.held or self.fresh()  # the eager side runs first: the copy held is unconverted
        return self.total(m, o, b)

    def fused(self, b: int) -> int:
        """``resident + inputs + peak`` of a real step of a fresh copy converted for batch ``b``
        (``memory_budget`` given, or no pair converted: no per-batch plan to hold it to the limit)."""
        stage(f"convbn: converting for batch {b} and a step")
        m, o = self.fresh()
        x = batch_of(self.inputs, b)
        with warnings.catch_warnings():  # a batch no plan fits warns: here it is only a probe
            warnings.simplefilter("ignore")
            m = convert(m, example_inputs=x, memory_limit=max(1, self.limit - self.state - input_bytes(self.inputs, b)),
                        **self.convert_kwargs)
        return self.total(m, o, b)

    def measured(self, side: str, seen: Optional[Dict[int, int]] = None, why: str = "",
                 probe: Optional[Callable[[int], int]] = None) -> Result:
        """The measuring search (Note: [searching the batch]) with ``probe`` (default: eager's
        steps, or the converted side's planned copy, or a copy converted at each batch)."""
        if probe is None and side == "convbn":
            planner = self._planner()
            probe = self.fused if isinstance(planner, str) else planner[1]
            if not isinstance(planner, str) and planner[0] is not None:
                why = why or (f", the plan at each batch the planner's from batches {PROBE_BATCHES[0]} and "
                              f"{PROBE_BATCHES[1]}")
                seen = {PROBE_BATCHES[2]: self.scratch_step[1], **(seen or {})}  # Search._learn_scratch's step
        b, total, seen = measured_search(probe or self.eager, self.usable, self.upper, seen)
        return b, total, seen, f"measured at batch {b} and the batch above it{why}"

    # ------------------------------------------------------------------ predictions
    def affordable(self, side: str, b: int) -> Tuple[bool, float]:
        """Whether to confirm ``b`` by steps at ``b`` and ``b + 1`` (``confirm``), and the work
        counted for them (Note: [confirming by counted work])."""
        if self.flops is None:
            m, _ = self.held or self.fresh()
            self.flops = step_flops(m, batch_of(self.inputs, 2), self.loss_fn)
        work = self.flops / 2 * (2 * b + 1) * (4 / 3 if side == "convbn" else 1)
        return (work <= CONFIRM_FLOPS if self.confirm == "auto" else bool(self.confirm)), work

    def confirmed(self, side: str, b: int, predicted: int, seen: Dict[int, int], how: str,
                  probe: Callable[[int], int]) -> Union[Result, str]:
        """Confirm a predicted answer ``b`` by real steps at ``b`` and ``b + 1`` (``probe``)
        where ``confirm`` says so; where they disagree with it, or ``b`` is within the small
        batches, why the side is to be measured instead (the caller measures)."""
        if b <= PROBE_BATCHES[1]:  # within the measured batches: measuring is cheap and exact
            return ""
        ok, work = self.affordable(side, b)
        if not ok:
            stage(f"{side}: batch {b} predicted; not confirmed (steps at {b} and {b + 1}: {work / 1e12:.2g} TFLOP)")
            return b, predicted, seen, how + (f"; not confirmed by steps at that batch ({work / 1e12:.2g} TFLOP, "
                                              f"above confirm='auto''s {CONFIRM_FLOPS / 1e12:g})"
                                              if self.confirm == "auto" else "; not confirmed (confirm=False)")
        stage(f"{side}: batch {b} predicted; confirming with steps at {b} and {b + 1}")
        for c in (b, b + 1) if b < self.upper else (b,):
            seen[c] = probe(c)
        if seen[b] <= self.usable and (b == self.upper or seen[b + 1] > self.usable):
            return b, seen[b], seen, f"measured at batch {b} and the batch above it (predicted alike)"
        return self._walk(side, b, seen, probe)

    def _walk(self, side: str, b: int, seen: Dict[int, int], probe: Callable[[int], int]) -> Union[Result, str]:
        """A predicted ``b`` that real steps refuted, walked by :data:`WALK` batches at most
        towards the steps' answer (Note: [the kernels' scratch in the convbn prediction]); where
        that does not settle it, why the side is to be measured (the caller measures)."""
        down = seen[b] > self.usable
        for k in range(1, WALK + 1):
            c = b - k if down else b + 1 + k
            if c <= PROBE_BATCHES[1] or c > self.upper:
                break
            stage(f"{side}: batch {b} predicted, off; a step at {c}")
            seen[c] = probe(c)
            if down and seen[c] <= self.usable:
                return c, seen[c], seen, f"measured at batch {c} and the batch above it (predicted {b})"
            if not down and seen[c] > self.usable:
                return c - 1, seen[c - 1], seen, f"measured at batch {c - 1} and the batch above it (predicted {b})"
        return " (the prediction was off)"

    def eager_predicted(self) -> Result:
        seen: Dict[int, int] = {}
        tls: Dict[int, Timeline] = {}
        m, o = self.held or self.fresh()
        for b in PROBE_BATCHES:
            stage(f"eager: a recorded step at batch {b}")
            out = self.step(m, o, b)
            seen[b] = self.before(b) + (out.bytes if isinstance(out, StepOverLimit) else out.process_peak)
            if isinstance(out, StepOverLimit):
                return self.measured("eager", seen, f" (batch {b} is over the limit)")
            tls[b] = out
        b1, b2, b3 = PROBE_BATCHES
        try:
            lines = StepLines(tls[b1], b1, tls[b2], b2)
        except ValueError:
            return self.measured("eager", seen, " (the step's memory is not a line in the batch)")
        if not lines.agrees(tls[b3], b3):
            return self.measured("eager", seen, f" (the step at batch {b3} is off the line)")
        b = largest_fitting(lambda n: self.before(n) + lines.process_peak_at(n) <= self.usable, self.upper)
        how = f"predicted from steps at batches {b1} and {b2} (exact at {b3})"
        out = self.confirmed("eager", b, self.before(b) + lines.process_peak_at(b), seen, how,
                             lambda c: self.total(m, o, c))
        return self.measured("eager", seen, out) if isinstance(out, str) else out

    def fused_predicted(self) -> Result:
        """The convbn side predicted (Note: [searching the batch]); where the prediction cannot
        be made or checked, measured, the converted copy dropped first."""
        out = self._fused_prediction()
        if isinstance(out, str):
            self.held = ()
            return self.measured("convbn", None, out)
        return out

    def _planner(self) -> Union[Tuple[Optional[Callable[[int], Any]], Callable[[int], int]], str]:
        """A fresh copy converted at batch 2, the chains' planner inputs measured at batches 2
        and 4: ``(plan_at, planned)``, the plan ``convert(memory_limit=...)`` makes at a batch
        (the inputs are lines in the batch; ``None`` where no pair was converted) and
        ``resident + inputs + peak`` of a real step of the copy planned so. Every later step is this copy's, stopped above the limit (Note: [answering
        within the limit]). Where ``memory_budget`` is given or the inputs are not lines in the
        batch, why not (the caller converts a copy at each batch)."""
        b1, b2, _ = PROBE_BATCHES
        stage(f"convbn: converting at batch {b1}")
        m, o = self.fresh()  # the eager copy dropped: one side at a time
        with warnings.catch_warnings():  # the chains and layers only: their modes are planned below
            warnings.simplefilter("ignore")
            conv = convert(m, example_inputs=batch_of(self.inputs, b1),
                           **{**self.convert_kwargs, "strategy": "recompute_conv"})
        if self.convert_kwargs.get("memory_budget") is not None:
            self.held = ()
            return ""
        if not conv.convbn_report.pairs:  # nothing planned per batch: this copy is stepped at every batch
            return None, lambda n: self.total(conv, o, n)
        measured: Dict[int, PlanInputs] = {}
        chains: List[Any] = []
        for b in (b1, b2):
            stage(f"convbn: measuring the chains at batch {b}")
            chains, measured[b] = measure_plan_inputs(conv, batch_of(self.inputs, b), optimizer=o, loss_fn=self.loss_fn)
        target = usable_bytes(max(1, self.limit - self.state), self.device) - resident_bytes(conv)

        def plan_at(n: int) -> Any:
            p = plan_inputs_at(measured[b1], measured[b2], n)
            costs = p.costs()
            scratch = self.chain_scratch(n)  # alive beside the chain in its backward, planned around
            if len(scratch) == len(costs):
                costs = [replace(c, prefix=c.prefix + extra) for c, extra in zip(costs, scratch)]
            return plan_to_target(costs, p.floor, p.extra, target - input_bytes(self.inputs, n), p.gaps())

        def planned(n: int) -> int:  # a real step at n of the copy planned for n as predicted
            plan = plan_at(n)
            apply_plan(chains, plan.keeps, plan.may_drop)
            return self.total(conv, o, n, planned=True)

        try:
            plan_at(PROBE_BATCHES[2])
        except ValueError:
            self.held = ()
            return " (the planner's inputs are not lines in the batch)"
        self._learn_scratch(plan_at, planned, conv, chains)
        return plan_at, planned

    def _learn_scratch(self, plan_at: Callable[[int], Any], planned: Callable[[int], int], conv: nn.Module,
                       chains: List[Any]) -> None:
        """A real step at batch 3 planned without the kernels' scratch, kept as
        :attr:`scratch_step` (its plan's predicted peak, its total, its timeline), and from it
        :attr:`chain_scratch`, which every later plan counts (Note: [the kernels' scratch in the
        convbn prediction])."""
        b3 = PROBE_BATCHES[2]
        stage(f"convbn: a recorded step at batch {b3}, planned as predicted")
        self.chain_scratch = lambda n: []
        predicted = plan_at(b3).peak
        self.scratch_step = (predicted, planned(b3), self.last)
        if not isinstance(self.last, StepOverLimit):
            self.chain_scratch = _chain_scratch(self.last, conv, chains, b3)

    def _fused_prediction(self) -> Union[Result, str]:
        _, _, b3 = PROBE_BATCHES
        planner = self._planner()
        if isinstance(planner, str):
            return planner
        plan_at, planned = planner
        if plan_at is None:
            return ""
        predicted, total, step = self.scratch_step  # planned without the scratch (Search._learn_scratch)
        seen = {b3: total}
        if isinstance(step, StepOverLimit) or step.peak != predicted:
            return f" (the predicted peak at batch {b3} is off)"

        def total_at(n: int) -> int:  # Note: [the kernels' scratch in the convbn prediction]
            return self.before(n) + plan_at(n).peak

        b = largest_fitting(lambda n: total_at(n) <= self.usable, self.upper)
        how = (f"predicted from the planner's inputs at batches {PROBE_BATCHES[0]} and {PROBE_BATCHES[1]} "
               f"(exact at {b3}; the kernels' scratch estimated from that step)")
        return self.confirmed("convbn", b, total_at(b) if b else 0, seen, how, planned)
