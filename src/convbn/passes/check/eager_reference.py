"""The eager side of convert's whole-model check, computed within one eager training step's peak.

Note: [the eager reference within a training step's peak]
``check_step`` compares the rewrite's training step with eager's: outputs, every gradient, the
buffers after the step and the RNG state after it. Taken from one eager step run under a
snapshot, that step held, at its peak, what a training step does not: the step's outputs (kept
to be compared; a training loop lets them go once the loss is taken) and a copy of every
buffer (to put the running statistics back), so ``convert(example_inputs=x)`` peaked that much
above the training step it prepares (ResNet-18 b16: 64000 + 38560 bytes). The reference is
therefore taken in two runs, each at most a training step's peak:

1. the gradients: a training step whose outputs are let go once their upstream gradient is
   attached (the backward starts from ``sum((out * upstream).sum())``, whose gradient for each
   output is the upstream gradient itself, bit for bit), with the model's ``torch.nn``
   BatchNorms computing as ever but writing no statistics (Note: [the check's eager gradients
   with the statistics unwritten] in quiet_norms.py); once the forward is done, the snapshots'
   copies of those BatchNorms' buffers are lent for the backward where the buffers still hold
   the copies' bits (one that other code wrote in the forward, a parent's ``F.batch_norm`` on
   them, keeps its copies: Note: [copies lent while a step cannot write them] in
   buffer_copies.py). Only the gradients and what the backward drew
   from the RNG are kept;
2. the outputs and the buffers after the step: one training-mode forward without autograd,
   under a snapshot, drawing the same random numbers: its peak is an inference forward's.

The gradients, outputs, buffers and RNG states are eager's, as one step gives them (the same
kernels on the same values); the comparison with the rewrite is unchanged. The cost is one
forward without autograd more. A model whose outputs are complex keeps its outputs through the
backward (no real scalar to start it from), as before.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .backward_aside import backward_grads, holds_reentrant_checkpoint
from .buffer_copies import copies_lent
from .quiet_norms import statistics_unwritten
from .upstream import handed_once
from .validate import StateSnapshot, run_step, seeded, step_forward, upstream_gradients

__all__ = ["Bound", "eager_reference"]


class Bound:
    """``model`` called with fixed keyword arguments (for :func:`run_step`)."""

    def __init__(self, model: nn.Module, kwargs: Dict[str, Any]) -> None:
        self.model, self.kwargs = model, kwargs

    def __call__(self, *args: Any) -> Any:
        return self.model(*args, **self.kwargs)


def eager_reference(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], grad_inputs: bool = True
                    ) -> Optional[Tuple[Any, List[Optional[Tensor]], List[Tensor], List[Tensor]]]:
    """One seeded training step of ``module`` as it runs now, state restored: ``(outputs,
    gradients, buffers after the step, RNG states after it)``, as ``run_step`` under a snapshot
    gives them, taken in two runs that each peak within a training step (Note: [the eager
    reference within a training step's peak]). ``None`` where the step's backward writes
    buffers or runs a quietened BatchNorm (a checkpoint recomputing its block: eager's step
    writes its statistics there too): the caller takes eager's step whole.

    Raises:
        Exception: whatever the model raises on these inputs.
    """
    params = list(module.parameters())
    if any(type(p.data) is not Tensor for p in params):
        return None  # Note: [a reference in two runs needs plain parameters]
    got = _gradients(Bound(module, kwargs), module, args, params, grad_inputs)
    if got is None:
        return None
    grads, drawn = got
    rng: List[Tensor] = []
    with StateSnapshot(module), torch.no_grad():
        out, _ = run_step(Bound(module, kwargs), args, params, seed=0, rng=rng, grad_inputs=grad_inputs)
        buffers = [b.detach().clone() for b in module.buffers()]
    return out, grads, buffers, rng + drawn


# Note: [a reference in two runs needs plain parameters]
# The two runs give eager's step only where a forward without autograd computes what the
# training forward computed. Parameters of a tensor subclass come with code of their own around
# every call (FSDP2's DTensor parameters: hooks that all-gather before the forward and register
# the gradient reduction for the backward, which run otherwise without autograd): on an
# FSDP2-sharded model the no-grad forward's results were not the training step's ("a non-tensor
# output changed"), so there the caller takes eager's step whole, as before the two runs
# (tests/test_fsdp2.py, shard then convert with example_inputs).


def _gradients(call: Bound, module: nn.Module, args: Tuple[Any, ...], params: Sequence[Tensor], grad_inputs: bool
               ) -> Optional[Tuple[List[Optional[Tensor]], List[Tensor]]]:
    """The step's gradients and the RNG states its backward drew, nothing else held at its peak;
    ``None`` where its backward wrote a buffer or ran a quietened BatchNorm."""
    with StateSnapshot(module), statistics_unwritten(module) as quiet:
        out, outs, wrt = step_forward(call, args, params, seed=0, grad_inputs=grad_inputs)
        if not outs or not wrt or not torch.is_grad_enabled():
            return [], []
        reads, versions = quiet.flag.reads, [(b, b._version) for b in module.buffers()]
        start, ups = _start(outs, upstream_gradients(outs, seed=0))
        del out, outs
        handles: List[Any] = []
        if ups:  # complex outputs: the outputs themselves, each upstream gradient let go once used
            ups, handles = handed_once(start, ups)
        try:
            with copies_lent(quiet.buffers), seeded(2) as drawn:  # run_step's backward seed
                if holds_reentrant_checkpoint(start):  # Note: [a check's backward through a reentrant checkpoint]
                    grads = backward_grads(start, wrt, ups or [torch.ones_like(start[0])], params)
                else:
                    grads = torch.autograd.grad(start, wrt, ups or None, allow_unused=True)
                states = drawn.states()
        finally:
            for h in handles:
                h.remove()
        if quiet.flag.reads != reads or any(b._version != v for b, v in versions):
            return None  # the backward moved statistics: a forward without autograd would not
    return list(grads), states


def _start(outs: List[Tensor], ups: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
    """Where the backward starts, and its upstream gradients: one real scalar whose gradient for
    each output is that output's upstream gradient (the outputs are not held by it: ``mul``
    keeps the other factor), none needed; complex outputs: the outputs and their gradients."""
    if any(o.is_complex() for o in outs):
        return outs, ups
    loss = (outs[0] * ups[0]).sum()
    for o, u in zip(outs[1:], ups[1:]):
        loss = loss + (o * u).sum()
    ups.clear()
    return [loss], []
