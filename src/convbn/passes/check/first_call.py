"""The checks a pass attaches to a rewritten forward when it had no ``example_inputs``.

A :class:`~convbn.passes.graph.graph_module.GraphForward` only runs its graph and falls back;
what it should compare before trusting the graph is attached to it by the pass that installed
it, as two callables this file defines:

* :class:`FirstCallCheck` (``GraphForward.pending``, by ``convert`` and ``fold``): on the first
  call, the original and the rewrite run on copies of the inputs (no grad, state restored)
  and are compared; on a difference, or an error of the rewrite, the module warns and runs
  its original forward from then on.
* :class:`BackwardCheck` (``GraphForward.backward_check``, by ``convert``): Note: [gradients
  checked on the first backward].

Note: [gradients checked on the first backward]
Without ``example_inputs``, the first call compares the rewrite's outputs with the
original's (no grad, state restored). Outputs equal, gradients can still differ (a custom
``autograd.Function``'s hand-written backward lost in a trace). Running a training step of
each inside the user's first call would show the check to everything that call touches
(saved-tensor hooks, the chains' lazy plan, parameter hooks, DDP), so the check waits for
the user's backward instead: a pre-hook on each output's autograd node runs, once, one
seeded training step of the module as it was and as rewritten (``check_step``: outputs,
every gradient through ``torch.autograd.grad``, buffers and RNG restored) on the first two
samples of that call's batch (a full second batch would raise the first step's peak); on a
difference it warns and the module runs its original forward from the next call. The step
being differentiated then has the rewrite's gradients (the warning says so). Not checked
(nothing to compare against without side effects): module or global hooks, parameter
tensor hooks, an initialised process group, a batch of one, inputs eager cannot run sliced.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor, nn
from ..._compat import is_fx_tracing, pytree

from ..graph.graph_module import GraphForward, eager, fused_modules, installed, retypable, retype
from ..graph.hooks import global_hooks, hook_reason
from .validate import (Comparison, StateSnapshot, batch_sample, buffers_set_aside, clone_tensors, compare_outputs,
                       float64_slack, seeded, to_float64)

__all__ = ["FirstCallCheck", "BackwardCheck"]


class FirstCallCheck:
    """The first call of a rewritten forward, compared with the original's (module docstring).

    Set as ``GraphForward.pending``; the forward clears it and calls it once, in place of
    running its graph, and returns what it returns.

    Args:
        tolerance: ``tolerance(dtype)``, the allowed difference per output dtype.

    Example:
        >>> fwd.pending = FirstCallCheck(tolerance)  # doctest: +SKIP
    """

    def __init__(self, tolerance: Callable[[torch.dtype], float]) -> None:
        self.tolerance = tolerance

    def __call__(self, fwd: GraphForward, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        owner = fwd.owner
        if is_fx_tracing():
            # Called for real inside another module's trace (a partial trace runs an untraceable
            # module on its values): torch.fx's patched Module.__call__ is active, so nothing this
            # call shows is the rewrite's own behaviour. The original runs; the check waits for
            # the first call outside a trace.
            return fwd.original(*args, **kwargs)
        with guards_paused(owner):  # guards checked just before: the check's own runs change nothing
            if hooked(owner):
                # hooks may have side effects (collected features, counters): never call them
                # more often than eager would; such models are validated with example_inputs only.
                # A rewrite that raises is no reason to raise: the original runs instead
                try:
                    return fwd.fn(owner, *args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - whatever the rewrite raised, eager's forward decides
                    _fall_back(fwd, f"the rewrite raised {type(exc).__name__}: {_first_line(exc)}")
                    return fwd.original(*args, **kwargs)
            why = self.difference(fwd, args, kwargs)
            if why is None:  # the module itself fails: let it raise as eager would (as compared: no grad)
                with torch.no_grad():
                    return fwd.original(*args, **kwargs)
            if not why:
                fwd.undo = None  # checked: the weights it replaced are no longer needed
                return fwd.run(*args, **kwargs)
            _fall_back(fwd, why)
            return fwd.original(*args, **kwargs)

    def difference(self, fwd: GraphForward, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
        """How the rewrite differs from the original on copies of the inputs (``""``: it does
        not; ``None``: the original itself raised). Learns ``fwd.out_spec`` on the way
        (Note: [outputs keep their container types] in graph_module.py)."""
        owner = fwd.owner
        with torch.no_grad():
            try:
                with StateSnapshot(owner), seeded(0):
                    ref = fwd.original(*clone_tensors(args), **clone_tensors(kwargs))
            except Exception:  # noqa: BLE001 - the module itself fails
                return None
            try:
                with StateSnapshot(owner), seeded(0):
                    out = fwd.fn(owner, *clone_tensors(args), **clone_tensors(kwargs))
                if fwd.out_spec is None and retypable(out, ref):
                    fwd.out_spec = pytree.tree_structure(ref)
                    out = retype(out, fwd.out_spec)
                result = compare_outputs(ref, out, self.tolerance)
                if not result.ok:  # rounding amplified by the model itself? ask a float64 copy (only now)
                    slack = float64_slack(owner, lambda m64: _eager_run64(m64, args, kwargs), ref)
                    if slack is not None:
                        result = compare_outputs(ref, out, self.tolerance, slack=slack)
                return result.describe() if not result.ok else ""
            except Exception as exc:  # noqa: BLE001 - the rewrite fails: fall back
                return f"the rewrite raised {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def _fall_back(fwd: GraphForward, why: str) -> None:
    """The rewrite differed (or raised) on its first call: its module's own forward from now on, one warning."""
    fwd.fallback = True
    fwd.fallback_reason = f"it differed from the original on the first call ({why})"
    warnings.warn(
        f"convbn: the rewritten {type(fwd.owner).__name__} differs from the original on its first call "
        f"({why}); running the original (unfused) forward from now on. Pass example_inputs=... to "
        "convert/fold to validate (and convert finer) up front.",
        RuntimeWarning,
        stacklevel=5,
    )


class BackwardCheck:
    """Note: [gradients checked on the first backward].

    Set as ``GraphForward.backward_check``; the forward calls it after each call it ran
    (``check(fwd, out, args, kwargs)``) until it is cleared: by the check itself (run once),
    or where nothing can be checked.

    Args:
        step: ``step(module, *sample) -> Comparison``, one seeded training step of the module
            as it was and as rewritten (:func:`convbn.passes.check.step.check_step`).

    Example:
        >>> fwd.backward_check = BackwardCheck(check_step)  # doctest: +SKIP
    """

    def __init__(self, step: Callable[..., Comparison]) -> None:
        self.step = step

    def __call__(self, fwd: GraphForward, out: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        owner = fwd.owner
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not owner.training:
            return
        nodes = {id(t.grad_fn): t.grad_fn for t in pytree.tree_leaves(out)
                 if isinstance(t, Tensor) and t.grad_fn is not None}
        if not nodes:
            return
        sample = None if _side_effects(owner) else batch_sample((args, kwargs))
        if sample is None:  # side effects the check would show, or no sample: not checked
            fwd.backward_check = None
            return

        def check(grad_outputs: Any) -> None:
            if fwd.backward_check is None:  # checked already (by this call's or an earlier call's hook)
                return
            run, fwd.backward_check = fwd.backward_check, None
            run.run_once(fwd, sample)

        for node in nodes.values():
            node.register_prehook(check)

    def run_once(self, fwd: GraphForward, sample: Tuple[Any, ...]) -> None:
        """The step on ``sample``, inside the user's backward; on a difference, warn and fall back."""
        owner = fwd.owner
        try:
            # a backward runs its hooks without grad mode; the buffers are swapped for copies:
            # restoring them in place would bump versions this backward's nodes saved
            with torch.enable_grad(), buffers_set_aside(owner), _chain_records_kept(owner), _unwrapped(fwd), \
                    guards_paused(owner):
                result = self.step(owner, *sample)
        except Exception:  # noqa: BLE001 - the original fails on the sample: nothing to compare
            return
        if not result.ok:
            fwd.fallback = True
            fwd.fallback_reason = f"its gradients differed from the original's on the first backward ({result.describe()})"
            warnings.warn(
                f"convbn: the rewritten {type(owner).__name__}'s training step differs from the original's on "
                f"its first backward ({result.describe()}; one training step of each on the first samples of "
                "the batch); this step's outputs, gradients and buffer updates come from the rewrite, and the "
                "original (unfused) forward runs from the next call. Pass example_inputs=... to convert to "
                "validate (and convert finer) up front.",
                RuntimeWarning,
                stacklevel=3,
            )


def _side_effects(owner: nn.Module) -> bool:
    """Whether a training step of ``owner`` inside the user's backward would show: hooks,
    parameter hooks, an initialised process group (Note: [gradients checked on the first backward])."""
    return (hooked(owner)
            or any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in owner.parameters())
            or (torch.distributed.is_available() and torch.distributed.is_initialized()))


def _eager_run64(model64: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    with torch.no_grad(), seeded(0), eager(model64):
        return model64(*to_float64(args), **to_float64(kwargs))


def hooked(owner: nn.Module) -> bool:
    """Whether a check calling ``owner``'s modules again would call hooks eager calls once:
    global module hooks, or hooks on a module under ``owner``."""
    return global_hooks() or any(hook_reason(m) for m in owner.modules() if m is not owner)


@contextlib.contextmanager
def _unwrapped(fwd: GraphForward) -> Iterator[None]:
    """``fwd`` as its owner's ``forward`` for the block, without a wrapper set around it later (an
    accelerate mixed-precision forward re-enters autocast: a check after the forward, in float32 as
    eager's backward runs, would compare low-precision runs)."""
    entry = fwd.owner.__dict__.get("forward")
    fwd.owner.__dict__["forward"] = fwd
    try:
        yield
    finally:
        fwd.owner.__dict__["forward"] = entry


@contextlib.contextmanager
def guards_paused(module: nn.Module) -> Iterator[None]:
    """The guards of every forward installed under ``module`` set aside while a check runs the
    module again, then renewed: the check's own runs (a call counter bumped by the module's own
    forward) are no change of the model."""
    paused = [(f, f.guards) for f in map(installed, module.modules()) if f is not None and f.guards is not None]
    for f, _ in paused:
        f.guards = None
    try:
        yield
    finally:
        for f, g in paused:
            if f.guards is None and installed(f.owner) is f:
                g.refresh()
                f.guards = g


@contextlib.contextmanager
def _chain_records_kept(module: nn.Module) -> Iterator[None]:
    """What the fused chains under ``module`` record per call (each layer's shapes seen, for
    the planner and the report) put back after the block."""
    layers = [l for _, f in fused_modules(module) for l in getattr(f, "layers", ())]
    kept = [(l, dict(vars(l))) for l in layers]
    try:
        yield
    finally:
        for l, fields in kept:
            vars(l).update(fields)
