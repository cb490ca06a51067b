"""Checking a rewrite against the model as it was, on the very same module objects.

``convert`` rewrites in place (:mod:`convbn.passes.graph.graph_module`), so the eager model is the
converted one with its installed forwards set aside (:func:`~convbn.passes.graph.graph_module.eager`):
no copy, the same parameters and buffers, both runs from the same state.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from ..._compat import pytree

from ..graph.graph_module import eager, installed, retypable, retype
from .eager_reference import Bound, eager_reference
from .first_call import guards_paused
from .validate import (Comparison, StateSnapshot, compare_outputs, eager_error_slack, relative_floor, run_step,
                       to_float64, tolerance)

__all__ = ["check_step", "called_inputs"]


def _step(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], grad_inputs: bool = True
          ) -> Tuple[Any, ...]:
    """One training step (seeded forward and backward, random upstream gradient), with state
    restored: outputs, gradients, buffers after it, and the global RNG state after it."""
    params = list(module.parameters())
    rng: List[Tensor] = []
    with StateSnapshot(module):
        out, grads = run_step(Bound(module, kwargs), args, params, seed=0, rng=rng, grad_inputs=grad_inputs)
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
    return _compared_whole(module, args, kwargs, [_eager_step(module, args, kwargs)])


def _eager_step(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], bool]:
    """The eager model's step (taken within a training step's peak: Note: [the eager reference
    within a training step's peak] in eager_reference.py), and whether the inputs were made to
    require grad."""
    with eager(module):
        try:
            return eager_reference(module, args, kwargs) or _step(module, args, kwargs), True
        except RuntimeError:
            # inputs made to require grad can break a model eager runs (one that sets
            # requires_grad on a view of its input): as the caller gave them, then
            return (eager_reference(module, args, kwargs, grad_inputs=False)
                    or _step(module, args, kwargs, grad_inputs=False)), False


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
            out, grads = run_step(Bound(module, kwargs), args, list(module.parameters()), seed=0, rng=rng,
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


def _compared_whole(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                    held: List[Tuple[Tuple[Any, ...], bool]]) -> Comparison:
    """The rewrite's step held whole and compared with the eager step ``held`` holds (taken out of
    it); where they differ, decided in float64 (Note: [a float32 difference decided in float64])."""
    ref, grad_inputs = held.pop()
    try:
        new = _step(module, args, kwargs, grad_inputs=grad_inputs)
    except Exception as exc:  # noqa: BLE001 - the rewrite must not fail where eager does not
        return Comparison(False, float("inf"), 0.0, f"the rewrite raised {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}")
    if len(ref[3]) != len(new[3]) or not all(torch.equal(a, b) for a, b in zip(ref[3], new[3])):
        return Comparison(False, float("inf"), 0.0, "the global RNG state after the step differs")
    new = (_in_its_structure(module, new[0], ref[0]), *new[1:])
    result = compare_outputs(ref[:3], new[:3], tolerance, relative=True)
    if result.ok:
        return result
    found = Comparison(False, result.max_abs_diff, result.allowed, f"{_what_differs(ref, new)}: {result.describe()}")
    pair = [(ref[:3], new[:3])]
    del ref, new
    return _decided_in_float64(module, args, kwargs, pair, found)


# Note: [a float32 difference decided in float64]
# A rewrite reorders rounding; a model can amplify rounding (a training-mode BatchNorm over a
# few nearly equal values divides it by their spread, a gradient that is a large cancellation
# keeps only the rounding), so a float32 difference beyond the allowance does not say that the
# rewrite computes something else. A float64 copy of the model decides: first the allowance
# grows by what eager's own float32 step gets wrong against eager's float64 step (the second
# term of Note: [one tolerance rule]); where that is not enough, the rewrite's float64 step is
# compared with eager's float64 step at float64's tolerance, and a rewrite equal to eager there
# differs in float32 by rounding only and passes. A real error (a wrong formula) is as wrong in
# float64 and stays refused. The float64 rewrite must be seen to run: its forwards' checks and
# guards are set aside on the copy, and a float64 step bit-identical to eager's, or one whose
# rewrite fell back, decides nothing (the float32 difference stands). Memory: the float32 steps'
# results are let go before the rewrite's float64 step, which is compared as it comes (Note: [a
# check that holds one side's gradients]), so the float64 copy, eager's float64 step and what
# it holds are the most alive at once, as with the eager-error allowance alone before. What this
# cannot see: a fast path wrong in float32 only (a kernel of its own for that dtype) and right in
# float64, where float32 differs beyond the allowance; the Functions' float32 tests against eager
# are where such a path is caught.


def _decided_in_float64(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                        pair: List[Tuple[Any, Any]], found: Comparison) -> Comparison:
    """``found`` (the float32 steps ``pair`` holds differ) decided with a float64 copy of ``module``:
    Note: [a float32 difference decided in float64]."""
    ref, new = pair[0]
    args64, kwargs64 = to_float64(args), to_float64(kwargs)
    try:
        model64 = copy.deepcopy(module).double()
        held64 = [_eager_step(model64, args64, kwargs64)]
    except Exception:  # noqa: BLE001 - no float64 copy runs: the float32 difference stands
        return found
    slack = eager_error_slack(ref, held64[0][0][:3])
    if slack is not None and compare_outputs(ref, new, tolerance, slack=slack, relative=True).ok:
        return Comparison(True, found.max_abs_diff, found.allowed)
    del ref, new
    pair.clear()
    for fwd in filter(None, map(installed, model64.modules())):
        fwd.pending = fwd.backward_check = None  # the copy's rewrite runs as it is, unchecked
    with guards_paused(model64):
        same = _streamed(model64, args64, kwargs64, held64[0][1], held64)
    ran = not any(f.fallback for f in filter(None, map(installed, model64.modules())))
    if not same.ok:
        why = f"in float64 too: {same.describe()}"
    elif not ran or same.max_abs_diff == 0:  # eager's step both times, or the copy's rewrite fell back
        why = "not decided in float64: the rewrite did not run on a float64 copy"
    else:
        return Comparison(True, found.max_abs_diff, found.allowed)
    return Comparison(False, found.max_abs_diff, found.allowed, f"{found.describe()} ({why})")


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
