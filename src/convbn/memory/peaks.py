"""Peak memory of a block: the CUDA allocator, sampled process RSS, exact live tensor bytes,
or the CPU allocator's live bytes.

:class:`peak_memory` reads the CUDA allocator's peak on a GPU and samples RSS on CPU
(indicative: RSS includes allocator caching); :class:`tensor_peak` counts tensor storages
as they are created and freed, exact and deterministic on any device; :func:`allocator_peak`
counts what the CPU or CUDA allocator serves, which includes compiled code's own buffers (inductor
allocates outside the dispatcher, where no dispatch mode sees it) and kernels' scratch.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._compat import (frozen_safe_mem_tracker, hookless_mem_tracker, lean_mem_tracker, mem_tracker_class,
                       set_mod_tracker, sparse_counting_mem_tracker)
from ..autograd.grad_sink import stand_ins
from .mod_tracking import releasing_mod_tracker

__all__ = ["PeakMemory", "allocator_peak", "peak_memory", "tensor_peak"]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # pragma: no cover - non-Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def allocator_peak(fn: Callable[[], Any], device: Any = "cpu") -> int:
    """The most bytes live at ``device``'s allocator while ``fn()`` runs, above what was live when
    it began: every allocation the allocator reports to ``torch.profiler``
    (``profile_memory=True``) and the frees of those blocks, replayed in order. Unlike
    :func:`~convbn.memory.timeline` it sees compiled code's buffers (a step run by
    ``torch.compile``) and the kernels' own scratch (oneDNN's reorders, a convolution
    backward's buffers); it does not name operators. Workspaces freed before ``fn`` returns
    count; allocator caching does not (these are tensor bytes, not RSS). Memory live before
    ``fn`` and freed in it is not subtracted: only blocks allocated within ``fn`` count, so
    the same block gives the same figure whatever ran before it.

    On CUDA the caching allocator's blocks are counted (what ``torch.cuda.memory_allocated``
    counts). Unlike ``torch.cuda.max_memory_allocated`` this reading nests: a block that resets
    the CUDA peak statistics inside ``fn`` (convbn's CUDA ``timeline`` does, per operator) does
    not hide what was allocated before the reset.

    Args:
        fn: the block to measure, e.g. one training step.
        device: the allocator's device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``);
            a CUDA device without an index is the current one.

    Returns:
        Peak live bytes allocated on ``device`` within ``fn`` (not counting frees of older blocks).

    Example:
        >>> x = torch.randn(256, 256)
        >>> allocator_peak(lambda: (x @ x).sum()) >= 256 * 256 * 4
        True
    """
    from torch.profiler import ProfilerActivity, profile

    if not callable(fn):
        raise TypeError(f"allocator_peak expects a callable, but got {type(fn).__name__}")
    # Note: [blocks from before the measurement]
    # Memory live before ``fn`` and freed in it (the previous step's gradients, set to None by
    # the step's ``zero_grad``) is not subtracted: the profiler reports such a free with its
    # size only where the block was allocated under an earlier profiler session, so subtracting
    # it made the same step's figure depend on what was measured before it. Only blocks
    # allocated within ``fn`` count, from their allocation to their free.
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree(), dev))
    blocks: Dict[int, int] = {}
    live = peak = 0
    for _, ptr, nbytes in events:  # Note: [blocks from before the measurement]
        if nbytes > 0:
            blocks[ptr] = blocks.get(ptr, 0) + nbytes
            live += nbytes
            peak = max(peak, live)
        elif ptr in blocks:
            live -= blocks.pop(ptr)
    return peak


def _allocations(roots: Any, device: torch.device) -> List[Tuple[int, int, int]]:
    """``(time ns, address, bytes)`` of every allocation (positive) and free (negative) on
    ``device`` in a profiler's event tree."""
    out: List[Tuple[int, int, int]] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        fields = node.extra_fields
        if hasattr(fields, "alloc_size") and getattr(fields, "device", None) == device:
            out.append((node.start_time_ns, int(fields.ptr), int(fields.alloc_size)))
    return out


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
    A sparse tensor counts as its indices and values. Not counted: the kernels' own scratch
    that is not a tensor (oneDNN's reorders, a convolution backward's buffers), which
    :func:`allocator_peak` sees.
    It slows the block down, so measure peaks in a step that is not timed.

    Args:
        *track: modules / optimizers whose existing tensors (parameters, gradients,
            buffers, optimizer state) count towards the live total from the start.
        hooks: install ``MemTracker``'s gradient hooks on parameters (``True``: torch's
            tracker exactly as it is, for checking the hookless one against it).
        backward_modules: tell which module's backward runs (``False``: without most of the
            gradient hooks on module inputs and outputs that tell it; the bytes are the same).

    Example:
        >>> net = torch.nn.Linear(8, 8)
        >>> with tensor_peak(net) as tp:
        ...     net(torch.randn(4, 8)).sum().backward()
        >>> tp.result.peak > 0
        True
    """

    def __init__(self, *track: Any, hooks: bool = False, backward_modules: bool = True) -> None:
        MemTracker = mem_tracker_class()  # noqa: N806 - one line naming what a torch without it lacks
        MemTracker = sparse_counting_mem_tracker(MemTracker)  # noqa: N806
        # only totals are read: no gradient hooks, no per-module statistics (Note: [a meter that keeps
        # no module statistics] in _compat.py)
        lean = lean_mem_tracker(hookless_mem_tracker(MemTracker))
        self._tracker = frozen_safe_mem_tracker(MemTracker)() if hooks else lean()
        # torch's ModTracker leaves a cycle through autograd nodes behind, which keeps the
        # parameters of a measured model alive (Note: [a module tracker that leaves nothing alive])
        set_mod_tracker(self._tracker, releasing_mod_tracker(backward_modules))
        # the chains' zero-byte gradient stand-ins share scalars made once, before any step
        self._tracker.track_external(*track, *stand_ins())
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
