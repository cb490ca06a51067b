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

from ..graph.graph_module import eager
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
    gradients]); where one differs, it is kept and judged again with the allowance a float64
    copy of the eager step gives (rounding amplified by the model itself).

    Raises:
        Exception: whatever the eager model raises on these inputs (the user's inputs are wrong).
    """
    held = [_eager_step(module, args, kwargs)]  # handed over whole: its gradients are let go as the rewrite's come
    return _streamed(module, args, kwargs, held[0][1], held)


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
# same floor); a gradient beyond float32's allowance is kept, with eager's, and judged again
# with the allowance a float64 copy of the eager step gives, as the whole tree was. On an
# accelerator the eager step's results wait in host memory (each gradient of the rewrite is
# copied there to be compared), so the device holds one step at a time. On CPU they share
# one memory: while the rewrite's step runs, what is alive is the eager gradients not yet
# compared beside that step (below eager's step where activations outweigh the parameters,
# as at the batch sizes one trains at; BENCHMARKS.md "convert's own cost").


def _streamed(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], grad_inputs: bool,
              held: List[Tuple[Tuple[Any, ...], bool]]) -> Comparison:
    """The rewrite's step against the eager step ``held`` holds (taken out of it: nothing else
    keeps its gradients), its gradients compared and released as they come; those that differ
    kept for :func:`_with_float64_slack`."""
    ref = held.pop()[0]
    floor = relative_floor(ref[:3])
    ref = _to_host(ref)  # on an accelerator, eager's results wait in host memory
    eager_grads: List[Optional[Tensor]] = ref[1]
    worst = [Comparison(True)]
    differing: Dict[int, Tuple[Tensor, Tensor]] = {}

    def on_grad(i: int, grad: Tensor) -> None:
        expected, eager_grads[i] = eager_grads[i], None
        if expected is None:
            worst[0] = _worse(worst[0], Comparison(False, math.inf, 0.0, "gradients differ: one where eager has none"))
            return
        grad = grad.to(expected.device)
        found = compare_outputs(expected, grad, tolerance, relative=True, floor=floor)
        if found.ok or found.note:
            worst[0] = _worse(worst[0], found)
        else:  # beyond float32's allowance: judged again below, with a float64 copy's
            differing[i] = (expected, grad.detach().clone())

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
    if grads and len(grads) != len(eager_grads):
        return Comparison(False, float("inf"), 0.0, "the gradients differ in number")
    new = _to_host((out, grads or [None] * len(eager_grads), buffers))
    rest = compare_outputs((ref[0], eager_grads, ref[2]), new, tolerance, relative=True, floor=floor)
    if (rest.ok and not differing) or rest.note or (not worst[0].ok and worst[0].note):
        return _worse(worst[0], rest)
    return _worse(worst[0], _with_float64_slack(module, args, kwargs, grad_inputs, (ref[0], ref[2]),
                                                (new[0], new[2]), differing, floor))


def _with_float64_slack(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], grad_inputs: bool,
                        eager_rest: Tuple[Any, Any], new_rest: Tuple[Any, Any],
                        differing: Dict[int, Tuple[Tensor, Tensor]], floor: float) -> Comparison:
    """Outputs, buffers and the gradients that differed judged again with the allowance of
    Note: [one tolerance rule] (eager's own distance to a float64 copy of its step): rounding
    the model itself amplifies is not a difference of the rewrite."""
    order = sorted(differing)
    eager_tree = (eager_rest[0], [differing[i][0] for i in order], eager_rest[1])
    new_tree = (new_rest[0], [differing[i][1] for i in order], new_rest[1])

    def run64(model64: nn.Module) -> Any:
        with eager(model64):
            out, grads, buffers, _ = _step(model64, to_float64(args), to_float64(kwargs), grad_inputs=grad_inputs)
        return out, [grads[i] for i in order], buffers

    slack = float64_slack(module, run64, eager_tree)
    result = compare_outputs(eager_tree, new_tree, tolerance, slack=slack, relative=True, floor=floor)
    if result.ok:
        return result
    parts = [what for what, i in (("outputs", 0), ("gradients", 1), ("buffers (running statistics / num_batches_tracked)", 2))
             if not compare_outputs(eager_tree[i], new_tree[i], tolerance, relative=True, floor=floor).ok]
    what = " and ".join(parts) + " differ" if parts else "the step differs"
    return Comparison(False, result.max_abs_diff, result.allowed, f"{what}: {result.describe()}")


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
