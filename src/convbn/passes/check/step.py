"""Checking a rewrite against the model as it was, on the very same module objects.

``convert`` rewrites in place (:mod:`convbn.passes.graph.graph_module`), so the eager model is the
converted one with its installed forwards set aside (:func:`~convbn.passes.graph.graph_module.eager`):
no copy, the same parameters and buffers, both runs from the same state.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor, nn
from ..._compat import pytree

from ..graph.graph_module import eager
from .validate import Comparison, StateSnapshot, compare_outputs, float64_slack, run_step, to_float64, tolerance

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
    and the global RNG state afterwards (Note: [one tolerance rule] in validate.py).

    Raises:
        Exception: whatever the eager model raises on these inputs (the user's inputs are wrong).
    """
    grad_inputs = True
    with eager(module):
        try:
            ref = _step(module, args, kwargs)
        except RuntimeError:
            # inputs made to require grad can break a model eager runs (one that sets
            # requires_grad on a view of its input): as the caller gave them, then
            grad_inputs = False
            ref = _step(module, args, kwargs, grad_inputs=False)
    try:
        new = _step(module, args, kwargs, grad_inputs=grad_inputs)
    except Exception as exc:  # noqa: BLE001 - the rewrite must not fail where eager does not
        return Comparison(False, float("inf"), 0.0, f"the rewrite raised {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}")
    if len(ref[3]) != len(new[3]) or not all(torch.equal(a, b) for a, b in zip(ref[3], new[3])):
        return Comparison(False, float("inf"), 0.0, "the global RNG state after the step differs")
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
