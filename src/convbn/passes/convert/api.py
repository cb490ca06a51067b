"""``convbn.convert``: one call turns a CNN into a memory-lean training model.

The pass traces the model with ``torch.fx``, finds every Conv -> BatchNorm (-> activation)
in the data flow, groups consecutive ones into chains, and replaces each chain by a
:class:`convbn.nn.chain.FusedChain` call. The model's own modules stay registered
where they were (the chains only reference them), so parameters, buffers and
``state_dict()`` are the very same objects and keys.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple, TypeVar

import torch
from torch import nn

from ...functional.deprecation import module_aliases
from ...functional.strategies import ConvertStrategy
from ...memory.budget import parse_memory, resident_bytes, usable_bytes
from ...progress import check_progress, progress_scope, stage
from ..check.slice_check import check_on_slice
from ..check.step import called_inputs
from ..check.validate import StateSnapshot, as_args
from ..graph.meta import meta_tensor
from ..graph.graph_module import eager, forget_undo, installed, uninstall
from ..graph.share_copy import share_copy
from ..graph.transaction import transaction
from ..plan.auto_plan import measure_peak, measure_saved, plan_auto
from ..plan.chain_plans import lazy_plan, recompute_all
from ..plan.first_call_peak import peak_above_eager
from ..plan.plan_inputs import chains_of
from ..report.convert_report import ConvertReport
from ..tracing.mode_answers import mode_answers
from ..report.outcome import explain_ghost_loops, frozen_lookalikes, norm_module_names, unreached
from .args import check_args, example_inputs_named
from .saved_plan import (ConvertPlan, as_plan, chain_plans, figures_of, plan_key, plan_value, replace_figures,
                         restore_shapes)
from .pipeline import Conversion, arm_guards, convert_module, dedupe, defer_until_materialised
from .rewrite import swap_sync_batchnorm

__all__ = ["convert", "explain", "check_args"]

#: The model's type: :func:`convert` returns the class it was given (a rewritten module keeps its class).
M = TypeVar("M", bound=nn.Module)


def _validated_convert(module: nn.Module, prefix: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                       conv: Conversion) -> None:
    """:func:`~convbn.passes.convert.pipeline.convert_module`, then run ``module`` as it was
    (:func:`eager`) and as converted on the inputs and compare (:func:`convbn.passes.check.step.check_step`: outputs, every gradient,
    buffers, the RNG state afterwards; on the first samples of a large batch where they stand for
    it: :func:`convbn.passes.check.slice_check.check_on_slice`). On a mismatch, undo and convert finer: each module
    called inside (recorded from an eager run, however the parent reaches it), each
    validated the same way."""
    if id(module) in conv.done:
        return
    mark = conv.mark()
    convert_module(module, prefix, conv)
    if not any(installed(m) is not None for m in module.modules()):
        return
    name = prefix.rstrip(".")
    why = conv.reuse.check(name) if conv.reuse is not None else None  # Note: [a conversion made once]
    if why is None:
        stage(f"check {name or 'the model'}: one training step, converted against eager")
        if conv.mode == "auto":  # Note: [the check runs the plan that keeps least]
            for c in chains_of(module):
                c.apply_plan(recompute_all(c))
        result, at = check_on_slice(module, args, kwargs)  # Note: [the check on a slice of the batch]
        why = "" if result.ok else result.describe()
        if not why:  # a refused rewrite is undone: its layers' shapes are not the planner's
            conv.checked_at.append(at)
    conv.checks.append((name, why))
    if not why:
        conv.report.validated.append(name)
        return
    conv.rollback(mark)
    uninstall(module)
    _forget(module, conv)
    conv.report.untraced.append((name, f"the traced rewrite differs from eager ({why}); converted part by part"))
    conv.done.add(id(module))
    inputs = called_inputs(module, args, kwargs)
    _finer(module, prefix, inputs, conv)


# Note: [the check runs the plan that keeps least]
# Under ``"auto"`` the plan is made after the check (the planner measures the checked rewrite),
# so the check's step runs every chain recomputing its convolutions: the plan whose backward does
# the most (every layer's input rebuilt and its convolution run again) and whose step keeps the
# least. While it runs, the eager step's gradients not yet compared are alive beside it (Note:
# [a check that holds one side's gradients] in check/step.py); keeping least leaves the most
# room for them under eager's own peak. The planner then gives every chain its plan.


def _forget(module: nn.Module, conv: Conversion) -> None:
    for m in module.modules():
        conv.done.discard(id(m))


def _finer(module: nn.Module, prefix: str, inputs: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]],
           conv: Conversion) -> None:
    """Convert, each on its own inputs, the outermost modules under ``module`` that were called."""
    for name, child in module.named_children():
        if id(child) in inputs:
            _validated_convert(child, f"{prefix}{name}.", *inputs[id(child)], conv)
        else:  # a container the parent iterates, indexes or walks: look inside
            _finer(child, f"{prefix}{name}.", inputs, conv)


def convert(
    model: M,
    *,
    strategy: ConvertStrategy = "auto",
    memory_budget: Optional[float] = None,
    example_inputs: Any = None,
    inplace: bool = False,
    chain: bool = True,
    peak_budget: Optional[float] = None,
    memory_limit: Any = None,
    progress: Optional[bool] = None,
    plan: Any = None,
    time_budget: Optional[float] = None,
) -> M:
    """Fuse every Conv -> BatchNorm (-> activation) of ``model`` for memory-lean training.

    The result computes the same outputs, gradients and running statistics as
    ``model``; its parameters and buffers are ``model``'s own objects (an optimizer
    built before conversion keeps working) and its ``state_dict()`` has the same keys.

    Args:
        model: any ``nn.Module``. Traced with ``torch.fx``; when the whole model cannot be
            traced, each child is converted instead (recursively).
        strategy: a :data:`convbn.ConvertStrategy`: ``"auto"`` (plan per layer), ``"recompute_bn"`` (every layer keeps its
            conv output; element-wise recompute only) or ``"recompute_conv"`` (keep no
            layer's conv output; with ``chain=False`` this is the tutorial's method).
        memory_budget: with ``"auto"``, the target *saved* activation bytes (held from
            forward to backward, parameters excluded) as a fraction of the eager model's
            (e.g. ``0.35``): the plan recomputes least within it. ``None`` plans for the
            step's *peak* alone: the least recompute among plans whose predicted peak is
            within 8 % of the lowest reachable, whatever their saved bytes, and a lower
            peak within that where a byte of it costs at most 16 MAC-equivalents of
            recompute, or the chains' convolution work over the lowest peak where that is
            more (recompute is counted as MACs plus bytes moved plus a cost per call;
            :func:`explain` shows predicted and measured peaks; without ``example_inputs``
            each chain keeps the tutorial method's saved bytes).
            Needs ``example_inputs``. A budget below the reachable floor raises
            ``ValueError`` naming the floor.
        peak_budget: with ``"auto"``, the training step's *peak* memory allowed, as a fraction
            of the eager model's peak measured on ``example_inputs`` (one step, gradients set
            to None first, parameters not counted, as :func:`explain` measures it): the least
            recompute whose predicted peak fits. Needs ``example_inputs``. Where no plan
            reaches it, the plan with the lowest reachable peak, with a warning (the report's
            ``target_peak_bytes`` / ``lowest_peak_bytes`` say so too). With ``memory_budget``
            too, both are limits: the least recompute meeting both, or, where no plan within
            the saved bytes reaches the peak, the lowest peak reached within them.
        memory_limit: with ``"auto"``, the memory the training step may use in all on the
            model's device, in bytes or as text (``"16GiB"``, :func:`convbn.memory.parse_memory`):
            the parameters and buffers plus the step's peak on ``example_inputs`` (the peak
            as :func:`convbn.timeline` measures it, weight gradients included; on CUDA the
            limit less a 10 % margin for allocator fragmentation). The plan
            is the least recompute whose predicted peak fits; where none fits, the lowest
            peak, with a warning. Optimizer state is not known here: subtract it, or use
            :func:`convbn.max_batch` (which does). Needs ``example_inputs``.
        time_budget: with ``"auto"``, the training step's *time* allowed, as a ratio of the
            unconverted model's step time on ``example_inputs`` (``1.05``: at most 5 % slower):
            the plan with the lowest predicted peak whose predicted step time fits (less a
            1 % margin). Step times are predicted from costs measured once, in this call, on
            the device at hand: the unconverted step, the converted step keeping every conv
            output and one forward of each fused convolution (a plan's time is the second plus
            the convolutions it runs again); the report has them (``step_costs``) and the
            prediction (``predicted_time_ratio``). Where no plan fits, the fastest, with a
            warning. Not with ``peak_budget`` / ``memory_limit``; with ``memory_budget`` both
            are limits. Needs ``example_inputs``. The ratio is of uncompiled steps, also when
            the converted model is compiled afterwards (``explain --frontier`` measures the
            compiled rows side by side).
        example_inputs: a tensor or tuple of inputs. The result is *validated* on them:
            the original and the rewrite each run one forward and one backward (random
            upstream gradient) and outputs, gradients and running statistics are compared;
            where a part differs (a trace that misleads), that part is converted finer,
            child by child, and the report says so. Also used to measure and plan. Running
            stats, ``num_batches_tracked``, RNG and modes are restored exactly afterwards.
            The call's memory peaks within one eager training step's peak on these inputs
            on the CPU where activations make most of the step (on CUDA about 1.14x of it on
            torchvision ResNets: docs/guides/training-loop.md); its time
            is a few eager steps (on the CPU, for a batch of 8 or more, the check's steps run on
            its first two samples where they stand for it, a difference there decided at the
            full batch: about 1.3 and 2.2 eager steps on ResNet-18 b16 and ResNet-50 b8). Without it, each rewritten part validates its outputs against the original on
            its first call (a mismatch warns and runs that part unfused from then on), and
            ``"auto"`` plans each chain on its first training call.
        inplace: as in :func:`convbn.fold`: ``True`` rewrites ``model``'s own module objects
            (they keep their classes and identity and get the fused forwards) and returns
            ``model``; ``False`` (default) leaves ``model`` as it was and rewrites new module
            objects of the same classes, which share ``model``'s parameters, buffers and
            other tensors (convert changes none; an optimizer built on ``model`` trains the
            result).
        chain: group consecutive fused layers into chains (one autograd Function per chain,
            which rebuilds a layer's input from the layer before; ``False``: one per layer).
        progress: print a line per stage (trace, check, plan) on stderr: ``None`` where
            stderr is a terminal (or where an enclosing call prints), ``True`` always,
            ``False`` never.
        plan: what an earlier ``convert`` of the same model with the same ``example_inputs``
            (shapes and dtypes) and options decided: its ``convbn_report.plan`` (a
            :class:`convbn.ConvertPlan`) or that plan's ``as_dict()`` as a checkpoint stores it.
            The model is traced and rewritten as always, and the checks' results and each
            chain's plan are taken from ``plan`` instead of running the model (after a resume:
            the same conversion in a fraction of the time). A plan made for another model,
            other inputs or options warns and converts from scratch. Needs ``example_inputs``.

    Hooks and parametrizations: a conv, BatchNorm or
    activation module with hooks (including old-style ``weight_norm`` / ``spectral_norm`` and
    pruning) is left unfused and reported; hooks registered later are honoured at call time
    (the affected chain, or the affected part of the model, then runs as eager modules).

    Returns:
        The converted model, of ``model``'s type, with the report in ``.convbn_report``:
        ``model`` itself with ``inplace``, else its share-copy; every module keeps its class,
        and the rewritten ones run fused forwards (:func:`convbn.fused_modules` lists the
        chains added).

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> fast = convert(net)
        >>> fast[0].weight is net[0].weight
        True
    """
    check_args(model, strategy, memory_budget, example_inputs, peak_budget, memory_limit, time_budget)
    given = None if plan is None else as_plan(plan)
    if given is not None and example_inputs is None:
        raise ValueError("plan needs example_inputs: it holds what convert decided on them (pass the same shapes)")
    check_progress(progress)
    options = dict(strategy=strategy, memory_budget=memory_budget, peak_budget=peak_budget,
                   memory_limit=memory_limit, chain=chain, time_budget=time_budget)
    with progress_scope("convert", progress), transaction(model):  # Note: [a failed pass changes nothing]
        return _convert_model(model, example_inputs, inplace, options, given)


def _convert_model(model: nn.Module, example_inputs: Any, inplace: bool, options: Dict[str, Any],
                   given: Optional[ConvertPlan]) -> nn.Module:
    """:func:`convert` once its arguments are checked: the pipeline's stages for the whole model
    (Note: the table in pipeline.py), in order. Warnings: stack level 3, the caller of ``convert``."""
    strategy, chain = options["strategy"], options["chain"]
    inputs = as_args(example_inputs) if example_inputs is not None else None
    key = plan_key(model, inputs, options) if inputs is not None else None
    work = model if inplace else share_copy(model)
    swap_sync_batchnorm(work, inplace=True)
    conv = Conversion(strategy, chain, ConvertReport(strategy=strategy), lazy=inputs is None, example=inputs, root=work)
    conv.reuse = _reusable(given, key)
    with mode_answers(dict(conv.reuse.modes) if conv.reuse is not None else {}) as modes:
        _trace_match_build(work, inputs, conv)  # Note: [a mode dependence answered once]
    _complete_report(model, conv.report)
    if not _plan_again(work, conv):
        _plan(work, inputs, conv.report, options["memory_budget"], options["peak_budget"], options["memory_limit"],
              options["time_budget"], _shapes_at(conv))
    if key is not None:
        conv.report.plan = ConvertPlan(key, tuple(conv.checks), chain_plans(chains_of(work)), figures_of(conv.report),
                                       tuple(sorted(modes.items())))
    work.__dict__["convbn_report"] = conv.report
    arm_guards(conv)
    conv.report.attach(work)  # Note: [a report says what runs]
    if not conv.report.pairs and not conv.deferred:
        _warn_nothing_fused(model, conv.report)
    return work


def _trace_match_build(work: nn.Module, inputs: Optional[Tuple[Any, ...]], conv: Conversion) -> None:
    """Stages *trace* to *install* over every module, and with ``example_inputs`` *check*
    (converted finer where the check fails). Conversion changes no state: reading a
    parametrized weight (spectral_norm's power iteration) or tracing must not move buffers or the RNG.
    A model on the meta device is converted on its first call once materialised."""
    stage(f"trace and match {type(work).__name__}")
    with StateSnapshot(work):
        if inputs is not None:
            with example_inputs_named(work, inputs):
                _validated_convert(work, "", inputs, {}, conv)
        elif meta_tensor(work) is not None:
            defer_until_materialised(work, conv)
        else:
            convert_module(work, "", conv)
    forget_undo(work)
    dedupe(conv.report)


def _reusable(given: Optional[ConvertPlan], key: Optional[str]) -> Optional[ConvertPlan]:
    """``given`` where it was made for this model, these inputs and options; else ``None``, with
    a warning where one was given (Note: [a conversion made once])."""
    if given is None or given.key == key:
        return given
    warnings.warn("convert(plan=...) was made for another model, other example_inputs (shapes, dtypes, "
                  "devices) or other options: converting from scratch", stacklevel=4)
    return None


def _plan_again(work: nn.Module, conv: Conversion) -> bool:
    """Stage *plan* from a reused :class:`ConvertPlan`: each chain takes the plan recorded for it
    (one the example inputs did not reach plans on its first call again) and the report the
    recorded figures. ``False`` (plan from scratch) without one, or where the chains differ."""
    chains = chains_of(work)
    if conv.reuse is None or len(chains) != len(conv.reuse.chains):
        return False
    plans = [plan_value(p) for p in conv.reuse.chains]
    if any(p is not None and len(p.keep) != len(c.layers) for c, p in zip(chains, plans)):
        return False
    for c, p, plain in zip(chains, plans, conv.reuse.chains):
        if p is not None:
            c.apply_plan(p)
            restore_shapes(c, plain)
        elif conv.report.strategy == "auto":
            c.apply_plan(lazy_plan(c, peak_above_eager))
    replace_figures(conv.report, conv.reuse.figures)
    conv.report.reused_plan = True
    return True


def _complete_report(model: nn.Module, report: ConvertReport) -> None:
    """Every norm module (BatchNorm or per-sample) gets an outcome: fused, left with a reason, or not reached."""
    untraced = [m for m, _ in report.untraced]
    report.recorded += unreached(norm_module_names(model), report.recorded, untraced, report.traced,
                                 errors=dict(report.untraced))
    report.recorded += frozen_lookalikes(model, report.recorded)
    report.recorded = explain_ghost_loops(model, report.recorded)


def _shapes_at(conv: Conversion) -> Optional[int]:
    """The batch the fused layers' shapes were last recorded at by the checks (where every check ran
    at one batch), for the planner: ``None`` where that is the example batch or not one batch."""
    batches = set(conv.checked_at)
    return batches.pop() if len(batches) == 1 else None


def _plan(work: nn.Module, inputs: Optional[Tuple[Any, ...]], report: ConvertReport, memory_budget: Optional[float],
          peak_budget: Optional[float], memory_limit: Any, time_budget: Optional[float] = None,
          shapes_at: Optional[int] = None) -> None:
    """Stage *plan*: with ``example_inputs``, ``"auto"`` plans every chain on them (the other
    strategies' plans are made when their chains are built) and the saved bytes are measured;
    ``shapes_at``: the batch the checks left the layers' shapes at (``None``: the example batch)."""
    if inputs is None or not report.pairs:
        return
    if report.strategy == "auto":
        target = None
        if memory_limit is not None:
            device = next((t.device for t in (*work.parameters(), *work.buffers())), torch.device("cpu"))
            target = usable_bytes(parse_memory(memory_limit), device) - resident_bytes(work)
        with eager(work):  # the eager model: the very same modules, their own forwards
            reference = share_copy(work)
        plan_auto(reference, work, inputs, memory_budget, report, peak_budget, target, time_budget, shapes_at)
        return
    with StateSnapshot(work):
        with eager(work):
            report.eager_saved_bytes = measure_saved(work, inputs)
        report.saved_bytes = measure_saved(work, inputs)


def _warn_nothing_fused(model: nn.Module, report: ConvertReport) -> None:
    why = "; ".join([f"{s.batchnorm}: {s.reason}" for s in report.skipped[:3]]
                    + [f"{m or '<root>'} not traceable: {e}" for m, e in report.untraced[:2]])
    warnings.warn(f"convbn.convert fused nothing in {type(model).__name__} (no Conv -> norm pair found"
                  f"{': ' + why if why else ''}); it computes exactly as before", stacklevel=4)


def explain(model: nn.Module, example_inputs: Any = None, **kwargs: Any) -> ConvertReport:
    """What :func:`convert` would do to ``model``, without changing it.

    Args:
        model: the model.
        example_inputs: inputs for measuring saved bytes and planning (recommended).
        **kwargs: ``strategy``, ``memory_budget``, ``peak_budget``, ``time_budget``, ``chain``, ``progress`` as
            for :func:`convert`.

    Returns:
        The :class:`ConvertReport`: each pair with its strategy, kept bytes and extra
        MACs, and each BatchNorm skipped with its reason. With ``example_inputs`` it also
        has the measured peak of one training step (:func:`convbn.memory.timeline`, loss:
        the output's mean) of the converted and the eager model, and where the converted
        one peaks; with ``strategy="auto"`` the planner's predicted peak too.
    """
    progress = kwargs.pop("progress", None)
    check_progress(progress)
    with progress_scope("explain", progress):
        converted = convert(model, example_inputs=example_inputs, inplace=False, **kwargs)
        report: ConvertReport = converted.convbn_report  # type: ignore[assignment]
        if example_inputs is None or not report.pairs:
            return report
        inputs = as_args(example_inputs)
        stage("measuring a step of the eager and of the converted model")
        with StateSnapshot(model):
            eager = measure_peak(model, inputs)
        tl = measure_peak(converted, inputs)
        report.eager_peak_bytes = eager.peak
        report.measured_peak_bytes, report.measured_peak_where = tl.peak, tl.where()
    return report


def _convert_strategies() -> Any:
    from ...functional.strategies import CONVERT_STRATEGIES

    return CONVERT_STRATEGIES


# the strategy tuple this module re-exported (one release, with a FutureWarning)
__getattr__ = module_aliases(__name__, {"CONVERT_STRATEGIES": (_convert_strategies,
                                                               "typing.get_args(convbn.ConvertStrategy)")})
