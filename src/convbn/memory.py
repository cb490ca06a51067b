"""Measuring what a model keeps for backward, and how much memory a step peaks at.

*Saved bytes* (SPEC §3) is the primary, deterministic memory metric: after one forward
pass in training mode, the total size of the distinct storages autograd holds for
backward, found with :func:`torch.autograd.graph.saved_tensors_hooks` and de-duplicated
by storage. A view keeps its whole storage alive, so it counts the whole storage.
Parameters count too.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from .nn.fused import OBSERVER_ATTR

__all__ = [
    "SavedBytes",
    "saved_bytes",
    "track_saved",
    "peak_memory",
    "tensor_peak",
    "PeakMemory",
    "format_bytes",
    "TimelinePoint",
    "Timeline",
    "timeline",
]


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _storage_key(t: Tensor) -> Optional[Tuple[Any, int, int]]:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, functional or fake tensors
        return None
    return (t.device, st.data_ptr(), st.nbytes())


@dataclass
class SavedBytes:
    """What one forward pass saved for backward.

    Attributes:
        total: bytes of distinct storages held for backward.
        per_module: bytes attributed to the innermost module that was running when a
            storage was first saved (``""`` is the root / outside any module).
        count: number of distinct storages.
        shapes: ``(module, shape, dtype, nbytes)`` of each distinct storage, in save order.
        is_param: for each entry of ``shapes``, whether it is one of the model's parameters.
        param_bytes: bytes of those storages that are the model's parameters (known only
            when a model is given). ``total - param_bytes`` is what backward keeps beyond
            the weights the model holds anyway: compare *that* across methods that keep
            parameters differently (eager autograd saves them, convbn holds them by
            reference, ``torch.utils.checkpoint`` and compiled graphs vary).
    """

    total: int = 0
    param_bytes: int = 0
    per_module: Dict[str, int] = field(default_factory=dict)
    count: int = 0
    shapes: List[Tuple[str, Tuple[int, ...], torch.dtype, int]] = field(default_factory=list)
    is_param: List[bool] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        """Saved bytes that are not the model's parameters."""
        return self.total - self.param_bytes


class track_saved:
    """Context manager recording every tensor saved for backward inside it.

    Keeps a strong reference to nothing: only storage keys and sizes are recorded, and
    the saved tensors are handed back to autograd unchanged.

    Args:
        model: optional module: its parameters are recognised (``param_bytes``) and, with
            ``per_module``, its submodules get bytes attributed.
        per_module: attribute bytes to the submodules of ``model`` (adds hooks).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> with track_saved(net) as rec:
        ...     out = net(torch.randn(2, 4, requires_grad=True))
        >>> rec.result.total > 0
        True
    """

    def __init__(self, model: Optional[nn.Module] = None, per_module: bool = True) -> None:
        self.model = model
        self.per_module = per_module
        self._params: set = set()
        self.result = SavedBytes()
        self._seen: set = set()
        self._stack: List[str] = [""]
        self._handles: List[Any] = []
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _pack(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._seen:
            self._seen.add(key)
            nbytes = key[2]
            mod = self._stack[-1]
            self.result.total += nbytes
            self.result.count += 1
            if key in self._params:
                self.result.param_bytes += nbytes
            self.result.per_module[mod] = self.result.per_module.get(mod, 0) + nbytes
            self.result.shapes.append((mod, tuple(t.shape), t.dtype, nbytes))
            self.result.is_param.append(key in self._params)
        return t

    @staticmethod
    def _unpack(t: Tensor) -> Tensor:
        return t

    def __enter__(self) -> "track_saved":
        if self.model is not None:
            self._params = {k for k in (_storage_key(p) for p in self.model.parameters()) if k is not None}
        if self.model is not None and self.per_module:
            for name, mod in self.model.named_modules():
                self._handles.append(mod.register_forward_pre_hook(self._make_pre(name)))
                self._handles.append(mod.register_forward_hook(self._post, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def _make_pre(self, name: str) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            self._stack.append(name)

        setattr(pre, OBSERVER_ATTR, True)  # attribution only: fused modules stay fused
        return pre

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if len(self._stack) > 1:
            self._stack.pop()

    setattr(_post, OBSERVER_ATTR, True)

    def __exit__(self, *exc: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        for h in self._handles:
            h.remove()
        self._handles.clear()


def saved_bytes(
    model: nn.Module,
    *inputs: Any,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    per_module: bool = False,
) -> SavedBytes:
    """Bytes a training-mode forward pass of ``model(*inputs)`` keeps for backward.

    Runs one forward pass (the model's running statistics are updated, as in any
    training forward) and drops the graph afterwards without running backward.

    Args:
        model: the module to run (its current ``training`` mode is used).
        *inputs: positional inputs for ``model``.
        loss_fn: optional function of the output whose saved tensors count too.
        per_module: attribute bytes to submodules (adds hooks; slightly slower).

    Returns:
        :class:`SavedBytes`.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> saved_bytes(net, torch.randn(2, 3, 8, 8)).total > 0
        True
    """
    with torch.enable_grad(), track_saved(model, per_module=per_module) as rec:
        out = model(*inputs)
        if loss_fn is not None:
            out = loss_fn(out)
    del out
    return rec.result


# --------------------------------------------------------------------------- peak memory


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # pragma: no cover - non-Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class PeakMemory:
    """Peak memory over a block, above what was in use when it started.

    Attributes:
        peak: highest bytes in use during the block minus bytes in use at its start
            (CUDA allocator on a CUDA device, sampled process RSS on CPU).
        end: bytes in use at the end minus at the start.
        source: ``"cuda"`` or ``"rss"``.
    """

    peak: int = 0
    end: int = 0
    source: str = "rss"


class peak_memory:
    """Context manager measuring peak memory of the enclosed block.

    On CUDA it resets and reads :func:`torch.cuda.max_memory_allocated`; on CPU it
    samples the process RSS from a background thread every ``interval`` seconds
    (RSS includes allocator caching, so treat CPU figures as indicative).

    Args:
        device: the device whose memory to watch.
        interval: sampling period on CPU, seconds.

    Example:
        >>> with peak_memory("cpu") as pm:
        ...     x = torch.ones(1 << 20)
        >>> pm.result.source
        'rss'
    """

    def __init__(self, device: Any = "cpu", interval: float = 0.0005) -> None:
        self.device = torch.device(device)
        self.interval = interval
        self.result = PeakMemory(source="cuda" if self.device.type == "cuda" else "rss")
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start = 0
        self._peak = 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> "peak_memory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._start = self._peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.result.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            self.result.end = torch.cuda.memory_allocated(self.device) - self._start
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            now = _rss_bytes()
            self._peak = max(self._peak, now)
            self.result.peak = self._peak - self._start
            self.result.end = now - self._start


class tensor_peak:
    """Context manager: exact peak of live tensor bytes in the block, on any device.

    Counts tensor storages as they are created and freed (through PyTorch's
    ``MemTracker`` dispatch mode), so unlike sampled RSS it is deterministic and free
    of allocator caching: on CPU it is the analogue of ``torch.cuda.max_memory_allocated``.
    It slows the block down, so measure peaks in a step that is not timed.

    Args:
        *track: modules / optimizers whose existing tensors (parameters, gradients,
            buffers, optimizer state) count towards the live total from the start.

    Example:
        >>> net = nn.Linear(8, 8)
        >>> with tensor_peak(net) as tp:
        ...     net(torch.randn(4, 8)).sum().backward()
        >>> tp.result.peak > 0
        True
    """

    def __init__(self, *track: Any) -> None:
        try:
            from torch.distributed._tools.mem_tracker import MemTracker
        except ImportError as err:  # pragma: no cover - torch builds without it
            raise ImportError(
                "tensor_peak needs torch.distributed._tools.mem_tracker (PyTorch >= 2.5 with distributed); "
                "use peak_memory() instead"
            ) from err
        self._tracker = MemTracker()
        if track:
            self._tracker.track_external(*track)
        self.result = PeakMemory(source="tensors")
        self._start = 0

    @staticmethod
    def _total(snapshot: Dict[Any, Dict[Any, int]]) -> int:
        return sum(int(dev.get("Total", 0)) for dev in snapshot.values())

    def __enter__(self) -> "tensor_peak":
        self._tracker.__enter__()
        self._start = self._total(self._tracker.get_tracker_snapshot("current"))
        return self

    def __exit__(self, *exc: Any) -> None:
        end = self._total(self._tracker.get_tracker_snapshot("current"))
        peak = self._total(self._tracker.get_tracker_snapshot("peak"))
        self._tracker.__exit__(*exc)
        self.result.peak = peak - self._start
        self.result.end = end - self._start


# --------------------------------------------------------------------------- timeline

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
    """

    bytes: int
    phase: str
    module: str
    op: str
    node: int = 0


@dataclass
class Timeline:
    """Live memory across one training step, one point per operator (see :func:`timeline`).

    Attributes:
        points: in execution order; a point ``0`` at the start precedes the first operator.
        source: ``"tensors"`` (exact live storages) or ``"cuda"`` (allocator).
        label: a name for plots.
    """

    points: List[TimelinePoint] = field(default_factory=list)
    source: str = "tensors"
    label: str = ""

    @property
    def peak(self) -> int:
        """Highest bytes in use above the start (``tensor_peak``'s ``peak`` on the same step)."""
        return max((p.bytes for p in self.points), default=0)

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


def _innermost(parents: Any) -> str:
    names = [n for n in parents if n != "Global"]
    if not names:
        return ""
    name = max(names, key=lambda n: (n.count("."), len(n)))
    return name.split(".", 1)[1] if "." in name else ""  # drop the root class name ModTracker prefixes


class _TimelineMode(TorchDispatchMode):
    """Appends a :class:`TimelinePoint` after every operator (entered above the meter)."""

    def __init__(self, read: Callable[[], int], where: Callable[[], str]) -> None:
        super().__init__()
        self.read = read
        self.where = where
        self.phase = "forward"
        self.points: List[TimelinePoint] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        op = str(func)
        node = torch._C._current_autograd_node()
        if node is not None:
            op = f"{node.name()}/{op}"
        self.points.append(TimelinePoint(self.read(), self.phase, self.where(), op, 0 if node is None else id(node)))
        return out


def _cuda_peak_reader(dev: torch.device, start: int) -> Callable[[], int]:
    """Reads the allocator's peak since the previous reading, then resets it: each point is
    the most that was allocated *during* its operator (cuDNN workspaces included), so the
    timeline's maximum is ``torch.cuda.max_memory_allocated`` over the step (host-side
    allocator counters: no synchronisation needed)."""

    def read() -> int:
        peak = torch.cuda.max_memory_allocated(dev) - start
        torch.cuda.reset_peak_memory_stats(dev)
        return peak

    return read


def timeline(
    model: nn.Module,
    *inputs: Any,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    label: str = "",
) -> Timeline:
    """Record live memory after every operator of one training step of ``model``.

    The step is ``optimizer.zero_grad(set_to_none=True)`` (with an optimizer), forward
    ``model(*inputs)``, ``loss = loss_fn(output)``, ``loss.backward()`` and
    ``optimizer.step()``, each point labelled with its phase, module and operator. On CPU
    the bytes are exact live tensor storages (the same accounting as :class:`tensor_peak`,
    so ``timeline(...).peak`` equals ``tensor_peak``'s ``peak`` on the same step); on CUDA
    each point is the allocator's peak during its operator (workspaces included, see
    :func:`_cuda_peak_reader`). Bytes are relative to the start of
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

    Returns:
        :class:`Timeline`.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        >>> tl = timeline(net, torch.randn(4, 8))
        >>> tl.peak > 0 and tl.peak_point.phase in ("forward", "loss", "backward")
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"timeline expects an nn.Module, but got {type(model).__name__}")
    if loss_fn is None:
        loss_fn = _default_loss
    devices = {t.device.type for t in (*inputs, *model.parameters()) if isinstance(t, Tensor)}
    track: Tuple[Any, ...] = (model,) if optimizer is None else (model, optimizer)
    if "cuda" in devices:
        from torch.distributed._tools.mod_tracker import ModTracker

        dev = next(t.device for t in (*inputs, *model.parameters()) if isinstance(t, Tensor) and t.is_cuda)
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        meter: Any = ModTracker()
        mode = _TimelineMode(_cuda_peak_reader(dev, start), lambda: _innermost(meter.parents))
        source = "cuda"
    else:
        tp = tensor_peak(*track)
        tracker = tp._tracker
        mode = _TimelineMode(lambda: tp._total(tracker._curr_mem_snap) - tp._start,
                             lambda: _innermost(tracker._mod_tracker.parents))
        meter = tp
        source = "tensors"
    result = Timeline(source=source, label=label)
    with torch.enable_grad(), meter, mode:
        mode.points.append(TimelinePoint(mode.read(), "zero_grad" if optimizer is not None else "forward", "", "start"))
        if optimizer is not None:
            mode.phase = "zero_grad"
            optimizer.zero_grad(set_to_none=True)
        mode.phase = "forward"
        out = model(*inputs)
        mode.phase = "loss"
        loss = loss_fn(out)
        del out
        mode.phase = "backward"
        loss.backward()
        del loss
        if optimizer is not None:
            mode.phase = "optimizer"
            optimizer.step()
    result.points = mode.points
    return result


def _default_loss(out: Any) -> Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, Tensor)]
    if not leaves:
        raise TypeError(f"timeline's default loss needs a tensor output, but the model returned {type(out).__name__}")
    return leaves[0].float().mean()
