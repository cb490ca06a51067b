"""fold()'s numerical check: sample inputs (given or inferred), a reference run, and the
comparison whose tolerance follows eager's own rounding."""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from ..._compat import pytree

from .folder import FoldContext
from ..graph.layers import LAYER_MODULES
from ..tracing.trace import short_reason
from ..check.validate import as_args, clone_tensors, compare_outputs, seeded, to_float64, tolerance_rule

__all__ = ["output_jump", "compare_to_reference"]


# Note: [what "exact" means for the check]
# Folding changes the order of floating point operations, nothing else, so folded and
# unfolded outputs agree to rounding. The check in ``fold(check=True)`` allows, per
# floating output tensor, ``max|folded - reference| <= tol * max(1, max|reference|)`` with
# ``tol`` the ``"fold"`` row of validate.py's one table (Note: [one tolerance rule]).


# --------------------------------------------------------------------------------------
# Sample inputs and the check
# --------------------------------------------------------------------------------------


def candidate_inputs(model: nn.Module) -> Iterator[Tuple[Tensor, ...]]:
    first = next((m for m in model.modules() if isinstance(m, LAYER_MODULES)), None)
    if first is None:
        return
    w = first.weight
    gen = torch.Generator(device=w.device).manual_seed(0)  # the global stream is the user's
    if isinstance(first, nn.Linear):
        yield (torch.randn(2, first.in_features, dtype=w.dtype, device=w.device, generator=gen),)
        return
    dims = w.dim() - 2
    sizes = {1: (64, 128, 32), 2: (32, 64, 28, 224), 3: (32, 16, 64)}[dims]
    for s in sizes:
        yield (torch.randn(2, first.in_channels, *([s] * dims), dtype=w.dtype, device=w.device, generator=gen),)


def run_no_grad(model: nn.Module, args: Tuple[Any, ...]) -> Any:
    """``model(*args)`` without grad, with a fixed RNG seed (so dropout left in training
    mode draws the same masks twice), on copies of the inputs (the model may modify them
    in place) and without changing the buffers of modules in training mode."""
    args = clone_tensors(args)
    saved = [(b, b.clone()) for m in model.modules() if m.training for b in m.buffers(recurse=False)]
    try:
        with torch.no_grad(), seeded(0):
            return model(*args)
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def reference_run(model: nn.Module, example_inputs: Any, ctx: FoldContext) -> Tuple[Optional[Tuple[Any, ...]], Any, str]:
    """Run ``model`` once on a sample input, recording BN input / Linear output ranks.

    Returns ``(args, output, note)``; ``args`` is None when no input could be found."""
    handles = []

    def record(store: Dict[int, Set[int]], use_output: bool):
        def hook(mod: nn.Module, inputs: Tuple[Any, ...], output: Any) -> None:
            t = output if use_output else (inputs[0] if inputs else None)
            if isinstance(t, Tensor):
                store.setdefault(id(mod), set()).add(t.dim())
        return hook

    for m in model.modules():
        if isinstance(m, _BatchNorm):
            handles.append(m.register_forward_hook(record(ctx.bn_input_ranks, False)))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(record(ctx.linear_out_ranks, True)))
    try:
        if example_inputs is not None:
            args = as_args(example_inputs)
            out = run_no_grad(model, args)
            return args, out, ""
        tried = []
        for args in candidate_inputs(model):
            try:
                out = run_no_grad(model, args)
            except Exception as exc:  # noqa: BLE001 - wrong guess, try the next one
                tried.append(f"{tuple(args[0].shape)} ({short_reason(exc)[:60]})")
                ctx.bn_input_ranks.clear()
                ctx.linear_out_ranks.clear()
                continue
            return args, out, f"inferred input {tuple(args[0].shape)}"
        note = "could not infer a sample input"
        if tried:
            note += " (tried " + ", ".join(tried) + ")"
        return None, None, note + "; pass example_inputs=... to fold() to check the result"
    finally:
        for h in handles:
            h.remove()


def float64_errors(model: nn.Module, args: Tuple[Any, ...], reference: Any) -> Optional[List[float]]:
    """Per floating output of ``reference`` (the model's own run), ``max|reference - exact|``
    where ``exact`` is a float64 run of a copy of ``model`` on the same inputs: what eager
    itself gets wrong in its dtype. ``None`` if the model does not run in float64."""
    leaves = [t for t in pytree.tree_leaves(reference) if isinstance(t, Tensor) and t.is_floating_point()]
    if all(t.dtype == torch.float64 for t in leaves):
        return [0.0] * len(leaves)
    try:
        model64 = copy.deepcopy(model).double()
        args64 = to_float64(args)
        exact = [t for t in pytree.tree_leaves(run_no_grad(model64, args64)) if isinstance(t, Tensor) and t.is_floating_point()]
    except Exception:  # noqa: BLE001 - e.g. a kernel without float64: fall back to the fixed tolerance
        return None
    if len(exact) != len(leaves):
        return None
    errs = []
    for a, e in zip(leaves, exact):
        finite = torch.isfinite(a) & torch.isfinite(e)
        errs.append((a.double() - e)[finite].abs().max().item() if finite.any() else 0.0)
    return errs


def float64_fold_error(model: nn.Module, args: Tuple[Any, ...],
                       fold_fn: Callable[[nn.Module, Tuple[Any, ...]], nn.Module]) -> Optional[float]:
    """``max|fold(model64) - model64|`` over the floating outputs, relative to ``max(1, |ref|)``,
    on float64 copies of ``model`` and ``args`` (``fold_fn(model64, args64)`` folds without
    checking); ``None`` where either does not run in float64.

    Note: [a fold checked in float64]
    Some models turn rounding into jumps: RT-DETR's decoder picks its queries by a top-k of
    scores, so a fold that changes the last bit of a near-tied score picks another query,
    and the float32 outputs differ by far more than any rounding slack (0.25 of 73). That
    says nothing about the fold; a float64 fold does: folding is exact algebra, so in
    float64 the folded model equals the float64 original to ~1e-15, while a wrong fold
    stays wrong in every dtype.
    """
    try:
        model64 = copy.deepcopy(model).double()
        args64 = to_float64(args)
        ref = run_no_grad(model64, args64)
        out = run_no_grad(fold_fn(model64, args64), args64)
    except Exception:  # noqa: BLE001 - no float64 run: no verdict
        return None
    a = [t for t in pytree.tree_leaves(ref) if isinstance(t, Tensor) and t.is_floating_point()]
    b = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point()]
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    # indices, masks, counts: equal, or the float64 fold does not confirm anything
    ints = [[t for t in pytree.tree_leaves(o) if isinstance(t, Tensor) and not t.is_floating_point()] for o in (ref, out)]
    if len(ints[0]) != len(ints[1]) or not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(*ints)):
        return math.inf
    errs = [((x - y).abs().max().item() / max(1.0, x.abs().max().item())) if x.numel() else 0.0 for x, y in zip(a, b)]
    return max(errs, default=0.0)


# Note: [fold's tolerance follows eager's own rounding]
# A fixed relative tolerance is tighter than float32 itself on deep nets: folding only
# reorders rounding, but eager's float32 result is already off the exact one by an amount
# that grows with depth and with the BN scales. So the check runs the *original* once more
# in float64 and allows, per output, ``tol * max(1, max|ref|)`` plus the rule's
# ``eager_error_factor`` times eager's own distance to that float64 result: a fold as
# accurate as eager differs from eager by at most twice it; a wrong fold differs by far more.


def compare_to_reference(reference: Any, folded: Any, eager_errors: Optional[List[float]] = None) -> Tuple[float, float, bool, str]:
    """``(max abs difference, allowed, ok, why not)`` of ``folded`` against ``reference`` under
    the ``"fold"`` rule (``eager_errors``: :func:`float64_errors`, for the rule's second term)."""
    rule = tolerance_rule("fold")
    slack = None if eager_errors is None else [rule.eager_error_factor * e for e in eager_errors]
    result = compare_outputs(reference, folded, rule, slack)
    return result.max_abs_diff, result.allowed, result.ok, result.note


def output_jump(model: nn.Module, args: Tuple[Any, ...], reference: Any, tries: int = 4) -> Optional[Tuple[float, float, float]]:
    """Whether ``model``'s outputs jump when its floating inputs move by the size of rounding:
    ``(relative input change, max abs output change, allowed)`` of the first change beyond the
    check's tolerance, or ``None`` (smooth at ``args``, or no floating input to move).

    Note: [a model that jumps on last-bit changes]
    A top-k, argmax, sort or threshold over near-tied values turns a last-bit difference into
    a different pick, so a fold -- which only changes rounding -- changes such a model's
    outputs by far more than any tolerance, and where the values are tied exactly (two paths
    computing the same number) a float64 fold flips them too (Note: [a fold checked in
    float64] cannot confirm it). Before fold reports a failed check as its own error it asks
    the original model: moved by a few units in the last place of its input (four seeded
    tries), do its outputs move beyond the tolerance? Then the check cannot tell a wrong fold
    from the model's own jumps on these inputs, and the error says so and what to do.
    """
    leaves, spec = pytree.tree_flatten(args)
    if not any(isinstance(t, Tensor) and t.is_floating_point() for t in leaves):
        return None
    gen = torch.Generator().manual_seed(0)
    for _ in range(tries):
        moved = []
        rel = 0.0
        for t in leaves:
            if isinstance(t, Tensor) and t.is_floating_point():
                rel = 4 * torch.finfo(t.dtype).eps
                sign = torch.randint(0, 2, t.shape, generator=gen).to(t.device, t.dtype) * 2 - 1
                t = t * (1 + rel * sign)
            moved.append(t)
        try:
            out = run_no_grad(model, pytree.tree_unflatten(moved, spec))
        except Exception:  # noqa: BLE001 - the model fails on a moved input: no verdict
            return None
        diff, tol, ok, _ = compare_to_reference(reference, out)
        if not ok:
            return rel, diff, tol
    return None
