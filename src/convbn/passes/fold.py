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
    print(folded.fold_report)            # FoldReport: every BatchNorm, folded or why not

The report is attached to the returned module as the attribute ``fold_report`` (it is
not part of ``state_dict``). See :func:`fold` for the full contract.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from .bn_recognise import may_normalise
from .fold_check import EAGER_ERROR_FACTOR, compare_to_reference, float64_errors, reference_run, run_no_grad
from .fold_graph import FoldContext, GraphFolder
from .fold_layers import fold_conv_bn_modules
from .layers import LAYER_MODULES
from .fold_report import FoldCheck, FoldReport
from .outcome import BNOutcome, bn_module_names, unreached
from .graph_module import preserve_module_state
from .trace import LayerTracer, short_reason, trace

__all__ = ["fold", "fold_conv_bn_modules", "FoldReport", "BNOutcome", "FoldCheck"]


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def _is_container_only(m: nn.Module) -> bool:
    return isinstance(m, (nn.ModuleList, nn.ModuleDict))


def fold_module(module: nn.Module, prefix: str, ctx: FoldContext) -> nn.Module:
    """Fold inside ``module`` (qualified name ``prefix``); returns its replacement."""
    if _is_container_only(module):
        fold_children(module, prefix, ctx)
        return module
    try:
        traced = trace(module, LayerTracer)
    except Exception as exc:  # noqa: BLE001 - untraceable: fold its children one by one
        ctx.report.untraceable.append((prefix.rstrip("."), f"{short_reason(exc)} (folded part by part)"))
        fold_children(module, prefix, ctx)
        return module
    gm = traced.gm
    preserve_module_state(module, gm)
    folder = GraphFolder(gm, module, prefix, ctx)
    folder.run()
    changed = folder.changed
    for target, why in traced.descend().items():
        if target not in dict(gm.named_modules()):
            continue
        if target in traced.opaque:
            ctx.report.untraceable.append((prefix + target, f"{why} (kept as an opaque module)"))
        sub = gm.get_submodule(target)
        new = fold_module(sub, f"{prefix}{target}.", ctx)
        if new is not sub:
            parent, _, attr = target.rpartition(".")
            setattr(gm.get_submodule(parent), attr, new)
            changed = True
    return gm if changed else module


def fold_children(module: nn.Module, prefix: str, ctx: FoldContext) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, (_BatchNorm,) + LAYER_MODULES):
            continue  # a lone layer: nothing to fold inside
        if type(child).__module__.startswith("torch.nn.") and not isinstance(
                child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            continue  # a torch leaf (activation, pooling...): nothing to fold inside
        new = fold_module(child, f"{prefix}{name}.", ctx)
        if new is not child:
            setattr(module, name, new)


def _fold_finer(model: nn.Module, args: Tuple[Any, ...], reference: Any, eager_errors: Optional[List[float]],
                why: str) -> Optional[nn.Module]:
    """Where the whole-model fold differs from eager (a trace that misleads in a way no
    hazard check saw), fold each child of a fresh copy on its own -- each validated on the
    inputs it received in an eager run, recursively finer where it differs too -- and keep
    the model's own forward. ``None`` if that is not closer to eager either."""
    work = copy.deepcopy(model)
    inputs: Dict[str, Tuple[Any, ...]] = {}
    handles = []
    for name, child in work.named_children():
        def record(mod: nn.Module, a: Tuple[Any, ...], k: Dict[str, Any], name: str = name) -> None:
            if name not in inputs and not k:
                inputs[name] = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, a)
        handles.append(child.register_forward_pre_hook(record, with_kwargs=True))
    try:
        run_no_grad(work, args)
    finally:
        for h in handles:
            h.remove()
    report = FoldReport()
    report.untraceable.append(("", f"folding the whole model changed its outputs ({why}); folded child by child"))
    for name, child in list(work.named_children()):
        if name not in inputs or not may_normalise(child):
            continue
        try:
            new = fold(child, example_inputs=inputs[name])
        except RuntimeError as exc:  # this child cannot be folded faithfully: keep it as it is
            report.untraceable.append((name, f"left unfolded: {short_reason(exc)}"))
            continue
        sub = new.fold_report
        report.outcomes += [dataclasses.replace(a, batchnorm=f"{name}.{a.batchnorm}",
                                                layer=a.layer and f"{name}.{a.layer}") for a in sub.outcomes]
        report.untraceable += [(f"{name}.{n}" if n else name, w) for n, w in sub.untraceable]
        work._modules[name] = new
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
                  "instead (see fold_report)", RuntimeWarning, stacklevel=3)
    work.fold_report = report
    return work


def fold(
    model: nn.Module,
    *,
    inplace: bool = False,
    example_inputs: Any = None,
    check: bool = True,
) -> nn.Module:
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
        inplace: ``False`` (default) works on a deep copy: ``model`` keeps its parameters
            and outputs. ``True`` reuses ``model``'s submodules and overwrites the weights
            of layers it folds into (less memory); afterwards use only the returned
            module, ``model`` itself no longer computes the same function.
        example_inputs: a tensor or a tuple of positional arguments for ``model``; used
            for the check and to see tensor ranks (needed to fold Linear <-> BatchNorm1d).
            If ``None`` a small input is inferred from the first conv/linear layer when
            possible (the report says when it is not).
        check: run the sample input through the model before and after folding (eval,
            no grad, same RNG seed) and raise if the outputs differ by more than
            ``tol * max(1, max|reference|)`` (``tol`` = 1e-4 for float32, 1e-10 for
            float64, see ``CHECK_TOLERANCE``) plus 4x what the original itself gets wrong
            in its dtype, measured against a float64 run of a copy (see Note: [fold's
            tolerance follows eager's own rounding]).

    Returns:
        The folded model (a ``torch.fx.GraphModule`` when ``model`` traced whole and
        something was folded, else the (copied) model with folded children). Its
        attribute ``fold_report`` is a :class:`FoldReport` listing every BatchNorm.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (or is a TorchScript module).
        ValueError: ``model`` is in training mode.
        RuntimeError: ``check=True`` and the folded model's outputs differ.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).eval()
        >>> folded = fold(net, example_inputs=torch.randn(1, 3, 16, 16))
        >>> print(folded.fold_report)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold() expects a torch.nn.Module, but got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "fold() needs the eager nn.Module, but got a TorchScript module; fold first, then "
            "torch.jit.script the folded model"
        )
    if model.training:
        raise ValueError(
            "fold() folds BatchNorm running statistics, which only define the model's output in "
            "eval mode, but the model is in training mode. Call model.eval() first (a BatchNorm "
            "you deliberately left in training mode inside an eval model is skipped and reported)."
        )
    work = model if inplace else copy.deepcopy(model)
    report = FoldReport()
    ctx = FoldContext(report, inplace, {}, {})
    bn_names = bn_module_names(work)  # before folding removes them

    args, reference, note = (None, None, "")
    if check or example_inputs is not None:
        args, reference, note = reference_run(work, example_inputs, ctx)
    # A float64 copy of the original is run only if the fixed tolerance fails (see Note:
    # [fold's tolerance follows eager's own rounding]); with inplace, copied before folding.
    original = (copy.deepcopy(work) if inplace else model) if check and args is not None else None

    folded = fold_module(work, "", ctx)

    # every BatchNorm module gets an outcome, including ones tracing never reached
    report.outcomes += unreached(bn_names, report.outcomes, [name for name, _ in report.untraceable])

    if check:
        if args is None:
            report.check = FoldCheck(ran=False, note=note)
        else:
            try:
                out = run_no_grad(folded, args)
            except Exception as exc:
                report.check = FoldCheck(ran=True, note=f"folded model failed: {short_reason(exc)}", passed=False)
                finer = None if inplace else _fold_finer(model, args, reference, None, short_reason(exc))
                if finer is not None:
                    return finer
                raise RuntimeError(f"fold(): the folded model fails on the sample input.\n{report}") from exc
            diff, tol, ok, why = compare_to_reference(reference, out)
            eager_errors = None
            if not ok and original is not None:
                eager_errors = float64_errors(original, args, reference)
                if eager_errors is not None:
                    diff, tol, ok, why = compare_to_reference(reference, out, eager_errors)
            if not ok and not inplace:
                finer = _fold_finer(model, args, reference, eager_errors, f"max abs diff {diff:.3g} > {tol:.3g}")
                if finer is not None:
                    return finer
            if eager_errors is not None and any(eager_errors):
                note = "; ".join(x for x in (note, f"allowed includes {EAGER_ERROR_FACTOR:g}x eager's own error vs a "
                                             f"float64 run (max {max(eager_errors):.3g})") if x)
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, Tensor))
            report.check = FoldCheck(True, "; ".join(x for x in (note, why) if x), shapes, diff, tol, ok)
            if not ok:
                raise RuntimeError(
                    "fold(): the folded model's outputs differ from the original's beyond the "
                    f"tolerance (max abs diff {diff:.3g} > {tol:.3g}); this is a bug in convbn, "
                    f"please report it with the model. Use check=False to get the model anyway.\n{report}"
                )
    folded.fold_report = report
    return folded
