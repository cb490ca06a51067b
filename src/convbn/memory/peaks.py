"""Peak memory of a block: the CUDA allocator, sampled process RSS, exact live tensor bytes,
or the CPU allocator's live bytes.

:class:`peak_memory` reads the CUDA allocator's peak on a GPU and samples RSS on CPU
(indicative: RSS includes allocator caching); :class:`tensor_peak` counts tensor storages
as they are created and freed, exact and deterministic on any device; :func:`allocator_peak`
counts what the CPU allocator serves, which includes compiled code's own buffers (inductor
allocates outside the dispatcher, where no dispatch mode sees it).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._compat import mem_tracker_class, pytree, sparse_parts
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


def allocator_peak(fn: Callable[[], Any]) -> int:
    """The most bytes live at the CPU allocator while ``fn()`` runs, above what was live when
    it began: every allocation the allocator reports to ``torch.profiler``
    (``profile_memory=True``) and the frees of those blocks, replayed in order. Unlike
    :func:`~convbn.memory.timeline` it sees compiled code's buffers (a step run by
    ``torch.compile``) and the kernels' own scratch (oneDNN's reorders, a convolution
    backward's buffers); it does not name operators. Workspaces freed before ``fn`` returns
    count; allocator caching does not (these are tensor bytes, not RSS).

    # Note: [blocks from before the measurement]
    # Memory live before ``fn`` and freed in it (the previous step's gradients, set to None
    # by the step's ``zero_grad``) is not subtracted: the profiler reports such a free with
    # its size only where the block was allocated under an earlier profiler session, so
    # subtracting it made the same step's figure depend on what was measured before it.
    # Only blocks allocated within ``fn`` count, from their allocation to their free: the
    # same figure for the same block, whatever ran before.

    Args:
        fn: the block to measure, e.g. one training step.

    Returns:
        Peak live CPU bytes allocated within ``fn`` (not counting frees of older blocks).

    Example:
        >>> x = torch.randn(256, 256)
        >>> allocator_peak(lambda: (x @ x).sum()) >= 256 * 256 * 4
        True
    """
    from torch.profiler import ProfilerActivity, profile

    if not callable(fn):
        raise TypeError(f"allocator_peak expects a callable, but got {type(fn).__name__}")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(_cpu_allocations(prof.profiler.kineto_results.experimental_event_tree()))
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


def _cpu_allocations(roots: Any) -> List[Tuple[int, int, int]]:
    """``(time ns, address, bytes)`` of every CPU allocation (positive) and free (negative)
    in a profiler's event tree."""
    out: List[Tuple[int, int, int]] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        fields = node.extra_fields
        if hasattr(fields, "alloc_size") and getattr(fields, "device", None) == torch.device("cpu"):
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


def _hookless(base: Any) -> Any:
    """``MemTracker`` that installs no gradient hooks on parameters.

    # Note: [a meter that does not change the step]
    # ``MemTracker`` registers a tensor hook and a post-accumulate hook on every parameter
    # of a module it sees run, only to label gradient storages as gradients in its
    # per-category statistics; its totals come from its dispatch mode, which sees every
    # allocation either way (tests/test_step_peak.py checks the totals equal to the byte). A tensor hook
    # is an observer of the gradient, so with it convbn's chains must return their
    # weight gradients to autograd instead of accumulating them as eager's engine does
    # (Note: [weight gradients as eager releases them]): the meter would measure another
    # step than the user runs. convbn only reads totals, so it measures without the hooks.
    """

    _TOTAL = "Total"  # torch's key of a device's total in a snapshot (mem_tracker._TOTAL_KEY)

    class HooklessMemTracker(base):  # type: ignore[misc, valid-type]
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Note: [a meter that reads totals only]
            # torch's tracker updates, after every operator, the peak of every module it has
            # seen run (a walk over all of them: operators x modules, quadratic in the model's
            # size; on a 300-BatchNorm HRNet-style net most of a recorded step's time). convbn
            # reads the totals only, so only the totals' peak is kept, exactly as torch keeps it.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                    self._peak_mem[dev] = snap[_TOTAL]
                    self._peak_mem_snap[dev] = dict(snap)

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            # a module called again with no tracked parent (one activation module shared by
            # every layer, run by a fused chain's eager part) looks like a next iteration to
            # MemTracker, which raises; its per-module statistics are not read here: restart them
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                self.memory_tracking.pop(module, None)
                super()._pre_fw_hook(module, inputs)

    return HooklessMemTracker


def _counting_sparse(base: Any) -> Any:
    """``MemTracker`` that counts a sparse tensor as the dense tensors it is made of (torch's
    reads ``untyped_storage()``, which a sparse tensor has not: it raised mid-step); a layout
    whose parts are not known here is a ``TypeError`` naming it."""

    class SparseCountingMemTracker(base):  # type: ignore[misc, valid-type]
        def _track(self, reftype: Any, t: Any) -> None:
            parts = sparse_parts(t)
            if parts is None:
                raise TypeError(f"tensor_peak cannot count a tensor of layout {t.layout} (shape {tuple(t.shape)}): "
                                "only strided and sparse COO / CSR / CSC / BSR / BSC tensors are measured")
            for part in parts or (t,):
                super()._track(reftype, part)

        def _update_and_maybe_create_winfos(self, t: Any, reftype: Any, update_existing: bool = False) -> Any:
            parts = sparse_parts(t)
            if not parts:  # strided (torch's own path), or an unknown layout (torch's error)
                return super()._update_and_maybe_create_winfos(t, reftype, update_existing)
            return set().union(*(super(SparseCountingMemTracker, self)._update_and_maybe_create_winfos(
                part, reftype, update_existing) for part in parts))

        def _track_inputs_or_outputs(self, args: Any) -> int:
            return super()._track_inputs_or_outputs(pytree.tree_map_only(torch.Tensor, _dense_parts, args))

    return SparseCountingMemTracker


def _dense_parts(t: torch.Tensor) -> Any:
    """``t``, or the tuple of dense tensors a sparse ``t`` is made of."""
    parts = sparse_parts(t)
    return t if not parts else parts


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

    Example:
        >>> net = torch.nn.Linear(8, 8)
        >>> with tensor_peak(net) as tp:
        ...     net(torch.randn(4, 8)).sum().backward()
        >>> tp.result.peak > 0
        True
    """

    def __init__(self, *track: Any, hooks: bool = False) -> None:
        MemTracker = mem_tracker_class()  # noqa: N806 - one line naming what a torch without it lacks
        MemTracker = _counting_sparse(MemTracker)  # noqa: N806
        self._tracker = _frozen_safe(MemTracker)() if hooks else _hookless(MemTracker)()
        # torch's ModTracker leaves a cycle through autograd nodes behind, which keeps the
        # parameters of a measured model alive (Note: [a module tracker that leaves nothing alive])
        self._tracker._mod_tracker = releasing_mod_tracker()
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


class _NoHandle:
    def remove(self) -> None:
        pass


def _frozen_safe(tracker_cls: type) -> type:
    """``MemTracker`` that skips the gradient hooks of frozen parameters: it registers one
    on every parameter of a module it enters, which raises for ``requires_grad=False``."""

    class FrozenSafeMemTracker(tracker_cls):  # type: ignore[misc, valid-type]
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHandle(), _NoHandle())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenSafeMemTracker
