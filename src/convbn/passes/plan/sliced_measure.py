"""The planner's two recorded steps taken at two small slices of the example batch and put on
lines to the batch itself (Note: [measured on two slices of the batch]).

Note: [measured on two slices of the batch]
``convert(example_inputs=x)`` with ``strategy="auto"`` records one eager training step (its peak
and what its forward saves) and one step of the converted model recomputing every layer (the
planner's inputs, :class:`~convbn.passes.plan.plan_inputs.PlanInputs`). A recorded step costs
more than a plain one (every operator is metered), and both ran at the example batch: with the
check's two steps, four full-batch steps. For a fixed model and plan, the bytes alive after
each operator are affine in the batch (Note: [planner inputs are affine in the batch] in
plan_inputs.py), so the two recorded steps are taken at two small batches (the first samples
of ``x``: 1 and 2, else 2 and 3, :data:`SLICE_PAIRS`) and every figure is read off the line
through the two, at ``x``'s batch:
the eager step's saved bytes, each point of its timeline (its peak is the highest of them),
and every number of ``PlanInputs`` (:func:`~convbn.passes.plan.plan_inputs.plan_inputs_at`).

The lines are used only where they are known to hold here:

* both slices run the same operators in the same phases, on both sides (else
  ``plan_inputs_at`` refuses, and the eager timelines are compared the same way);
* every fused layer's conv output and input bytes and MACs on the lines equal the ones the
  check's step left on the layers, at the batch it ran at (so the slices cut the batch, not some
  other dimension, and the layers' shapes are affine in it). Where the check ran on a slice of
  the batch (Note: [the check on a slice of the batch] in check/slice_check.py), that batch is
  one of the two slices; each layer then gets the sizes at the example batch on the lines
  through its sizes at the two slices (integers, else the steps run at the example batch), and
  the bytes and MACs those give must be the lines' at the example batch.

A model that raises at a slice of one sample (a BatchNorm after global pooling needs two
values per channel) or whose lines from 1 and 2 do not hold (a shape-dependent branch, a
``squeeze()`` of the batch) is recorded at 2 and 3; one sample is tried first because it is
cheapest (ResNet-50 b8: convert 4.3x an eager step against 5.0x with 2 and 3, the same plan).
Elsewhere (a batch below :data:`MIN_BATCH`, inputs that cannot be sliced, a model that raises
at both pairs of slices, a layer the check did not reach), both steps are recorded at the example batch as before. Byte counts are
those of the exact CPU meter (live tensor storages), which has no rounding; on CUDA the
allocator rounds block sizes, so the slices are used on the CPU only.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, List, Optional, Sequence, Tuple

from torch import Tensor, nn
from ..._compat import pytree

from ...memory import track_saved
from ...nn.chain import ChainLayer, FusedChain
from ...progress import stage
from ..check.validate import StateSnapshot, batch_sample
from .plan_inputs import PlanInputs, chains_of, measure_peak, measure_plan_inputs, plan_inputs_at

__all__ = ["SLICE_PAIRS", "MIN_BATCH", "Recorded", "record_eager_and_chains", "recorded_on_slices"]

#: the two batches the recorded steps run at, where the example batch is at least :data:`MIN_BATCH`:
#: the first pair whose lines hold
SLICE_PAIRS = ((1, 2), (2, 3))
#: the smallest example batch measured on slices (below it the slices save too little)
MIN_BATCH = 8


@dataclass(frozen=True)
class Recorded:
    """What the planner reads of its two recorded steps: the eager step's saved activation bytes
    and step peak, the chains the inputs reach (forward order) and the planner's inputs."""

    eager_saved: int
    eager_peak: int
    ordered: List[FusedChain]
    inputs: PlanInputs
    eager_points: Tuple[int, ...] = ()
    eager_ops: Tuple[str, ...] = ()


def record_eager_and_chains(original: nn.Module, converted: nn.Module, inputs: Tuple[Any, ...]) -> Recorded:
    """The eager step (its peak and, from its forward, its saved bytes: the mean loss and the
    backward save nothing) and every chain of ``converted`` recomputing all, recorded on
    ``inputs`` (state restored)."""
    with StateSnapshot(original), StateSnapshot(converted):
        with track_saved(original, per_module=False) as saved:
            tl = measure_peak(original, inputs, backward_modules=False)  # its bytes and operators are read
        ordered, measured = measure_plan_inputs(converted, inputs)
    return Recorded(saved.result.activation_bytes, tl.peak, ordered, measured,
                    tuple(p.bytes for p in tl.points), tuple(f"{p.phase}:{p.op}" for p in tl.points))


def _batch(inputs: Tuple[Any, ...]) -> int:
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, Tensor)]
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else 0


def recorded_on_slices(original: nn.Module, converted: nn.Module, inputs: Tuple[Any, ...],
                       shapes_at: Optional[int] = None) -> Optional[Recorded]:
    """:func:`record_eager_and_chains` at the example batch, read off two recordings at the
    first pair of batches of :data:`SLICE_PAIRS` whose lines hold; ``None`` where none do
    (Note: [measured on two slices of the batch]): the caller then records at the example batch.
    ``shapes_at``: the batch the layers' shapes were recorded at (by the check: Note: [the check
    on a slice of the batch] in check/slice_check.py); ``None``: the example batch."""
    batch = _batch(inputs)
    tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, Tensor)]
    if batch < MIN_BATCH or any(t.device.type != "cpu" for t in tensors):
        return None
    for pair in SLICE_PAIRS:
        recorded = _on_slices(original, converted, inputs, batch, pair, batch if shapes_at is None else shapes_at)
        if recorded is not None:
            return recorded
    return None


def _on_slices(original: nn.Module, converted: nn.Module, inputs: Tuple[Any, ...], batch: int,
               pair: Tuple[int, int], shapes_at: int) -> Optional[Recorded]:
    """The recordings at the batches ``pair`` on their lines at ``batch``, or ``None``; the layers
    keep their shapes at ``batch`` (recorded there, or on the lines through the two recordings')."""
    stage(f"plan: measuring the eager step and {len(chains_of(converted))} chains at batches "
          f"{pair[0]} and {pair[1]} (lines to {batch})")
    shapes = _layer_shapes(converted)
    runs: List[Recorded] = []
    seen: List[List[Tuple[ChainLayer, Any, Any, Any]]] = []
    try:
        for n in pair:
            cut = batch_sample(inputs, n)
            if cut is None:
                return None
            runs.append(record_eager_and_chains(original, converted, tuple(cut)))
            seen.append(_layer_shapes(converted))
    except Exception:  # noqa: BLE001 - a model that runs only at its batch (state put back): recorded there
        return None
    finally:
        _put_back(shapes)  # the layers keep the shapes the check recorded (the report reads them at the batch)
    recorded = _on_lines(runs[0], runs[1], batch, shapes_at)
    if recorded is None or shapes_at == batch:
        return recorded
    if not _extrapolated(seen[0], seen[1], pair, batch) or not _shapes_agree(recorded.inputs, recorded.ordered):
        _put_back(shapes)
        return None
    return recorded


def _on_lines(a: Recorded, b: Recorded, batch: int, shapes_at: int) -> Optional[Recorded]:
    """``a`` and ``b`` (at two batches) on their lines at ``batch``, or ``None`` where they are not
    lines (or the lines miss the layers' shapes, recorded at ``shapes_at``)."""
    if [id(c) for c in a.ordered] != [id(c) for c in b.ordered] or a.eager_ops != b.eager_ops:
        return None
    try:
        planned = plan_inputs_at(a.inputs, b.inputs, batch)
        at_shapes = planned if shapes_at == batch else plan_inputs_at(a.inputs, b.inputs, shapes_at)
    except ValueError:
        return None
    if not _shapes_agree(at_shapes, a.ordered):
        return None
    ba, bb = a.inputs.batch, b.inputs.batch
    points = tuple(_line(p, q, ba, bb, batch) for p, q in zip(a.eager_points, b.eager_points))
    return Recorded(_line(a.eager_saved, b.eager_saved, ba, bb, batch), max(points, default=0), a.ordered, planned,
                    points, a.eager_ops)


def _extrapolated(a: List[Tuple[ChainLayer, Any, Any, Any]], b: List[Tuple[ChainLayer, Any, Any, Any]],
                  pair: Tuple[int, int], batch: int) -> bool:
    """Give every layer the shapes at ``batch`` on the lines through its shapes at the two batches
    ``pair`` (``a`` and ``b``); ``False`` (the layers unchanged or partly changed: the caller puts
    them back) where a size is not on an integer line or the dtypes differ."""
    out = []
    for (l, xa, ya, da), (_, xb, yb, db) in zip(a, b):
        if xa is None or ya is None or da != db or len(xa) != len(xb) or len(ya) != len(yb):
            return False
        x, y = _shape_line(xa, xb, pair, batch), _shape_line(ya, yb, pair, batch)
        if x is None or y is None:
            return False
        out.append((l, x, y, da))
    _put_back(out)
    return True


def _shape_line(a: Tuple[int, ...], b: Tuple[int, ...], pair: Tuple[int, int], batch: int
                ) -> Optional[Tuple[int, ...]]:
    """The sizes at ``batch`` on the lines through ``a`` (at ``pair[0]``) and ``b`` (at ``pair[1]``),
    or ``None`` where one is not a positive integer."""
    sizes = [p + Fraction(q - p, pair[1] - pair[0]) * (batch - pair[0]) for p, q in zip(a, b)]
    if any(s.denominator != 1 or s <= 0 for s in sizes):
        return None
    return tuple(int(s) for s in sizes)


def _line(a: int, b: int, ba: int, bb: int, batch: int) -> int:
    """The value at ``batch`` on the line through ``(ba, a)`` and ``(bb, b)`` (an integer where it is a line of bytes)."""
    return max(0, round(a + Fraction(b - a, bb - ba) * (batch - ba)))


def _per_layer(chains: Sequence[FusedChain], f: Any) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(f(l) for l in c.layers) for c in chains)


def _shapes_agree(planned: PlanInputs, ordered: Sequence[FusedChain]) -> bool:
    """Whether the lines give every layer the conv output / input bytes and MACs its shapes from
    the example batch give (those shapes put back on the layers first)."""
    return (planned.y_bytes == _per_layer(ordered, ChainLayer.y_bytes)
            and planned.x_bytes == _per_layer(ordered, ChainLayer.x_bytes)
            and planned.flops == _per_layer(ordered, ChainLayer.flops)
            and all(l.y_shape is not None for c in ordered for l in c.layers))


def _layer_shapes(converted: nn.Module) -> List[Tuple[ChainLayer, Any, Any, Any]]:
    return [(l, l.x_shape, l.y_shape, l.y_dtype) for c in chains_of(converted) for l in c.layers]


def _put_back(shapes: List[Tuple[ChainLayer, Any, Any, Any]]) -> None:
    for l, x, y, dtype in shapes:
        l.x_shape, l.y_shape, l.y_dtype = x, y, dtype
