"""Measuring what a model keeps for backward, and how much memory a step peaks at.

* :mod:`~convbn.memory.saved` -- *saved bytes* (activations held from forward to backward, parameters excluded), the primary, deterministic
  metric: :func:`saved_bytes`, :class:`track_saved`;
* :mod:`~convbn.memory.peaks` -- the peak of a block: :class:`peak_memory` (CUDA
  allocator / sampled RSS), :class:`tensor_peak` (exact live tensors),
  :func:`allocator_peak` (the CPU allocator's live bytes, compiled code included);
* :mod:`~convbn.memory.timelines` -- live bytes after every operator of one training
  step: :func:`timeline`.
"""
from .peaks import PeakMemory, allocator_peak, peak_memory, tensor_peak
from .saved import SavedBytes, format_bytes, saved_bytes, track_saved
from .timelines import PHASES, Timeline, TimelinePoint, timeline

__all__ = [
    "PHASES",
    "PeakMemory",
    "SavedBytes",
    "Timeline",
    "TimelinePoint",
    "allocator_peak",
    "format_bytes",
    "peak_memory",
    "saved_bytes",
    "tensor_peak",
    "timeline",
    "track_saved",
]
