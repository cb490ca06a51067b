"""A training step read off a caching allocator's counters (CUDA), from the step's own start.

# Note: [an allocator meter starts where the step starts]
# :func:`convbn.memory.timeline` sets the previous step's gradients to ``None`` (the standard
# loop's ``zero_grad(set_to_none=True)``) before the step, so that freeing them is not part of
# the step. The exact CPU meter reads its start when its block is entered, after that; the
# allocator meter must too. It used to read ``memory_allocated`` (and reset the peak) when it
# was built, before the gradients were freed: every later reading was then below the step's
# true bytes by the gradients' blocks (a second ``timeline`` of the same model, its first
# step's gradients still alive, read 65536 where the first read 408064 on an H200), and a
# ``stop_above`` reading ``memory_allocated - start`` let a step run past its limit by as
# much. This meter reads its start, and resets the allocator's peak, in ``__enter__``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .mod_tracking import releasing_mod_tracker

__all__ = ["AllocatorCounters", "AllocatorMeter", "cuda_counters"]


@dataclass(frozen=True)
class AllocatorCounters:
    """The readings of a caching allocator a step is metered by.

    Attributes:
        allocated: bytes allocated now.
        peak: the most bytes allocated since the peak was last reset.
        reset_peak: reset the peak to the bytes allocated now.
        synchronize: wait for the device's queued work (before the start is read).
    """

    allocated: Callable[[], int]
    peak: Callable[[], int]
    reset_peak: Callable[[], None]
    synchronize: Callable[[], None]


def cuda_counters(dev: torch.device) -> AllocatorCounters:
    """The CUDA caching allocator's counters on ``dev`` (host-side: reading them needs no
    synchronisation)."""
    return AllocatorCounters(lambda: torch.cuda.memory_allocated(dev), lambda: torch.cuda.max_memory_allocated(dev),
                             lambda: torch.cuda.reset_peak_memory_stats(dev), lambda: torch.cuda.synchronize(dev))


class AllocatorMeter:
    """Context manager around one step: bytes above the allocator's reading when the block is
    entered (Note: [an allocator meter starts where the step starts]), and the innermost module
    running (a :func:`~convbn.memory.mod_tracking.releasing_mod_tracker` entered with it).

    Example:
        >>> c = AllocatorCounters(lambda: 100, lambda: 100, lambda: None, lambda: None)
        >>> with AllocatorMeter(c) as meter:
        ...     meter.now(), meter.read()
        (0, 0)
    """

    def __init__(self, counters: AllocatorCounters, backward_modules: bool = True) -> None:
        self.counters = counters
        self.tracker = releasing_mod_tracker(backward_modules)
        self.start = 0

    def __enter__(self) -> "AllocatorMeter":
        self.tracker.__enter__()
        self.counters.synchronize()
        self.start = self.counters.allocated()
        self.counters.reset_peak()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)

    def read(self) -> int:
        """The most bytes allocated since the previous reading (above the start), then the peak
        reset: a point per operator is the most allocated *during* that operator (workspaces
        included), so a timeline's maximum is the allocator's peak over the step."""
        peak = self.counters.peak() - self.start
        self.counters.reset_peak()
        return peak

    def now(self) -> int:
        """Bytes allocated now, above the start (not a peak reading: that would reset the peak)."""
        return self.counters.allocated() - self.start
