"""The largest batch that trains within a memory limit, for eager and for ``convbn.convert``.

:func:`max_batch` answers "will it fit?" before a run: it steps copies of the model (the
standard loop, see Note: [a step's peak] in ``memory/timelines.py``) at candidate batch
sizes and reports the largest whose ``resident + peak`` stays within the limit, eager's and
the converted model's, each with the peak it measured at that batch.

# Note: [searching the batch]
# For a fixed plan a step's peak is affine in the batch, ``a + s * b`` (activations scale
# with it, parameters, gradients and optimizer state do not), but the converted model's
# plan is made for the batch (``convert(memory_limit=...)``) and changes with it. The
# search therefore measures, never extrapolates a result: two small batches give a line,
# the line's crossing of the limit is the next probe, and every probe (a batch that fits
# raises the lower bound, one that does not lowers the upper) refits the line through the
# two nearest measured points, until the bounds are adjacent: the answer ``b`` was
# measured within the limit and ``b + 1`` above it.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .memory import timeline
from .memory.budget import parse_memory, resident_bytes, usable_bytes
from .memory.saved import format_bytes
from .passes.convert.api import convert

__all__ = ["BatchFit", "max_batch"]


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
        probes: ``{"eager": {batch: peak}, "convbn": {batch: peak}}``, every batch measured.
        device: where it was measured.
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
                f"{format_bytes(self.convbn_peak)}; usable {format_bytes(self.usable)} on {self.device}")


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


def _search(peak_at: Callable[[int], int], usable: int, upper: int) -> Tuple[int, int, Dict[int, int]]:
    """The largest batch ``b <= upper`` with ``peak_at(b) <= usable`` (Note: [searching the batch]);
    ``(b, peak_at(b), probes)``, ``(0, 0, probes)`` where batch 1 does not fit."""
    seen: Dict[int, int] = {}

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


def max_batch(
    model: nn.Module,
    sample: Any,
    memory: Any,
    *,
    optimizer: Optional[torch.optim.Optimizer] = None,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    upper: int = 1 << 16,
    **convert_kwargs: Any,
) -> BatchFit:
    """The largest batch that trains within ``memory``, eager and converted.

    A training step needs the resident bytes (parameters, buffers, optimizer state) plus
    its peak (the standard loop, gradients set to None first, weight gradients counted, as
    :func:`convbn.timeline` measures it). Copies of ``model`` (and of ``optimizer``, one
    warm-up step made so its state exists) take real steps at candidate batches (a line
    through two measured peaks gives the next batch to try, until the answer was measured
    within the limit and the next batch above it); the converted model is planned for each batch
    within the limit (``convert(memory_limit=...)``). ``model`` and ``optimizer`` are not
    changed. On CPU the peaks are exact live tensor bytes; on CUDA the allocator's peak
    (cuDNN workspaces included) against the limit less a 10 % margin for allocator
    fragmentation (not yet verified on a GPU).

    Each probe runs a real step at that batch, so the search takes a few steps of the
    largest batches it tries (and, for convbn, a conversion at each).

    Args:
        model: the model, on the device to train on.
        sample: an input batch (a tensor, or a tuple of the model's positional inputs),
            any batch size: batches are built by repeating its rows along dim 0.
        memory: the memory available for training on the device: bytes, or text such as
            ``"16GiB"`` or ``"512 MiB"`` (:func:`convbn.memory.parse_memory`).
        optimizer: the optimizer to be used, built on ``model``'s parameters (its state
            counts as resident); ``None``: no optimizer step, no state.
        loss_fn: maps the output to a scalar loss (default: mean of the first output).
        upper: the largest batch tried.
        **convert_kwargs: passed to :func:`convbn.convert` (e.g. ``chain=False``).

    Returns:
        :class:`BatchFit`; ``str()`` of it, or ``.summary()``, reads
        "in 16.0 GiB: eager trains batch A, convbn batch B".

    Raises:
        TypeError: ``model`` is not a module, ``optimizer`` not an optimizer, ``memory``
            neither a number nor a string.
        ValueError: ``memory`` not positive or not readable, ``upper < 1``.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> fit = max_batch(net, torch.randn(2, 3, 16, 16), "2MiB")
        >>> fit.convbn_batch >= fit.eager_batch > 0
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"max_batch expects an nn.Module, but got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, but got {type(optimizer).__name__}")
    if isinstance(upper, bool) or not isinstance(upper, int) or upper < 1:
        raise ValueError(f"upper must be a positive int, but got {upper!r}")
    limit = parse_memory(memory)
    inputs = sample if isinstance(sample, tuple) else tuple(sample) if isinstance(sample, list) else (sample,)
    if not any(isinstance(t, Tensor) and t.dim() > 0 for t in inputs):
        raise TypeError("sample must be a tensor or a tuple of inputs with at least one batched tensor, "
                        f"but got {type(sample).__name__}")
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    usable = usable_bytes(limit, device)
    # the copies: the optimizer copied with the model keeps referring to the copy's parameters
    base, opt = copy.deepcopy((model, optimizer))
    base.train()
    if opt is not None:  # one warm-up step: its state (momentum, Adam moments) exists from here on
        timeline(base, *_batch_of(inputs, 2), loss_fn=loss_fn, optimizer=opt)
        for p in base.parameters():
            p.grad = None
    resident = resident_bytes(base, opt)
    fit = BatchFit(memory=limit, usable=usable, resident=resident, device=str(device))

    def step_peak(m: nn.Module, o: Optional[torch.optim.Optimizer], b: int) -> int:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return timeline(m, *_batch_of(inputs, b), loss_fn=loss_fn, optimizer=o).peak

    def eager(b: int) -> int:
        m, o = copy.deepcopy((base, opt))
        return resident + step_peak(m, o, b)

    def fused(b: int) -> int:
        m, o = copy.deepcopy((base, opt))
        x = _batch_of(inputs, b)
        state = resident_bytes(base, opt) - resident_bytes(base)  # optimizer state: not known to convert
        with warnings.catch_warnings():  # a batch no plan fits warns: here it is only a probe
            warnings.simplefilter("ignore")
            m = convert(m, example_inputs=x, memory_limit=max(1, limit - state), **convert_kwargs)
        return resident + step_peak(m, o, b)

    fit.eager_batch, e_total, e_probes = _search(eager, usable, upper)
    fit.convbn_batch, c_total, c_probes = _search(fused, usable, upper)
    fit.eager_peak = e_total - resident if fit.eager_batch else 0
    fit.convbn_peak = c_total - resident if fit.convbn_batch else 0
    fit.probes = {"eager": {b: p - resident for b, p in sorted(e_probes.items())},
                  "convbn": {b: p - resident for b, p in sorted(c_probes.items())}}
    return fit
