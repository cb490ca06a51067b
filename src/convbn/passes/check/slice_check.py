"""convert's whole-model check run on the first samples of a large example batch, and at the
batch itself wherever a slice could see less (Note: [the check on a slice of the batch]).

Note: [the check on a slice of the batch]
``convert(example_inputs=x)`` checks the rewrite with one training step of each side
(:func:`~convbn.passes.check.step.check_step`: outputs, every gradient, the buffers and the RNG
state after it). At the example batch those two steps (and the eager reference's forward
without autograd) were three of the call's seven runs and most of its time (ResNet-50 b8:
2.9 of 4.3 eager steps). What the check asks is whether the rewrite computes what the model
computes; the rewrite's code is the same at every batch where its graph is the same, so on
the CPU, for an example batch of :data:`MIN_BATCH` or more, the two steps run on its first
:data:`SAMPLES` samples (every input whose first dimension is the batch's cut: the
``batch_sample`` the first-backward check already runs on, Note: [gradients checked on the
first backward]). Two samples keep BatchNorm's statistics meaningful (two values per channel
at the least: a normalisation over one sample is refused in training).

The slice stands for the batch only where nothing could make the rewrite at the slice another
computation than at the batch; elsewhere the check runs at the example batch as before:

* a graph traced with real shapes is specialised to its batch (its sizes are constants of the
  graph, and a call with others runs another graph: Note: [a trace with real inputs is
  specialised to their call]): any installed forward under the module guarded on its input
  shapes (``ShapeGuard``) and the check runs at the batch;
* a model that refuses the slice (raises at two samples: a batch size hard-coded in a
  ``view``) is checked at the batch (what it raises there is what the user sees);
* a rewrite that falls back to the module's own forward while the slice runs (a guard failed;
  the slice checked the module's own code, not the rewrite): at the batch;
* a difference at the slice is decided at the batch: the check's verdict is the full-batch
  step's, exactly as before, wherever the slice does not pass. A rewrite is therefore refused
  only where the full-batch check refuses it, and accepted on the slice where the slice's
  step agrees with eager's to the same tolerance (Note: [one tolerance rule]).

What a slice cannot see: code whose result depends on the batch size and that no shape guard
records (a symbolic trace has no shapes: a Python branch on ``x.shape[0]`` fails to trace
there and that module stays unfused, so the graph cannot hold such a branch) and a kernel that
is right at two samples and wrong at more (the Functions' own tests, over shapes and batches,
are where those are caught; on the CPU convbn's own code picks no kernel by the batch size, its
one such choice, cuDNN's batch norm up to a batch size, being CUDA's). On an accelerator the
check keeps the example batch (the same limit as the planner's slices: Note: [measured on two
slices of the batch]).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from torch import Tensor, nn
from ..._compat import pytree

from ..graph.graph_module import installed
from ..graph.shape_capture import Guards, ShapeGuard
from .step import check_step
from .validate import Comparison, batch_sample

__all__ = ["MIN_BATCH", "SAMPLES", "check_on_slice", "slice_for"]

#: the smallest example batch checked on a slice
MIN_BATCH = 8
#: the samples the check's steps run on, where they do
SAMPLES = 2


def _shape_guarded(guard: Any) -> bool:
    if isinstance(guard, ShapeGuard):
        return True
    return isinstance(guard, Guards) and any(_shape_guarded(g) for g in guard.guards)


def slice_for(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
              ) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """The first :data:`SAMPLES` samples of ``(args, kwargs)`` where the check of ``module`` may
    run on them (Note: [the check on a slice of the batch]); ``None``: at the example batch."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    if not tensors or tensors[0].dim() == 0 or tensors[0].shape[0] < MIN_BATCH:
        return None
    if any(t.device.type != "cpu" for t in tensors):
        return None
    if any(fwd is not None and _shape_guarded(fwd.defaults) for fwd in map(installed, module.modules())):
        return None
    cut = batch_sample((args, kwargs), SAMPLES)
    return None if cut is None else (tuple(cut[0]), dict(cut[1]))


def check_on_slice(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Comparison, int]:
    """:func:`check_step` of ``module`` on the first samples of the example batch where that
    stands for the batch, else (or where the slice raises, falls back or differs) at the batch
    (Note: [the check on a slice of the batch]); returns the comparison and the batch it was
    decided at (``0``: inputs without a batch).

    Raises:
        Exception: whatever the eager model raises on the example inputs.
    """
    cut = slice_for(module, args, kwargs)
    if cut is not None:
        forwards = [f for f in map(installed, module.modules()) if f is not None]
        before = [f.fallback for f in forwards]
        try:
            result = check_step(module, *cut)
        except Exception:  # noqa: BLE001 - a model that refuses the slice: checked at its batch
            result = None
        if result is not None and result.ok and [f.fallback for f in forwards] == before:
            return result, SAMPLES
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    batch = int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 0
    return check_step(module, args, kwargs), batch
