"""Checking a rewrite against the model as it was, on the very same module objects.

``convert`` rewrites in place (:mod:`convbn.passes.graph.graph_module`), so the eager model is the
converted one with its installed forwards set aside (:func:`~convbn.passes.graph.graph_module.eager`):
no copy, the same parameters and buffers, both runs from the same state.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from ..._compat import pytree

from ..graph.graph_module import eager, installed, retypable, retype
from .validate import (Comparison, StateSnapshot, compare_outputs, float64_slack, relative_floor, run_step, to_float64,
                       tolerance)

__all__ = ["check_step", "called_inputs"]


class _Bound:
    """``model`` called with fixed keyword arguments (for :func:`run_step`)."""

    def __init__(self, model: nn.Module, kwargs: Dict[str, Any]) -> None:
        self.model, self.kwargs = model, kwargs

    def __call__(self, *args: Any) -> Any:
        return self.model(*args, **self.kwargs)


def _step(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], grad_inputs: bool = True
          ) -> Tuple[Any, ...]:
    """One training step (seeded forward and backward, random upstream gradient), with state
    restored: outputs, gradients, buffers after it, and the global RNG state after it."""
    params = list(module.parameters())
    rng: List[Tensor] = []
    with StateSnapshot(module):
        out, grads = run_step(_Bound(module, kwargs), args, params, seed=0, rng=rng, grad_inputs=grad_inputs)
        buffers = [b.detach().clone() for b in module.buffers()]
    return out, grads, buffers, rng


def check_step(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Comparison:
    """Run ``module`` as it was (eager) and as rewritten, one training step each, and compare
    outputs, every gradient (parameters, frozen ones excepted, and inputs: made to require
    grad, unless the eager model then fails where it runs on the inputs as given), buffers
    and the global RNG state afterwards (Note: [one tolerance rule] in validate.py). The
    rewrite's gradients are compared as they come (Note: [a check that holds one side's
    gradients]); where that finds a difference, both steps run again and are compared whole,
    with a float64 copy's help where rounding is amplified.

    Raises:
        Exception: whatever the eager model raises on these inputs (the user's inputs are wrong).
    """
    held = [_eager_step(module, args, kwargs)]  # handed over whole: its gradients are let go as the rewrite's come
    grad_inputs = held[0][1]
    result = _streamed(module, args, kwargs, grad_inputs, held)
    if result.ok or result.note.startswith("the rewrite raised"):
        return result
    ref, grad_inputs = _eager_step(module, args, kwargs)
    return _compared_whole(module, args, kwargs, grad_inputs, ref)


def _eager_step(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], bool]:
    """The eager model's step, and whether the inputs were made to require grad."""
    with eager(module):
        try:
            return _step(module, args, kwargs), True
        except RuntimeError:
            # inputs made to require grad can break a model eager runs (one that sets
            # requires_grad on a view of its input): as the caller gave them, then
            return _step(module, args, kwargs, grad_inputs=False), False


# Note: [a check that holds one side's gradients]
# The check's two steps run one after the other, and the first one's results are held while
# the second runs: held whole, the eager step's gradients (the parameters' bytes) sat beside
# the whole of the rewrite's step, and its peak was above a training step's wherever weights
# are a large part of it. The rewrite's step is therefore the training loop's own backward
# (``.backward()``, ``.grad`` set aside and put back, so the chains accumulate their weight
# gradients as in training), and each gradient, the moment it is accumulated, is compared with
# the eager one and both are let go. Outputs, buffers and the RNG state are compared after
# the step. The comparison is the same (each leaf against the same allowance, relative to the
# same floor); where it finds a difference, the whole-tree comparison runs as before. On an
# accelerator the eager step's results wait in host memory (each gradient of the rewrite is
# copied there to be compared), so the device holds one step at a time. On CPU they share
# one memory: while the rewrite's step runs, what is alive is the eager gradients not yet
# compared beside that step (below eager's step where activations outweigh the parameters,
# as at the batch sizes one trains at; BENCHMARKS.md "convert's own cost").


def _streamed(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], grad_inputs: bool,
              held: List[Tuple[Tuple[Any, ...], bool]]) -> Comparison:
    """The rewrite's step against the eager step ``held`` holds (taken out of it: nothing else
    keeps its gradients), its gradients compared and released as they come."""
    ref = held.pop()[0]
    floor = relative_floor(ref[:3])
    ref = _to_host(ref)  # on an accelerator, eager's results wait in host memory
    eager_grads: List[Optional[Tensor]] = ref[1]
    worst = [Comparison(True)]

    def on_grad(i: int, grad: Tensor) -> None:
        expected, eager_grads[i] = eager_grads[i], None
        found = (Comparison(False, math.inf, 0.0, "gradients differ: one where eager has none") if expected is None
                 else compare_outputs(expected, grad.to(expected.device), tolerance, relative=True, floor=floor))
        worst[0] = _worse(worst[0], found)

    rng: List[Tensor] = []
    try:
        with StateSnapshot(module):
            out, grads = run_step(_Bound(module, kwargs), args, list(module.parameters()), seed=0, rng=rng,
                                  grad_inputs=grad_inputs, on_grad=on_grad)
            buffers = [b.detach().clone() for b in module.buffers()]
    except Exception as exc:  # noqa: BLE001 - the rewrite must not fail where eager does not
        return Comparison(False, float("inf"), 0.0, f"the rewrite raised {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}")
    if len(ref[3]) != len(rng) or not all(torch.equal(a, b) for a, b in zip(ref[3], rng)):
        return Comparison(False, float("inf"), 0.0, "the global RNG state after the step differs")
    out = _in_its_structure(module, out, ref[0])
    if grads and len(grads) != len(eager_grads):
        return Comparison(False, float("inf"), 0.0, "the gradients differ in number")
    rest = compare_outputs((ref[0], eager_grads, ref[2]), _to_host((out, grads or [None] * len(eager_grads), buffers)),
                           tolerance, relative=True, floor=floor)
    return _worse(worst[0], rest)


def _in_its_structure(module: nn.Module, out: Any, ref: Any) -> Any:
    """The rewrite's output ``out`` in the eager output's container types where only they differ,
    the rewrite learning them for its later calls (Note: [outputs keep their container types]
    in graph_module.py; the first-call check learns them the same way)."""
    fwd = installed(module)
    if fwd is None or fwd.out_spec is not None or not retypable(out, ref):
        return out
    fwd.out_spec = pytree.tree_structure(ref)
    return retype(out, fwd.out_spec)


def _to_host(tree: Any) -> Any:
    """``tree`` with its tensors on an accelerator copied to host memory (a CPU tensor stays itself):
    what one side of the check holds while the other runs takes none of the device's memory."""
    return pytree.tree_map(lambda t: t.to("cpu") if isinstance(t, Tensor) and t.device.type != "cpu" else t, tree)


def _worse(a: Comparison, b: Comparison) -> Comparison:
    """The comparison further from its allowance (a failed one with a reason first)."""
    def ratio(c: Comparison) -> float:
        if not c.ok and (c.note or c.allowed <= 0):
            return math.inf
        return c.max_abs_diff / c.allowed if c.allowed > 0 else 0.0

    return b if ratio(b) > ratio(a) else a


def _compared_whole(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], grad_inputs: bool,
                    ref: Tuple[Any, ...]) -> Comparison:
    """The rewrite's step held whole and compared with ``ref`` (and, where that fails, with
    the allowance a float64 copy of the eager step gives)."""
    try:
        new = _step(module, args, kwargs, grad_inputs=grad_inputs)
    except Exception as exc:  # noqa: BLE001 - the rewrite must not fail where eager does not
        return Comparison(False, float("inf"), 0.0, f"the rewrite raised {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}")
    if len(ref[3]) != len(new[3]) or not all(torch.equal(a, b) for a, b in zip(ref[3], new[3])):
        return Comparison(False, float("inf"), 0.0, "the global RNG state after the step differs")
    new = (_in_its_structure(module, new[0], ref[0]), *new[1:])
    result = compare_outputs(ref[:3], new[:3], tolerance, relative=True)
    if not result.ok:  # rounding amplified by the model itself? ask a float64 copy (costly: only now)
        def run64(model64: nn.Module) -> Any:
            with eager(model64):
                return _step(model64, to_float64(args), to_float64(kwargs))[:3]

        slack = float64_slack(module, run64, ref[:3])
        if slack is not None:
            result = compare_outputs(ref[:3], new[:3], tolerance, slack=slack, relative=True)
    if not result.ok:
        result = Comparison(False, result.max_abs_diff, result.allowed, f"{_what_differs(ref, new)}: {result.describe()}")
    return result


def _what_differs(ref: Tuple[Any, ...], new: Tuple[Any, ...]) -> str:
    """Which of a step's results differ, in words (outputs, gradients, buffers)."""
    parts = [what for what, i in (("outputs", 0), ("gradients", 1),
                                  ("buffers (running statistics / num_batches_tracked)", 2))
             if not compare_outputs(ref[i], new[i], tolerance, relative=True).ok]
    return " and ".join(parts) + " differ" if parts else "the step differs"


def called_inputs(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                  ) -> Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """The inputs of every module under ``module`` at its first call in one eager forward
    (state restored), by ``id``: however the parent reaches it (called, iterated, indexed,
    through ``_modules``)."""
    seen: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]] = {}
    clone = lambda t: t.detach().clone() if isinstance(t, Tensor) else t  # noqa: E731

    def record(mod: nn.Module, a: Tuple[Any, ...], k: Dict[str, Any]) -> None:
        if id(mod) not in seen:
            seen[id(mod)] = (tuple(pytree.tree_map(clone, a)), pytree.tree_map(clone, k))

    handles: List[Any] = [m.register_forward_pre_hook(record, with_kwargs=True) for m in module.modules() if m is not module]
    try:
        with StateSnapshot(module), torch.no_grad(), eager(module):
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen
