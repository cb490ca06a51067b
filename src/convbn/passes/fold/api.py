"""``convbn.fold``: fold eval-mode BatchNorm into neighbouring conv / linear layers (FX pass).

For inference a BatchNorm with running statistics is a per-channel affine map, so it can
be absorbed by the linear layer next to it (the maths lives in
:mod:`convbn.functional.fold`; this file only finds the patterns and does the graph
surgery):

* ``Conv{1,2,3}d -> BN``, ``ConvTranspose{1,2,3}d -> BN`` (any ``groups``) and
  ``Linear -> BatchNorm1d`` fold into the *preceding* layer (always exact);
* ``BN -> Conv`` / ``BN -> Linear`` fold into the *following* layer where that is exact
  (see Note: [folding into the following conv]).

Layers may be modules (``nn.Conv2d``...) or functional calls (``F.conv2d(x, self.weight)``
as in ``efficientnet_pytorch``), BatchNorms may be any ``_BatchNorm`` subclass
(``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, user subclasses) or ``F.batch_norm`` /
``torch.batch_norm`` calls with constant running statistics and ``training=False``.

Public API::

    folded = convbn.fold(model)          # model must be in eval mode
    print(folded.convbn_report)          # FoldReport: every BatchNorm, folded or why not

The report is attached to the returned module as the attribute ``convbn_report``, the
name ``convert``'s report has too (it is not part of ``state_dict``). See :func:`fold` for the full contract.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Set, Tuple, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..bn.recognise import may_normalise
from .fold_check import (compare_to_reference, float64_errors, float64_fold_error, output_jump, reference_run,
                         run_no_grad)
from .folder import FoldContext
from .stages import fold_graph
from .layers import fold_conv_bn_modules
from ..graph.layers import LAYER_MODULES
from ..graph.model_copy import model_copy
from ..report.attached import attach_report, detach_report
from ..report.fold_report import FoldCheck, FoldReport
from ..report.outcome import BNOutcome, bn_module_names, explain_ghost_loops, frozen_lookalikes, unreached
from ..check.first_call import FirstCallCheck
from ..check.step import called_inputs
from ..graph.graph_module import forget_undo, install, installed
from ..graph.meta import meta_tensor
from ..graph.transaction import transaction
from ..graph.scripted import reject_torchscript
from ..check.validate import tolerance, tolerance_rule
from ..tracing.self_check import warn_if_tracer_broken
from ..tracing.example_trace import trace_example_call
from .generic import own_code_joins_a_batchnorm
from ..tracing.trace import LayerTracer, short_reason, trace

__all__ = ["fold", "fold_conv_bn_modules", "FoldReport", "BNOutcome", "FoldCheck"]

#: The model's type: :func:`fold` returns the class it was given (a rewritten module keeps its class).
M = TypeVar("M", bound=nn.Module)


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def _shape_trace(module: nn.Module, ctx: FoldContext) -> Any:
    """``module`` traced with the real shapes of its inputs in the sample run (Python code on
    shapes takes eager's branch; its optional arguments as that call passes them, Note: [a trace
    with real inputs is specialised to their call]; the graph is guarded on them), or ``None``."""
    example = (ctx.called or {}).get(id(module))
    if example is None:
        return None
    try:
        return trace_example_call(module, example)
    except Exception:  # noqa: BLE001 - not traceable even so
        return None


def fold_module(module: nn.Module, prefix: str, ctx: FoldContext, done: Set[int]) -> bool:
    """Fold inside ``module`` (qualified name ``prefix``), in place: a traced module whose
    graph changed runs it as its forward (:func:`convbn.passes.graph.graph_module.install`), keeping
    its class and its place; an untraceable one keeps its forward and is folded inside, in
    every module it calls, however it reaches them. Returns whether anything changed."""
    if id(module) in done:
        return False
    done.add(id(module))
    if type(module).forward is nn.Module.forward and "forward" not in module.__dict__:  # a container
        return fold_children(module, prefix, ctx, done)
    try:
        traced = trace(module, LayerTracer)
        if traced.opaque_layers(module):  # Note: [opaque children traced again with real shapes] (convert/api.py)
            again = _shape_trace(module, ctx)
            if again is not None and len(again.opaque_layers(module)) < len(traced.opaque_layers(module)):
                traced = again
    except Exception as exc:  # noqa: BLE001 - with real shapes where known, else its children one by one
        traced = _shape_trace(module, ctx)
        if traced is None:
            ctx.report.untraced.append((prefix.rstrip("."), f"{short_reason(exc)} (folded part by part)"))
            warn_if_tracer_broken("fold")  # Note: [a tracer that fails everywhere says so]
            return fold_children(module, prefix, ctx, done)
        if not own_code_joins_a_batchnorm(traced.gm, module, prefix):  # Note: [fold prefers the shape-generic graph]
            ctx.report.untraced.append((prefix.rstrip("."), f"{short_reason(exc)} (traced only with its real shapes; "
                                        "folded part by part, so that its own code stays shape-generic)"))
            return fold_children(module, prefix, ctx, done)
    gm = traced.gm
    mark = len(ctx.report.outcomes)
    changed = fold_graph(gm, module, prefix, ctx)
    if changed:
        fwd = install(module, gm, register_new=True)
        fwd.defaults = traced.guard()  # the calls the graph applies to (defaults kept, traced shapes)
        _neutralise_folded(module, gm, prefix, ctx.report.outcomes[mark:], fwd)
    for target, why in traced.descend().items():
        if target in traced.opaque:
            ctx.report.untraced.append((prefix + target, f"{why} (kept as an opaque module)"))
        try:
            sub = module.get_submodule(target)
        except AttributeError:
            continue
        changed = fold_module(sub, f"{prefix}{target}.", ctx, done) or changed
    return changed


# Note: [a folded BatchNorm becomes its tail in its slot]
# Folding rewrites in place: the layer a BatchNorm folded into takes its folded weights in
# its own slot (``install``), so a path that does not run the rewritten graph -- a parent
# iterating an ``nn.Sequential`` of conv, BN, act, or a block's own forward -- calls the
# folded layer too. For that path to stay right the BatchNorm's slot holds what is left of
# it: ``nn.Identity`` (or, for a norm-act module, its tail). Where the fold made a fresh copy
# of the layer (the original is also used elsewhere), the original layer and the
# BatchNorm stay as they are. ``eager`` and a failed first-call check put both back.
def _neutralise_folded(module: nn.Module, gm: Any, prefix: str, outcomes: List[BNOutcome], fwd: Any) -> None:
    for o in outcomes:
        if o.result != "folded" or o.reason or not o.batchnorm.startswith(prefix):
            continue
        path = o.batchnorm[len(prefix):]
        parent_path, _, name = path.rpartition(".")
        try:
            parent = module.get_submodule(parent_path)
        except AttributeError:
            continue
        bn = parent._modules.get(name)
        if bn is None:
            continue
        try:
            left = gm.get_submodule(path)
        except AttributeError:
            left = None
        if not isinstance(bn, _BatchNorm) and not (left is not None and left is not bn) and any(bn.children()):
            continue  # a module computing more than the batch norm (its class path keeps it)
        new = left if isinstance(left, nn.Module) and left is not bn else nn.Identity()
        fwd.undo.append((parent, name, "_modules", bn))
        parent._modules[name] = new


def fold_children(module: nn.Module, prefix: str, ctx: FoldContext, done: Set[int]) -> bool:
    changed = False
    for name, child in list(module.named_children()):
        if isinstance(child, (_BatchNorm,) + LAYER_MODULES):
            continue  # a lone layer: nothing to fold inside
        if type(child).__module__.startswith("torch.nn.") and not any(True for _ in child.children()):
            continue  # a torch leaf (activation, pooling...): nothing to fold inside
        changed = fold_module(child, f"{prefix}{name}.", ctx, done) or changed
    return changed


def _fold_finer(model: nn.Module, args: Tuple[Any, ...], reference: Any, eager_errors: Optional[List[float]],
                why: str) -> Optional[nn.Module]:
    """Where the whole-model fold differs from eager (a trace that misleads in a way no
    hazard check saw), fold, in a fresh copy, each outermost module called inside on its own
    -- each validated on the inputs it received in an eager run, recursively finer where it
    differs too, however the parent reaches it -- and keep the model's own forward. ``None``
    if that is not closer to eager either."""
    try:
        work = model_copy(model)
    except Exception:  # noqa: BLE001 - a model that refuses copying: the whole-model result stands
        return None
    inputs = called_inputs(work, args, {})
    report = FoldReport()
    report.untraced.append(("", f"folding the whole model changed its outputs ({why}); folded child by child"))

    def finer(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            if id(child) not in inputs or inputs[id(child)][1]:
                finer(child, f"{prefix}{name}.")
                continue
            if not may_normalise(child):
                continue
            try:
                new = fold(child, example_inputs=inputs[id(child)][0])
            except RuntimeError as exc:  # this part cannot be folded faithfully: keep it as it is
                report.untraced.append((prefix + name, f"left unfolded: {short_reason(exc)}"))
                continue
            module._modules[name] = new  # the folded copy of the same class, in the child's place
            sub = detach_report(new)
            report.outcomes += [dataclasses.replace(a, batchnorm=f"{prefix}{name}.{a.batchnorm}",
                                                    layer=a.layer and f"{prefix}{name}.{a.layer}") for a in sub.outcomes]
            report.untraced += [(f"{prefix}{name}.{n}" if n else prefix + name, w) for n, w in sub.untraced]

    finer(work, "")
    seen = {a.batchnorm for a in report.outcomes}
    for bn_name, m in work.named_modules():
        if isinstance(m, _BatchNorm) and bn_name not in seen:
            report.leave(bn_name, "called by the model's own forward, which is kept")
    out = run_no_grad(work, args)
    diff, tol, ok, note = compare_to_reference(reference, out, eager_errors)
    shapes = tuple(tuple(a.shape) for a in args if isinstance(a, Tensor))
    report.check = FoldCheck(True, note, shapes, diff, tol, ok)
    if not ok or not report.folded:  # nothing gained: report the whole-model failure instead
        return None
    warnings.warn(f"fold(): folding the whole model changed its outputs ({why}); folded it child by child "
                  "instead (see convbn_report)", RuntimeWarning, stacklevel=6)  # fold's caller: see _fold_model
    forget_undo(work)
    attach_report(work, report)
    return work


def fold(  # over 60 lines for its public docstring (Args, Returns, Raises, Example); the body is ~10
    model: M,
    *,
    inplace: bool = False,
    example_inputs: Any = None,
    check: bool = True,
) -> M:
    """Fold every foldable eval-mode BatchNorm of ``model`` into a neighbouring layer.

    ``model`` is traced with ``torch.fx`` (nested ``Sequential``\\ s and wrapper modules are
    flattened). Each BatchNorm is folded into the conv / conv-transpose / linear layer
    before it (``W' = s W``, ``b' = s (b - mu) + beta`` with ``s = gamma / sqrt(var + eps)``)
    or, where exact, into the conv / linear after it; otherwise it stays and the report
    says why. Never folded: BatchNorms in training mode or without running statistics, a
    layer whose output is also used elsewhere, a following conv with zero padding. A layer
    that is called more than once is folded into a fresh copy for the BN's call only.
    Submodules that cannot be traced are kept as they are and folded inside on their own
    (the whole model too, child by child, if its own ``forward`` cannot be traced).

    Args:
        model: the network, in eval mode (``model.eval()``).
        inplace: as in :func:`convbn.convert`: ``True`` rewrites ``model``'s own module
            objects, overwriting the weights of layers it folds into (less memory), and
            returns ``model``: use only the result afterwards. ``False`` (default) leaves
            ``model`` as it was and folds new module objects of the same classes, which own
            copies of every tensor (a model to deploy: training ``model`` further leaves it
            as it is).
        example_inputs: a tensor or a tuple of positional arguments for ``model``; used
            for the check and to see tensor ranks (needed to fold Linear <-> BatchNorm1d).
            If ``None`` a small input is inferred from the first conv/linear layer when
            possible (the report says when it is not).
        check: run ``example_inputs`` (or the inferred input) through the model before
            and after folding (eval, no grad, same RNG seed); where the outputs differ by more than
            ``tol * max(1, max|reference|)`` (``tol`` = 1e-4 for float32, 1e-10 for
            float64) plus 4x what the original itself gets wrong in its dtype, measured
            against a float64 run of a copy: the check allows what float rounding of the
            unfolded model already allows, and no more, (or the folded model raises) the
            model is returned as it was, every BatchNorm reported left with the reason, and a
            ``RuntimeWarning`` says so.

    Returns:
        The folded model, of ``model``'s type (``model``'s deep copy, or ``model`` itself
        with ``inplace``): every module keeps its class, and the rewritten ones run folded
        forwards. Its attribute ``convbn_report`` (the name :func:`convbn.convert` uses too)
        is a :class:`FoldReport` listing every BatchNorm.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (or is a TorchScript module).
        ValueError: ``model`` is in training mode, or a parameter or buffer is on the meta device.
        TypeError: the model cannot be copied (``inplace=False``); the message names ``inplace=True``.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).eval()
        >>> folded = fold(net, example_inputs=torch.randn(1, 3, 16, 16))
        >>> print(folded.convbn_report)  # doctest: +SKIP
    """
    _check_model(model)
    try:
        with transaction(model):  # Note: [a failed pass changes nothing]
            return _fold_model(model, inplace, example_inputs, check)
    except CheckFailed as failed:  # Note: [a check that fails leaves the model as it was]
        return _left_as_it_was(model, inplace, failed)


class CheckFailed(Exception):
    """fold's check found the folded model wrong: caught by :func:`fold`, never seen by the user.

    Args:
        why: what the check found (and what to do about it).
        check: the check's record, for the report.
    """

    def __init__(self, why: str, check: Optional[FoldCheck]) -> None:
        super().__init__(why)
        self.why = why
        self.check = check


# Note: [a check that fails leaves the model as it was]
# fold's check compares the folded model with the original on the sample input. Where it
# differs (or the folded model raises, or the model's own outputs jump on last-bit changes so
# nothing can be compared) and folding child by child is no closer either, fold does not raise:
# the transaction puts an in-place model back, and fold returns the model as it was (a copy,
# without inplace), every BatchNorm reported left with the check's finding as the reason, and
# one RuntimeWarning saying the same and what to do (check=False, other example_inputs).


def _left_as_it_was(model: nn.Module, inplace: bool, failed: CheckFailed) -> nn.Module:
    """The model unfolded, its report saying why (Note: [a check that fails leaves the model as it was])."""
    out = model if inplace else _copy_to_fold(model)
    report = FoldReport()
    report.check = failed.check
    reason = f"fold's check: {failed.why}; left unfolded"
    report.outcomes = [BNOutcome(names[0], "left", reason=reason) for names in bn_module_names(out)]
    attach_report(out, report)
    warnings.warn(f"convbn.fold: {failed.why}; the model is returned unfolded.", RuntimeWarning, stacklevel=3)
    return out


def _check_model(model: Any) -> None:
    """Raise unless ``model`` is an eager ``nn.Module`` in eval mode."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold() expects a torch.nn.Module, but got {type(model).__name__}")
    reject_torchscript(model, "fold")
    on_meta = meta_tensor(model)
    if on_meta is not None:
        raise ValueError(
            f"fold() folds the model's weights and running statistics, but {on_meta!r} is on the meta device "
            f"(shapes without values). Materialise the model first (model.to_empty(device=...), then its "
            f"initialisation or model.load_state_dict(...)) and call fold() on it.")
    if model.training:
        raise ValueError(
            "fold() folds BatchNorm running statistics, which only define the model's output in "
            "eval mode, but the model is in training mode. Call model.eval() first (a BatchNorm "
            "you deliberately left in training mode inside an eval model is skipped and reported)."
        )


# Note: [fold's stages]
# fold() runs prepare (its arguments to a FoldRun), then FOLD_STAGES in order, each taking
# the FoldRun the one before returned:
#   prepare       the module to fold (a copy unless inplace), a reference run on the sample
#                 input (it records BatchNorm input / Linear output ranks) and each module's inputs;
#   fold_graphs   every module traced (trace) and folded by the graph folder's own stages
#                 (canonicalise -> match -> fold -> tidy: GRAPH_STAGES in stages.py), recursively
#                 into what tracing could not see into;
#   account       every BatchNorm module gets an outcome, those tracing never reached too;
#   check_folded  the folded model against the reference (or child by child where the whole
#                 differs), then the report attached.
@dataclass
class FoldRun:
    """One fold in progress: what each of :data:`FOLD_STAGES` hands the next."""

    model: nn.Module  # the user's model
    work: nn.Module  # the module being folded (``model`` itself with ``inplace``)
    inplace: bool
    check: bool
    ctx: FoldContext
    bn_names: List[str]  # the BatchNorm modules' names before folding removes them
    lookalikes: List[BNOutcome]  # modules holding a frozen BatchNorm's buffers, not recognised as one
    args: Optional[Tuple[Any, ...]] = None  # the sample input, when one was found
    reference: Any = None  # the unfolded model's output on it
    note: str = ""
    original: Optional[nn.Module] = None  # the unfolded model, for the float64 fallbacks of the check
    folded: Optional[nn.Module] = None  # the result, once checked

    @property
    def report(self) -> FoldReport:
        return self.ctx.report


def _copy_to_fold(model: nn.Module) -> nn.Module:
    """The copy ``fold(inplace=False)`` folds (:func:`model_copy`), or a ``TypeError`` naming
    ``inplace=True`` where the model cannot be copied."""
    try:
        return model_copy(model)
    except Exception as exc:  # noqa: BLE001 - whatever refuses the copy, the same remedy
        raise TypeError(
            f"convbn.fold(model) folds a copy of the model, and copying this {type(model).__name__} failed "
            f"({short_reason(exc)}); fold the model itself with convbn.fold(model, inplace=True)") from exc


def prepare(model: nn.Module, inplace: bool, example_inputs: Any, check: bool) -> FoldRun:
    """The module to fold, the reference run on the sample input and each module's inputs."""
    work = model if inplace else _copy_to_fold(model)
    run = FoldRun(model, work, inplace, check, FoldContext(FoldReport(), inplace, {}, {}),
                  bn_module_names(work), frozen_lookalikes(work))
    if check or example_inputs is not None:
        run.args, run.reference, run.note = reference_run(work, example_inputs, run.ctx)
    # A float64 copy of the original is run only if the fixed tolerance fails (see Note:
    # [fold's tolerance follows eager's own rounding]); with inplace, copied before folding.
    if check and run.args is not None:
        try:
            run.original = model_copy(work) if inplace else model
        except Exception:  # noqa: BLE001 - a model that refuses copying: the float64 fallback is not tried
            run.original = None
    if run.args is not None:  # each module's inputs, for a trace with real shapes where fx fails
        try:
            run.ctx.called = {**called_inputs(work, run.args, {}), id(work): (run.args, {})}
        except Exception:  # noqa: BLE001 - the check reports what the model raises
            run.ctx.called = None
    return run


def fold_graphs(run: FoldRun) -> FoldRun:
    """Trace and fold every module (:func:`fold_module`); unchecked, each rewritten module
    checks itself on its first call."""
    fold_module(run.work, "", run.ctx, set())
    # not with inplace, whose folded weights overwrote the original's (its "original" forward
    # would compute neither)
    if (not run.check or run.args is None) and not run.inplace:
        for m in run.work.modules():
            fwd = installed(m)
            if fwd is not None:
                fwd.pending = FirstCallCheck(tolerance)
    return run


def account(run: FoldRun) -> FoldRun:
    """Every BatchNorm module gets an outcome, including ones tracing never reached."""
    report = run.report
    report.outcomes += unreached(run.bn_names, report.outcomes, [name for name, _ in report.untraced])
    named = {o.batchnorm for o in report.outcomes}
    report.outcomes += [o for o in run.lookalikes if o.batchnorm not in named]
    report.outcomes = explain_ghost_loops(run.model, report.outcomes)
    return run


def check_folded(run: FoldRun) -> FoldRun:
    """Compare the folded model to the reference (:func:`_checked`), then attach the report to
    the result: the folded model, or its child-by-child fold where the whole one differs."""
    if run.check and run.args is None:
        run.report.check = FoldCheck(ran=False, note=run.note)
    finer = _checked(run) if run.check and run.args is not None else None
    if finer is not None:
        return dataclasses.replace(run, folded=finer)  # _fold_finer attached its own report
    forget_undo(run.work)
    attach_report(run.work, run.report)
    return dataclasses.replace(run, folded=run.work)


def _checked(run: FoldRun) -> Optional[nn.Module]:
    """:class:`CheckFailed` if the folded model's outputs differ from the reference beyond the tolerance;
    the child-by-child fold where that is closer to eager, else ``None`` (the check recorded)."""
    args, report = run.args, run.report
    try:
        out = run_no_grad(run.work, args)
    except Exception as exc:
        report.check = FoldCheck(ran=True, note=f"folded model failed: {short_reason(exc)}", passed=False)
        finer = None if run.inplace else _fold_finer(run.model, args, run.reference, None, short_reason(exc))
        if finer is not None:
            return finer
        raise CheckFailed(f"the folded model fails on the sample input ({short_reason(exc)})", report.check) from exc
    diff, tol, ok, why, eager_errors = _verdict(run, out)
    if not ok and not run.inplace:
        finer = _fold_finer(run.model, args, run.reference, eager_errors, f"max abs diff {diff:.3g} > {tol:.3g}")
        if finer is not None:
            return finer
    note = run.note
    if eager_errors is not None and any(eager_errors):
        note = "; ".join(x for x in (note, f"allowed includes {tolerance_rule('fold').eager_error_factor:g}x eager's own "
                                     f"error vs a "
                                     f"float64 run (max {max(eager_errors):.3g})") if x)
    shapes = tuple(tuple(a.shape) for a in args if isinstance(a, Tensor))
    report.check = FoldCheck(True, "; ".join(x for x in (note, why) if x), shapes, diff, tol, ok)
    if not ok:
        _raise_differs(run, diff, tol)
    return None


def _verdict(run: FoldRun, out: Any) -> Tuple[float, float, bool, str, Optional[List[float]]]:
    """``(max abs diff, allowed, ok, why, eager's own errors)`` of the folded output ``out``: the
    fixed tolerance, then what eager itself gets wrong, then the fold redone in float64."""
    diff, tol, ok, why = compare_to_reference(run.reference, out)
    eager_errors, original = None, run.original
    if not ok and original is not None:
        eager_errors = float64_errors(original, run.args, run.reference)
        if eager_errors is not None:
            diff, tol, ok, why = compare_to_reference(run.reference, out, eager_errors)
    if not ok and original is not None:  # Note: [a fold checked in float64] in fold_check.py
        # inplace on the float64 copy: no first-call check that could fall back to the original
        err64 = float64_fold_error(original, run.args, lambda m, a: fold(m, inplace=True, example_inputs=a, check=False))
        if err64 is not None and err64 <= tolerance(torch.float64, "fold"):
            ok = True
            why = (f"float32 outputs differ by {diff:.3g} (> {tol:.3g}): rounding the model amplifies; folded "
                   f"in float64 it equals the float64 original (max relative difference {err64:.2g})")
    return diff, tol, ok, why, eager_errors


def _raise_differs(run: FoldRun, diff: float, tol: float) -> None:
    """The error for a folded model whose outputs differ: the model's own jumps, or a bug."""
    jump = output_jump(run.original, run.args, run.reference) if run.original is not None else None
    if jump is not None:  # Note: [a model that jumps on last-bit changes] in fold_check.py
        raise CheckFailed(
            f"cannot check the fold on these inputs: the model's own outputs jump on last-bit "
            f"changes (moving its input by {jump[0]:.1g}, relative, moves the original's outputs by "
            f"{jump[1]:.3g} > {jump[2]:.3g}), as a top-k, argmax, sort or threshold over near-tied values "
            f"does; folding changes rounding, so the folded outputs jump too (max abs diff {diff:.3g} > "
            f"{tol:.3g}). This says nothing about the fold itself. Pass example_inputs=... away from such "
            f"ties (real data rather than random or constant tensors), or check=False to get the folded "
            f"model unchecked", run.report.check)
    raise CheckFailed(
        "the folded model's outputs differ from the original's beyond the "
        f"tolerance (max abs diff {diff:.3g} > {tol:.3g}), which is a bug in convbn: "
        "please report it with the model", run.report.check)


#: fold's stages after :func:`prepare`, in order (see Note: [fold's stages]).
FOLD_STAGES: Tuple[Callable[[FoldRun], FoldRun], ...] = (fold_graphs, account, check_folded)


def _fold_model(model: nn.Module, inplace: bool, example_inputs: Any, check: bool) -> nn.Module:
    """:func:`fold` once its arguments are checked: :func:`prepare`, then :data:`FOLD_STAGES`."""
    run = prepare(model, inplace, example_inputs, check)
    for stage in FOLD_STAGES:
        run = stage(run)
    return run.folded
