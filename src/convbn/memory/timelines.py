"""The memory timeline of one training step: live bytes after every operator, with where it falls.

:func:`timeline` runs zero_grad, forward, loss, backward and the optimizer step under a
dispatch mode and records, after each operator, the live bytes (exact tensor storages on
CPU, the CUDA allocator on a GPU), the phase, the innermost module and the operator.
Its peak is convbn's one definition of a training step's peak (Note: [a step's peak]);
every figure convbn reports (``bench``, ``explain``, ``peak_budget``, the planner, the
demo, :func:`convbn.max_batch`) is measured by it.

# Note: [a step's peak]
# The step is the standard loop: ``optimizer.zero_grad(set_to_none=True)``, forward,
# loss, ``loss.backward()``, ``optimizer.step()``. Its peak is the most bytes in use during
# forward, loss, backward and the optimizer step, above what is live when the step begins
# after ``zero_grad``: parameters, buffers and optimizer state (and, when accumulating
# gradients over micro-batches, the gradients so far). Weight gradients made by the step
# count. On CPU the bytes are exact live tensor storages (``MemTracker``'s accounting,
# without its gradient hooks: Note: [a meter that does not change the step]); on CUDA the
# allocator's ``max_memory_allocated`` (cuDNN workspaces included). The memory a step
# needs in all is then ``live before + peak``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .._compat import TorchDispatchMode, current_autograd_node, mem_tracker_total, mod_tracker_of, name_module, pytree
from .allocator_meter import AllocatorCounters, AllocatorMeter, cuda_counters
from .kernel_scratch import ConvCall, NormCall, kernel_call, scratch_bytes
from .next_op import new_output_bytes
from .peaks import tensor_peak
from .saved import _with_fused

__all__ = ["PHASES", "StepOverLimit", "Timeline", "TimelinePoint", "timeline", "default_loss"]

#: the phases of one training step, in order, as :func:`timeline` records them
PHASES = ("zero_grad", "forward", "loss", "backward", "optimizer")


@dataclass(frozen=True)
class TimelinePoint:
    """Live memory right after one operator of a training step.

    Attributes:
        bytes: bytes in use above those in use when the step started (live tensor
            storages on CPU, the CUDA caching allocator's ``memory_allocated`` on GPU).
        phase: one of ``"zero_grad"``, ``"forward"``, ``"loss"``, ``"backward"``, ``"optimizer"``.
        module: innermost module running the operator (forward) or whose backward is
            running (qualified name, ``""`` outside every module).
        op: the ATen operator, prefixed in backward with the autograd node running it
            (``"ChainFunctionBackward/aten.convolution.default"``).
        node: ``id()`` of that autograd node (``0`` outside backward): tells apart the
            backwards of two nodes of one kind, e.g. ``tensor.grad_fn`` of one call.
        scratch: with ``timeline(kernel_scratch=True)``, the bytes the operator's kernel
            allocated and freed inside it on top of ``bytes`` (the table of
            :mod:`convbn.memory.kernel_scratch`); else 0.
        call: that operator's :class:`~convbn.memory.kernel_scratch.ConvCall` or ``NormCall``
            (its scratch at another batch), ``None`` where the table has no row for it.
    """

    bytes: int
    phase: str
    module: str
    op: str
    node: int = 0
    scratch: int = 0
    call: Union[ConvCall, NormCall, None] = None


@dataclass
class Timeline:
    """Live memory across one training step, one point per operator (see :func:`timeline`).

    Attributes:
        points: in execution order; a point ``0`` at the start precedes the first operator.
        source: ``"tensors"`` (exact live storages) or ``"cuda"`` (allocator).
        label: a name for plots.
        loss: the step's loss value.
    """

    points: List[TimelinePoint] = field(default_factory=list)
    source: str = "tensors"
    label: str = ""
    loss: Optional[float] = None

    @property
    def peak(self) -> int:
        """Highest bytes in use above the start (``tensor_peak``'s ``peak`` on the same step)."""
        return max((p.bytes for p in self.points), default=0)

    @property
    def process_peak(self) -> int:
        """The most of ``bytes + scratch`` over the points: the step's peak with its kernels'
        scratch (:mod:`convbn.memory.kernel_scratch`); :attr:`peak` where none was recorded."""
        return max((p.bytes + p.scratch for p in self.points), default=0)

    @property
    def peak_index(self) -> int:
        """Index of the first point at the peak."""
        peak = self.peak
        return next(i for i, p in enumerate(self.points) if p.bytes == peak) if self.points else 0

    @property
    def peak_point(self) -> TimelinePoint:
        """The first point at the peak: its phase, module and operator say where the step peaks."""
        return self.points[self.peak_index]

    def phase_peaks(self) -> Dict[str, int]:
        """Highest bytes in use within each phase that ran."""
        out: Dict[str, int] = {}
        for p in self.points:
            out[p.phase] = max(out.get(p.phase, 0), p.bytes)
        return out

    def where(self) -> str:
        """``"backward, in 'layer1.0' at ChainFunctionBackward/aten.convolution.default"``."""
        p = self.peak_point
        return f"{p.phase}, in {p.module or '<root>'!r} at {p.op}"


class StepOverLimit(RuntimeError):
    """Raised by :func:`timeline` with ``stop_above``: the step was stopped at the first
    operator whose bytes in use exceed the limit, before that operator ran where its outputs'
    sizes are known beforehand (Note: [stopping before the operator that would cross]), after
    it otherwise; what the step had made is freed as this unwinds.

    Attributes:
        bytes: bytes in use after that operator (above the step's start, as a point's):
            predicted where it was stopped before it ran; its kernel scratch added where the
            timeline counted it.
        point: that operator's :class:`TimelinePoint`.
        before: whether the operator was stopped before it ran (its outputs never existed).
    """

    def __init__(self, point: TimelinePoint, limit: int, before: bool = False) -> None:
        when = "before an operator that would have" if before else "at"
        super().__init__(f"the step was stopped {when} {point.bytes + point.scratch} bytes in use, above the limit "
                         f"of {limit} ({point.phase}, {point.op})")
        self.bytes = point.bytes + point.scratch
        self.point = point
        self.before = before


def _innermost(parents: Any) -> str:
    names = [n for n in parents if n != "Global"]
    if not names:
        return ""
    name = max(names, key=lambda n: (n.count("."), len(n)))
    return name.split(".", 1)[1] if "." in name else ""  # drop the root class name ModTracker prefixes


class _TimelineMode(TorchDispatchMode):
    """Appends a :class:`TimelinePoint` after every operator (entered above the meter)."""

    def __init__(self, read: Callable[[], int], where: Callable[[], str], stop_above: Optional[int] = None) -> None:
        super().__init__()
        self.read = read
        self.where = where
        self.stop_above = stop_above
        #: record each operator's kernel scratch and stop against ``bytes + scratch``
        self.kernel_scratch = False
        #: bytes in use now, where ``read`` is not that (CUDA: ``read`` is the peak since the
        #: last reading, and resets it); ``None``: ``read``
        self.now: Optional[Callable[[], int]] = None
        self.phase = "forward"
        self.points: List[TimelinePoint] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        call = kernel_call(func, args, kwargs) if self.kernel_scratch else None
        scratch = scratch_bytes(call)
        if self.stop_above is not None:
            self._stop_before(func, args, kwargs, scratch)
        out = func(*args, **(kwargs or {}))
        op = str(func)
        node = current_autograd_node()
        if node is not None:
            op = f"{node.name()}/{op}"
        point = TimelinePoint(self.read(), self.phase, self.where(), op, 0 if node is None else id(node), scratch, call)
        self.points.append(point)
        if self.stop_above is not None and point.bytes + scratch > self.stop_above:
            del out  # the step goes no further: nothing it made outlives the exception
            raise StepOverLimit(point, self.stop_above)
        return out

    def _stop_before(self, func: Any, args: Any, kwargs: Any, scratch: int = 0) -> None:
        """Raise :class:`StepOverLimit` before an operator whose outputs (and kernel scratch)
        would take the bytes in use over ``stop_above`` (Note: [stopping before the operator
        that would cross])."""
        new = new_output_bytes(func, args, kwargs)
        if new is None:
            return
        now = (self.now or self.read)()
        if now + new + scratch > self.stop_above:
            node = current_autograd_node()
            op = str(func) if node is None else f"{node.name()}/{func}"
            point = TimelinePoint(now + new, self.phase, self.where(), op, 0 if node is None else id(node), scratch)
            raise StepOverLimit(point, self.stop_above, before=True)


def timeline(  # over 60 lines for its public docstring (what a step is, Args, Example); the body is ~35
    model: nn.Module,
    *inputs: Any,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    label: str = "",
    accumulate: bool = False,
    stop_above: Optional[int] = None,
    kernel_scratch: bool = False,
    backward_modules: bool = True,
) -> Timeline:
    """Record live memory after every operator of one training step of ``model``.

    The step is ``optimizer.zero_grad(set_to_none=True)`` (without an optimizer: every
    parameter's ``.grad`` set to ``None``), forward ``model(*inputs)``,
    ``loss = loss_fn(output)``, ``loss.backward()`` and ``optimizer.step()``, each point
    labelled with its phase, module and operator. Bytes are above what is live once the
    gradients are set to None (parameters, buffers, optimizer state); weight gradients the
    step makes count. This is the one definition of a step's peak every figure of convbn
    uses. On CPU
    the bytes are exact live tensor storages (the same accounting as :class:`tensor_peak`,
    so ``timeline(...).peak`` equals ``tensor_peak``'s ``peak`` on the same step); on CUDA
    each point is the allocator's peak during its operator (workspaces included), read by
    resetting ``torch.cuda``'s peak statistics at every operator: a ``max_memory_allocated``
    taken around a block that records a timeline (``convert`` and ``max_batch`` with CUDA inputs
    do) sees only the end of it; :func:`~convbn.memory.allocator_peak` with ``device="cuda"``
    measures such a block whole. Bytes are relative to the start of
    the step. Recording slows the step down; do not time it.

    Args:
        model: the module to step (its current mode is used; gradients accumulate into
            ``.grad`` as in training).
        *inputs: positional inputs for ``model``.
        loss_fn: maps the model's output to a scalar loss; default the mean of the
            (first) output tensor in float32.
        optimizer: when given, its ``zero_grad``/``step`` are part of the step and its
            state counts.
        label: a name for plots (:func:`convbn.bench.timeline.plot_timelines`).
        accumulate: keep the existing gradients (a later micro-batch of gradient
            accumulation): no ``zero_grad``, backward adds into ``.grad``, and the
            gradients so far count as live before the step.
        stop_above: stop the step at the first operator whose bytes in use would exceed this
            many (above the start): :class:`StepOverLimit` is raised before that operator
            runs where its outputs' sizes are known on the meta device (the operator run there
            first), so a step that does not fit a limit never holds tensors past it; after the
            operator otherwise.
        kernel_scratch: record each convolution's kernel scratch (``TimelinePoint.scratch``,
            :attr:`Timeline.process_peak`; 0 off the CPU; the table of
            :mod:`convbn.memory.kernel_scratch`) and stop against ``bytes + scratch``;
            :attr:`Timeline.peak` stays live tensors either way.
        backward_modules: name the module whose backward runs at each backward point; ``False``:
            backward points are named ``""``, recorded without most of the gradient hooks that
            tell it (cheaper); the bytes are the same.

    Returns:
        :class:`Timeline`.

    Raises:
        StepOverLimit: with ``stop_above``, the step went over it.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        >>> tl = timeline(net, torch.randn(4, 8))
        >>> tl.peak > 0 and tl.peak_point.phase in ("forward", "loss", "backward")
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"timeline expects an nn.Module, but got {type(model).__name__}")
    if loss_fn is None:
        loss_fn = default_loss
    if stop_above is not None and (isinstance(stop_above, bool) or not isinstance(stop_above, int)):
        raise TypeError(f"stop_above must be None or an int (bytes), but got {stop_above!r}")
    meter, mode, source = _meters(model, inputs, optimizer, backward_modules)
    mode.stop_above = stop_above
    mode.kernel_scratch = bool(kernel_scratch)
    result = Timeline(source=source, label=label)
    if not accumulate:  # before the meter starts: freed gradients are not part of the step
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.grad = None
    try:
        _step(model, inputs, loss_fn, optimizer, meter, mode, result)
    except StepOverLimit:
        if mode.phase == "backward":
            _drain_autograd()  # Note: [a backward stopped part way is let go]
        raise
    result.points = mode.points
    return result


def _step(model: nn.Module, inputs: Tuple[Any, ...], loss_fn: Callable[[Any], Tensor],
          optimizer: Optional[torch.optim.Optimizer], meter: Any, mode: "_TimelineMode", result: Timeline) -> None:
    """Forward, loss, backward and the optimizer's step under ``meter`` and ``mode``."""
    with torch.enable_grad(), meter, mode:
        mode.points.append(TimelinePoint(mode.read(), "zero_grad" if optimizer is not None else "forward", "", "start"))
        mode.phase = "forward"
        out = model(*inputs)
        mode.phase = "loss"
        loss = loss_fn(out)
        del out
        mode.phase = "backward"
        loss.backward()
        result.loss = float(loss.detach())
        del loss
        if optimizer is not None:
            mode.phase = "optimizer"
            optimizer.step()


# Note: [a backward stopped part way is let go]
# A step stopped inside its backward (``StepOverLimit`` raised from an operator the engine
# runs) leaves the tasks of the nodes that were ready to run to the autograd engine on this
# thread, and through them the nodes not yet run and the tensors they saved, until the next
# backward on the thread: no Python object refers to them and a collection does not free
# them. Measured with the CPU allocator: a converted ResNet-50 (64², batch 4) stopped in a
# chain's backward kept 6.1 MB allocated after the call, freed at once by any later backward;
# at 224² and a batch near 20 that is hundreds of MiB alive beside ``max_batch``'s next probe.
# A backward of one element right after the stop lets them go.
def _drain_autograd() -> None:
    """A one-element backward, outside every mode and meter (Note: [a backward stopped part way
    is let go])."""
    t = torch.zeros((), requires_grad=True)
    (t * 1).backward()


def _meters(model: nn.Module, inputs: Tuple[Any, ...], optimizer: Optional[torch.optim.Optimizer],
            backward_modules: bool = True) -> Tuple[Any, _TimelineMode, str]:
    """The memory meter for one step of ``model`` (the CUDA allocator where the step runs on a
    GPU, else live tensor bytes), the mode recording a point per operator, and the source's name.
    Built before the step's ``zero_grad``; each meter reads its start when its block is
    entered, after it: bytes are relative to what is live then."""
    track: Tuple[Any, ...] = (model,) if optimizer is None else (model, optimizer)
    counters = _allocator_counters(model, inputs)
    if counters is not None:  # its start is read when the step's block is entered, after zero_grad
        # Note: [an allocator meter starts where the step starts]
        meter: Any = AllocatorMeter(counters, backward_modules)
        mode = _TimelineMode(meter.read, lambda: _innermost(meter.tracker.parents))
        mode.now = meter.now
        source = "cuda"
    else:
        tp = tensor_peak(*track, backward_modules=backward_modules)
        tracker = tp._tracker
        _name_fused(mod_tracker_of(tracker), model)
        mode = _TimelineMode(lambda: mem_tracker_total(tracker) - tp._start,
                             lambda: _innermost(mod_tracker_of(tracker).parents))
        meter = tp
        source = "tensors"
    return meter, mode, source


def _allocator_counters(model: nn.Module, inputs: Tuple[Any, ...]) -> Optional[AllocatorCounters]:
    """The CUDA allocator's counters where the step runs on a GPU; ``None``: the exact tensor meter."""
    for t in (*inputs, *model.parameters()):
        if isinstance(t, Tensor) and t.is_cuda:
            return cuda_counters(t.device)
    return None


def _name_fused(mod_tracker: Any, model: nn.Module) -> None:
    """Tell ``mod_tracker`` the qualified names of the unregistered modules a convbn rewrite
    added (it names modules by walking ``named_children``, which does not list them)."""
    root = type(model).__name__
    registered = {id(m) for m in model.modules()}
    for name, mod in _with_fused(model):
        if id(mod) not in registered:
            name_module(mod_tracker, mod, f"{root}.{name}")


def default_loss(out: Any) -> Tensor:
    """The loss :func:`timeline` uses without ``loss_fn``: the mean of the output's first tensor, in float32."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
    if not leaves:
        raise TypeError(f"timeline's default loss needs a tensor output, but the model returned {type(out).__name__}")
    return leaves[0].float().mean()
