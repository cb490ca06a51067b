"""The largest batch that trains within a memory limit, for eager and for ``convbn.convert``.

:func:`max_batch` answers "will it fit?" before a run: it steps copies of the model (the
standard loop, see Note: [a step's peak] in ``memory/timelines.py``) at candidate batch
sizes and reports the largest whose ``resident + peak`` stays within the limit, eager's and
the converted model's, each with the peak it measured at that batch.

How it searches, why it stays within the limit it is asked about and how it decides to
confirm: Notes [searching the batch], [answering within the limit] and [confirming by counted
work] in ``batch_search.py``.
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Literal, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .batch_search import CONFIRM_FLOPS, Search, young_heap
from .batch_search import batch_of as _batch_of
from .memory.budget import parse_memory, resident_bytes, usable_bytes
from .memory.saved import format_bytes
from .passes.check.validate import as_args
from .passes.convert.api import check_args, convert
from .progress import check_progress, progress_scope, stage
from .functional.deprecation import renamed_kwargs

__all__ = ["BatchFit", "max_batch", "CONFIRM_FLOPS"]


def __getattr__(name: str) -> Any:
    """``CONFIRM_SECONDS``, deprecated: ``confirm="auto"`` decides by counted work
    (:data:`CONFIRM_FLOPS`), never by the clock, and reads it no more."""
    if name == "CONFIRM_SECONDS":
        warnings.warn("convbn.largest_batch.CONFIRM_SECONDS is deprecated and no longer read: max_batch's "
                      "confirm='auto' decides by the counted work of the confirming steps, never by the clock; "
                      "set convbn.batch_search.CONFIRM_FLOPS instead", DeprecationWarning, stacklevel=2)
        return 20.0
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class BatchFit:
    """What :func:`max_batch` found.

    Attributes:
        memory: the limit, bytes.
        usable: bytes the step's tensors may use (the limit, less the CUDA margin).
        resident: parameters, buffers and optimizer state, bytes (alive between steps).
        sample_bytes: one sample's inputs, bytes: a batch of ``b`` holds ``b * sample_bytes``
            (alive before a step, as in a training loop, and inside the limit).
        eager_batch / convbn_batch: the largest batch that trains within the limit (0: not
            even one sample).
        eager_peak / convbn_peak: the step's peak at that batch, above ``resident`` and the
            batch of inputs (as :func:`convbn.timeline` measures it);
            ``resident + batch * sample_bytes + peak <= usable``.
        probes: ``{"eager": {batch: peak}, "convbn": {batch: peak}}``, every batch whose
            step was measured as trained (for convbn: converted for that batch).
        device: where it was measured.
        how: ``{"eager": ..., "convbn": ...}``: how each answer was found: measured at the
            answer and the batch above it, or predicted from steps at small batches.
    """

    memory: int
    usable: int
    resident: int
    sample_bytes: int = 0
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
        """``"in 16.0 GiB: eager trains batch 96, convbn batch 210 (2.19x)"`` (where eager fits
        not one sample: ``"eager trains no batch (not one sample), convbn batch 3"``)."""
        if not self.eager_batch:
            return (f"in {format_bytes(self.memory)}: eager trains no batch (not one sample), "
                    f"convbn batch {self.convbn_batch}")
        return (f"in {format_bytes(self.memory)}: eager trains batch {self.eager_batch}, "
                f"convbn batch {self.convbn_batch} ({self.gain:.2f}x)")

    def __str__(self) -> str:
        return (f"{self.summary()}\n  resident (parameters, buffers, optimizer state) {format_bytes(self.resident)}; "
                f"step peak at those batches: eager {format_bytes(self.eager_peak)}, convbn "
                f"{format_bytes(self.convbn_peak)}; usable {format_bytes(self.usable)} on {self.device}"
                + "".join(f"\n  {side}: {how}" for side, how in self.how.items()))


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
    confirm: Union[bool, Literal["auto"], None] = "auto",
    progress: Optional[bool] = None,
    **convert_kwargs: Any,
) -> BatchFit:
    """The largest batch that trains within ``memory``, eager and converted.

    A training step needs the resident bytes (parameters, buffers, optimizer state), its
    batch of inputs and its peak (the standard loop, gradients set to None first, weight
    gradients counted, as :func:`convbn.timeline` measures it). A copy of ``model`` (and of ``optimizer``, one
    warm-up step made so its state exists) takes real steps at small batches (2, 4 and 3);
    the answer is predicted from them exactly where a step's memory is a line in the batch,
    which the step at 3 checks, and confirmed by real steps at the answer and the batch above
    it (``confirm``; ``how`` says which). The converted model is planned for each batch
    within the limit as ``convert(memory_limit=...)`` plans it. ``model`` and ``optimizer``
    are not changed. On CPU the peaks are exact live tensor bytes; on CUDA the allocator's
    peak (cuDNN workspaces included) against the limit less a 10 % margin for allocator
    fragmentation (not yet verified on a GPU).

    ``memory`` holds the model's parameters, buffers and optimizer state, the batch of inputs
    and the step: the answer is the largest batch with ``resident + batch * sample_bytes +
    peak <= usable``. Answering stays within it: one copy of the model exists at a time, and
    a step that would go over the room its batch leaves is stopped before the operator whose
    outputs would take it over (their sizes known from a meta run), with ``method="measure"``
    too. On CPU each step is fitted and stopped with its kernels' scratch while they run (the
    buffers a convolution or a BatchNorm backward allocates and frees inside its operator, which
    no tensor meter sees), bounded by the table of :mod:`convbn.memory.kernel_scratch`. The
    process's memory while answering is then bounded by ``memory`` + 1 KiB of small
    allocations plus, stated and not counted: on CUDA the workspace of an operator a
    step is stopped after, on CPU the scratch of an operator outside that table, and
    ``convert``'s own check at batch 2. Measured by the CPU allocator's exact bytes: a strided
    net within ``memory`` + 1 KiB (without the scratch counted the same call goes over);
    ResNet-50 224² at 768 MiB: 758.8 MiB, answers eager 6, convbn 18 (without: 788.8 MiB, 6 / 21).
    With ``memory_budget=`` a copy is converted at each batch tried, not held to the limit.
    Its answer depends on no clock: the same call gives the same batches, ``probes`` and
    ``how`` on any machine.

    Args:
        model: the model, on the device to train on.
        example_inputs: an input batch (a tensor, or a tuple of the model's positional
            inputs), any batch size: batches are built by repeating its rows along dim 0
            (``sample=``, its old name, is deprecated).
        memory: the memory available for training on the device: bytes, or text such as
            ``"16GiB"`` or ``"512 MiB"`` (:func:`convbn.memory.parse_memory`).
        optimizer: the optimizer to be used, over ``model``'s parameters (its state counts
            as resident); ``None``: no optimizer step, no state.
        loss_fn: maps the output to a scalar loss (default: mean of the first output).
        upper: the largest batch tried.
        method: ``"predict"`` (default: small steps, a prediction, confirmed where
            affordable) or ``"measure"`` (real steps at every batch the search tries: slow
            on large batches, the reference the prediction is tested against; the converted
            side steps its batch-2 conversion planned for each batch as ``convert`` plans it).
        confirm: with ``"predict"``, confirm the answer by real steps at it and the batch
            above it: ``"auto"`` (default) where those two steps are counted to do at most
            2e12 floating-point operations each side (the eager step's count at batch 2,
            scaled to those batches; never a clock), ``True`` always,
            ``False`` never (``None``: ``"auto"``). ``BatchFit.how`` says which was done.
        progress: print a line per stage on stderr: ``None`` where stderr is a terminal.
        **convert_kwargs: passed to :func:`convbn.convert` (e.g. ``chain=False``).

    Returns:
        :class:`BatchFit`; ``str()`` of it, or ``.summary()``, reads
        "in 16.0 GiB: eager trains batch A, convbn batch B".

    Raises:
        TypeError: ``model`` is not a module, ``optimizer`` not an optimizer, ``loss_fn`` not
            callable, ``memory`` neither a number nor a string, a keyword ``convert`` does not take.
        ValueError: ``memory`` not positive, not finite or not readable, ``upper < 1``, an
            unknown ``method``, an ``optimizer`` with parameters that are not ``model``'s,
            ``convert_kwargs`` ``convert`` would refuse; ``memory`` below what one sample
            needs (the resident bytes and a step at batch 1, eager's and converted).

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> fit = max_batch(net, torch.randn(2, 3, 16, 16), "2MiB")
        >>> fit.convbn_batch >= fit.eager_batch > 0
        True
    """
    limit, inputs = _check_arguments(model, example_inputs, memory, optimizer, loss_fn, upper, method, confirm, progress)
    _check_convert_kwargs(model, inputs, limit, convert_kwargs)
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    _check_fits_resident(memory, limit, resident_bytes(model), device, "parameters and buffers")
    with progress_scope("max_batch", progress), young_heap():
        search = Search(model, optimizer, inputs, loss_fn, limit, upper, device,
                        "auto" if confirm is None else confirm, convert_kwargs)
        _check_fits_resident(memory, limit, search.resident, device, "parameters, buffers and optimizer state")
        if method == "measure":
            eager = search.measured("eager")
            fused = search.measured("convbn")
        else:
            eager = search.eager_predicted()
            fused = search.fused_predicted()
        search.let_go()  # the last copy freed before the call returns, not at some later collection
        stage(f"eager batch {eager[0]}, convbn batch {fused[0]}")
    return _fit(memory, limit, search, eager, fused, device)


def _check_fits_resident(memory: Any, limit: int, resident: int, device: torch.device, what: str) -> None:
    """A limit below what the model holds between steps is refused before any step."""
    if resident > usable_bytes(limit, device):
        raise ValueError(f"memory={memory!r} ({format_bytes(limit)}) is below what one sample needs: the model's "
                         f"{what} alone take {format_bytes(resident)} (usable on {device}: "
                         f"{format_bytes(usable_bytes(limit, device))}); give a larger memory")


def _fit(memory: Any, limit: int, search: Search, eager: Tuple[int, int, Dict[int, int], str],
         fused: Tuple[int, int, Dict[int, int], str], device: torch.device) -> BatchFit:
    """The two searches' results as a :class:`BatchFit` (peaks above ``resident``); a limit
    where neither side trains one sample is a ``ValueError``."""
    resident = search.resident
    fit = BatchFit(memory=limit, usable=search.usable, resident=resident, sample_bytes=search.before(1) - resident,
                   device=str(device))
    fit.eager_batch, e_total, e_probes, fit.how["eager"] = eager
    fit.convbn_batch, c_total, c_probes, fit.how["convbn"] = fused
    fit.eager_peak = e_total - search.before(fit.eager_batch) if fit.eager_batch else 0
    fit.convbn_peak = c_total - search.before(fit.convbn_batch) if fit.convbn_batch else 0
    fit.probes = {"eager": {b: p - search.before(b) for b, p in sorted(e_probes.items())},
                  "convbn": {b: p - search.before(b) for b, p in sorted(c_probes.items())}}
    if not fit.convbn_batch and not fit.eager_batch:
        needs = min((p for side in fit.probes.values() for b, p in side.items() if b <= 2), default=0)
        raise ValueError(f"memory={memory!r} ({format_bytes(limit)}) is below what one sample needs: resident "
                         f"{format_bytes(resident)} (parameters, buffers, optimizer state), and the batch of "
                         f"inputs ({format_bytes(fit.sample_bytes)} a sample) with a training step are over the "
                         f"remaining {format_bytes(search.usable - resident)} even converted"
                         + (f" (it was stopped at {format_bytes(needs)})" if needs else "") + "; give a larger memory")
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
    if not (confirm is None or isinstance(confirm, bool) or (isinstance(confirm, str) and confirm == "auto")):
        raise TypeError(f"confirm must be 'auto', True or False, but got {confirm!r}")
    _check_optimizer_params(model, optimizer)
    check_progress(progress)
    limit = parse_memory(memory)
    inputs = as_args(example_inputs, "example_inputs")
    if not any(isinstance(t, Tensor) and t.dim() > 0 for t in inputs):
        raise TypeError("example_inputs must be a tensor or a tuple of inputs with at least one batched tensor, "
                        f"but got {type(example_inputs).__name__}")
    return limit, inputs


def _check_optimizer_params(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """An optimizer stepping parameters that are not ``model``'s (built on another model, or
    on a copy) is refused: its state and steps would not be the model's."""
    if optimizer is None:
        return
    own = {id(p) for p in model.parameters()}
    theirs = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in theirs if id(p) not in own]
    if foreign:
        raise ValueError(f"optimizer must be over model's parameters, but {len(foreign)} of its {len(theirs)} "
                         f"parameters (the first of shape {tuple(foreign[0].shape)}) are not parameters of the "
                         f"{type(model).__name__} given; build it on model.parameters()")
