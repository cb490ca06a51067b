"""``convbn.convert``: one call turns a CNN into a memory-lean training model.

The pass traces the model with ``torch.fx``, finds every Conv -> BatchNorm (-> activation)
in the data flow, groups consecutive ones into chains, and replaces each chain by a
:class:`convbn.nn.chain.FusedChain` call. The model's own modules stay registered
where they were (the chains only reference them), so parameters, buffers and
``state_dict()`` are the very same objects and keys.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, TypeVar

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...memory.budget import parse_memory, resident_bytes, usable_bytes
from .args import check_args
from ...nn.chain import FusedChain
from ...nn.fused_conv_bn import _FusedConvBNNd
from ...functional.deprecation import module_aliases
from ...functional.strategies import ConvertStrategy
from ..plan.auto_plan import measure_peak, measure_saved, plan_auto
from ..bn.recognise import may_normalise
from ..graph.concat_heads import flatten_cats
from ..graph.graph_module import eager, forget_undo, install, installed, uninstall
from ..graph.share_copy import share_copy
from ..graph.transaction import transaction
from .match import find_layers, group_chains
from ..report.outcome import bn_module_names, explain_ghost_loops, frozen_lookalikes, unreached
from .pools import lean_pools
from .recapture import Recapture, _merge, _remove_installed, attach_guards, refuse_flat_parameters
from .variants import Variants
from .first_call_capture import CaptureOnFirstCall
from ..graph.specialize import Defaults, constant_defaults, none_used_as_value
from ..report.convert_report import ConvertReport
from .rewrite import drop_hooked, rewrite_chains, swap_sync_batchnorm, watch_hooks
from ..tracing.trace import LayerTracer, short_reason, trace
from ..check.first_call import BackwardCheck, FirstCallCheck
from ..check.step import called_inputs, check_step
from ..check.validate import StateSnapshot, as_args, tolerance
from ...progress import check_progress, progress_scope, stage

__all__ = ["convert", "explain", "check_args"]

#: The model's type: :func:`convert` returns the class it was given (a rewritten module keeps its class).
M = TypeVar("M", bound=nn.Module)



@dataclass
class _Context:
    """What one :func:`convert` call carries through its recursion (instead of arguments
    threaded through every call, and a report rolled back by slicing)."""

    mode: str
    chain: bool
    report: ConvertReport
    lazy: bool = False
    recaptures: int = 0  # how many times the modules converted now were captured again before
    model_report: Optional[ConvertReport] = None  # the model's report, where ``report`` is a new part of it
    to_guard: List[Tuple[Any, fx.GraphModule, str]] = field(default_factory=list)  # (forward, graph, prefix)
    done: Set[int] = field(default_factory=set)  # modules converted already (shared modules: once)
    example: Optional[Tuple[Any, ...]] = None  # example_inputs, as positional arguments
    deferred: List[str] = field(default_factory=list)  # prefixes of modules captured on their first call
    root: Optional[nn.Module] = None  # the model being converted
    _called: Optional[Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]]] = None

    def inputs_of(self, module: nn.Module, root: nn.Module) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        """The inputs ``module`` runs on in an eager run of ``root`` on ``example`` (its first call),
        or ``None`` (no example, or not called)."""
        if self.example is None:
            return None
        if self._called is None:
            try:
                self._called = called_inputs(root, self.example, {})
            except Exception:  # noqa: BLE001 - the validation will report what eager raises
                self._called = {}
            self._called[id(root)] = (self.example, {})
        return self._called.get(id(module))

    def mark(self) -> Tuple[int, int, int, int, int]:
        r = self.report
        return (len(r.pairs), len(r.recorded), len(r.untraced), len(r.traced), len(r.lean_pools))

    def rollback(self, mark: Tuple[int, int, int, int, int]) -> None:
        r = self.report
        del r.pairs[mark[0]:], r.recorded[mark[1]:], r.untraced[mark[2]:], r.traced[mark[3]:], r.lean_pools[mark[4]:]


def _convert(module: nn.Module, prefix: str, ctx: _Context, exposed: bool = False) -> None:
    """Convert ``module`` (qualified name ``prefix``) in place. Traced with partial tracing:
    a submodule that cannot be traced, would trace misleadingly or has hooks is a leaf of
    ``module``'s trace and is converted on its own; when ``module``'s own forward cannot be
    traced, each child is converted instead (its own forward, called however the parent
    reaches it: directly, iterated, indexed or through ``_modules``). A traced module gets
    its rewritten graph as its forward (:func:`convbn.passes.graph.graph_module.install`); with
    ``ctx.lazy`` that graph checks itself against the module's own forward on its first call.

    ``exposed``: the module's parent could not be traced, so its forward may reach the
    module's children itself (``for m in self.layers``, ``self.blocks[i]``): the children
    of an exposed container (``Sequential``, ``ModuleList``, ``ModuleDict``) are converted
    on their own too, even where the container's own graph inlines them."""
    if id(module) in ctx.done or isinstance(module, (FusedChain, _FusedConvBNNd)) or not may_normalise(module):
        return
    ctx.done.add(id(module))
    if isinstance(module, _BatchNorm) and prefix:  # a lone BatchNorm child: nothing to fuse, nothing to trace
        return
    report = ctx.report
    try:
        if type(module).forward is nn.Module.forward and "forward" not in module.__dict__:
            raise TypeError(f"{type(module).__name__} has no forward (a container)")
        traced = _trace_as_called(module, ctx)  # the graph convert builds is for training
        traced = _fewer_opaque(module, traced, lambda: _shape_trace(module, ctx))
        if ctx.lazy and ctx.example is None and traced.opaque_layers(module):
            # no inputs to trace with real shapes: on the first call (Note: [opaque children
            # traced again with real shapes]); until then each child is converted on its own
            _defer(module, prefix, ctx)
            for name, child in module.named_children():
                _convert(child, f"{prefix}{name}.", ctx, exposed=True)
            return
    except Exception as err:  # any tracing failure: with real shapes where known, else the children
        traced = _shape_trace(module, ctx) if type(module).forward is not nn.Module.forward else None
        if traced is None:
            if type(module).forward is not nn.Module.forward:  # a container without forward is no failure
                report.untraced.append((prefix.rstrip("."), short_reason(err, 120)))
                if ctx.lazy and ctx.example is None:  # Note: [captured on the first call]
                    _defer(module, prefix, ctx)
            for name, child in module.named_children():
                _convert(child, f"{prefix}{name}.", ctx, exposed=True)
            return
    report.traced.append(prefix.rstrip("."))
    _rewrite(module, prefix, traced, ctx)
    if exposed and isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        for name, child in module.named_children():
            _convert(child, f"{prefix}{name}.", ctx, exposed=True)


def _trace_as_called(module: nn.Module, ctx: _Context) -> Any:
    """``module`` traced for training. With ``example_inputs``, its optional arguments are
    specialised to what its parent passes in the eager run on them (a Hugging Face model's inner
    modules get ``return_dict=True``, not the signature's ``None``), so the first calls need no
    variant; where that trace fails, as the signature has them."""
    optional = constant_defaults(module)
    call = ctx.inputs_of(module, ctx.root) if ctx.root is not None and optional.names else None
    if call is not None:
        try:
            traced = trace(module, LayerTracer, training=True, defaults=optional.for_call(*call))
            if not none_used_as_value(traced.graph):
                return traced
        except Exception:  # noqa: BLE001 - traced below as the signature has it
            pass
    return trace(module, LayerTracer, training=True)


def _defer(module: nn.Module, prefix: str, ctx: _Context) -> None:
    """Give ``module`` (not traceable symbolically, no ``example_inputs``; its children are
    converted one by one) a forward that captures it whole with its real inputs on its first
    call (Note: [captured on the first call])."""
    ctx.deferred.append(prefix)
    module.__dict__["forward"] = CaptureOnFirstCall(module, prefix, ctx.model_report or ctx.report, ctx.mode,
                                                    ctx.chain, ctx.recaptures, "", _capture_on_call)


def _capture_on_call(module: nn.Module, prefix: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                     report: ConvertReport, strategy: str, chain: bool, count: int, why: str) -> None:
    """Convert ``module`` whole for its first call (Note: [captured on the first call]): traced with
    the call's real inputs (its children's forwards set aside) and rewritten, replacing what
    was converted under it, checked on this call; where that trace fails too, nothing changes.
    ``report`` (the model's) gets the module's entries."""
    inner = [m for m in module.modules() if isinstance(m.__dict__.get("forward"), CaptureOnFirstCall)]
    waiting = [(m, m.__dict__.pop("forward")) for m in inner]  # traced through, as their class forward
    with StateSnapshot(module):
        with eager(module):
            traced = _trace_for_call(module, args, kwargs)
        if traced is None:
            for m, entry in waiting:
                m.__dict__["forward"] = entry
            return
        _remove_installed(module)
        fresh = ConvertReport(strategy=report.strategy)
        ctx = _Context(strategy, chain, fresh, lazy=True, recaptures=count, model_report=report)
        ctx.done.add(id(module))
        fresh.traced.append(prefix.rstrip("."))
        _rewrite(module, prefix, traced, ctx)
        fwd = installed(module)
        if fwd is not None and traced.shapes is not None:  # a graph for this batch size (see _capture_variant)
            fwd.backward_check = None
    forget_undo(module)
    _dedupe(fresh)
    _merge(report, prefix, fresh, module)
    _arm_guards(ctx)


def _fewer_opaque(module: nn.Module, traced: Any, shaped: Callable[[], Any]) -> Any:
    """``traced``, or the trace with real shapes (``shaped()``) where ``traced`` left conv /
    linear layers of ``module`` opaque because their code did not trace (a convolution computing
    TF-"SAME" padding from its input's shape) and the shaped trace leaves fewer: they then fuse
    with the parent's BatchNorms (Note: [opaque children traced again with real shapes]).

    Note: [opaque children traced again with real shapes]
        A symbolic trace that fails inside a submodule keeps that submodule as one opaque
        call and traces on, so a module whose *child* computes padding from its input's shape
        (``Conv2dDynamicSamePadding``: ``math.ceil(x.size(-1) / stride)``, then ``F.pad`` and
        ``F.conv2d``) traces "successfully" with the convolution hidden, and the BatchNorm the
        parent applies to it is left. Where the inputs are known (``example_inputs`` for
        convert, the sample run for fold), the module is traced again with real shapes
        (:mod:`convbn.passes.graph.shape_capture`), which runs the child's shape code with
        eager's values (without ``example_inputs``, on the module's first call: Note:
        [captured on the first call]); that trace is kept only where it leaves fewer such *layers* opaque,
        and is guarded on the shapes like any shaped trace. Opaque children that hold their own
        Conv -> BN pairs (a block computing its padding) are converted on their own as before,
        each guarded on its own shapes, so the parent keeps its symbolic trace."""
    failed = traced.opaque_layers(module)
    if not failed:
        return traced
    again = shaped()
    return again if again is not None and len(again.opaque_layers(module)) < len(failed) else traced


def _shape_trace(module: nn.Module, ctx: _Context) -> Any:
    """``module`` traced with the real shapes of the inputs it runs on (``example_inputs``):
    Python code on shapes takes eager's branch; the graph is guarded on those shapes. ``None``
    where they are not known or that trace fails too."""
    example = ctx.inputs_of(module, ctx.root) if ctx.root is not None else None
    if example is None:
        return None
    try:
        return trace(module, LayerTracer, training=True, example=example)
    except Exception:  # noqa: BLE001 - not traceable even so (data-dependent control flow ...)
        return None


def _rewrite(module: nn.Module, prefix: str, traced: Any, ctx: _Context) -> None:
    """Fuse what ``traced`` (``module``'s trace) shows and install the graph as its forward."""
    report = ctx.report
    gm = traced.gm
    flatten_cats(gm.graph)  # nested concatenations -> one cat of their leaves (concat_heads.py)
    for name in traced.descend():
        _convert(module.get_submodule(name), f"{prefix}{name}.", ctx)
    layers = drop_hooked(find_layers(gm, module, prefix, report, ctx.chain), gm, report)
    if not layers:
        return
    chains = group_chains(layers, ctx.chain, report)
    before = [n for n, _ in gm.named_children()]
    out = rewrite_chains(module, gm, chains, ctx.mode, report, lazy=ctx.lazy)
    report.lean_pools += lean_pools(out, prefix)  # after the chains: their outputs feed pools
    watch_hooks(out, chains, before)
    inlined = _inlined_modules(module, out)
    fwd = install(module, out)
    fwd.defaults = traced.guard()  # the calls the graph applies to (defaults kept, traced shapes)
    fwd.inlined = inlined
    ctx.to_guard.append((fwd, out, prefix))  # guarded once convert's own checks and planning are done
    if traced.mode_dependent:  # traced in one mode; the other runs the module's own forward
        fwd.modes = list(traced.modes)
    if ctx.lazy:
        fwd.pending = FirstCallCheck(tolerance)
        fwd.backward_check = BackwardCheck(check_step)  # Note: [gradients checked on the first backward]


def _arm_guards(ctx: _Context) -> None:
    """Guard every forward this conversion installed and kept (Note: [captured again when the
    model changes] in recapture.py), from the model as convert leaves it: the checks and
    measurements before ran the model, and its own forward may have side effects."""
    for fwd, gm, prefix in ctx.to_guard:
        if installed(fwd.owner) is fwd:
            report = ctx.model_report or ctx.report
            attach_guards(fwd, gm, prefix, Recapture(report, prefix, ctx.mode, ctx.chain, ctx.recaptures, _reconvert))
            if fwd.defaults is not None:  # Note: [a variant per kind of call] in variants.py
                fwd.variants = Variants(report, prefix, ctx.mode, ctx.chain, ctx.recaptures, _capture_variant)
    ctx.to_guard.clear()


def _trace_for_call(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``module`` traced for one call: its optional arguments as this call passes them, with the
    call's real shapes where the code reads shapes; ``None`` where it does not trace."""
    for defaults in (constant_defaults(module).for_call(args, kwargs), Defaults((), (), ())):
        for example in (None, (args, kwargs)):
            try:
                traced = trace(module, LayerTracer, training=True, example=example, defaults=defaults)
            except Exception:  # noqa: BLE001 - try with real shapes, then with every argument symbolic
                continue
            if not none_used_as_value(traced.graph):
                if example is None:  # Note: [opaque children traced again with real shapes]
                    traced = _fewer_opaque(module, traced, lambda: _shaped_for_call(module, args, kwargs, defaults))
                return traced
    return None


def _shaped_for_call(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], defaults: Any) -> Any:
    """``module`` traced with this call's real shapes, or ``None`` where that fails."""
    try:
        traced = trace(module, LayerTracer, training=True, example=(args, kwargs), defaults=defaults)
    except Exception:  # noqa: BLE001 - the symbolic trace stays
        return None
    return None if none_used_as_value(traced.graph) else traced


def _capture_variant(module: nn.Module, prefix: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                     variants: Variants) -> Any:
    """A variant of converted ``module`` for calls like this one (Note: [a variant per kind of call]
    in variants.py): traced for the call and rewritten by :func:`_rewrite`, installed next to the
    module's forward (its chains under new names), checked on its first call; ``None`` where
    nothing fuses."""
    traced = _trace_for_call(module, args, kwargs)
    if traced is None:
        return None
    entry, main = module.__dict__["forward"], installed(module)
    fresh = ConvertReport(strategy=variants.report.strategy)
    ctx = _Context(variants.strategy, variants.chain, fresh, lazy=True, recaptures=variants.count,
                   model_report=variants.report)
    ctx.done = {id(m) for m in module.modules() if m is not module and installed(m) is not None}
    try:
        with StateSnapshot(module):
            _rewrite(module, prefix, traced, ctx)
        variant = installed(module)
    finally:
        module.__dict__["forward"] = entry
    if variant is None or variant is main:
        return None
    variant.undo = [u for u in variant.undo or () if u[2]]
    if traced.shapes is not None:  # a graph for this batch size: the first-backward check's sample is not one
        variant.backward_check = None
    main.added += variant.added  # removed with the module's forward (re-capture)
    for fwd, gm, pfx in ctx.to_guard:
        if fwd is variant:
            attach_guards(variant, gm, prefix, main.on_change)
    _arm_guards(ctx)  # modules under it converted for the first time now
    return variant


def _reconvert(module: nn.Module, prefix: str, report: ConvertReport, model_report: ConvertReport,
               strategy: str, chain: bool, count: int) -> None:
    """Convert ``module`` (qualified name ``prefix``) again into ``report`` (a part of the
    model's ``model_report``), as :func:`convert` without ``example_inputs`` does (Note:
    [captured again when the model changes])."""
    refuse_flat_parameters(module)
    swap_sync_batchnorm(module, inplace=True)
    ctx = _Context(strategy, chain, report, lazy=True, recaptures=count, model_report=model_report)
    with StateSnapshot(module):
        _convert(module, prefix, ctx)
    forget_undo(module)
    _dedupe(report)
    _arm_guards(ctx)


def _dedupe(report: ConvertReport) -> None:
    """One pair and one outcome per BatchNorm: a layer of an exposed container is fused both
    in the container's graph and in its own (whichever runs), reported once."""
    seen = set()
    pairs = []
    for p in report.pairs:
        key = (p.conv, p.bn)
        if key not in seen:
            seen.add(key)
            pairs.append(p)
    report.pairs[:] = pairs
    done = set()
    outcomes = []
    for o in report.recorded:
        if o.result == "fused":
            if o.batchnorm in done:
                continue
            done.add(o.batchnorm)
        outcomes.append(o)
    report.recorded[:] = [o for o in outcomes if o.result == "fused" or o.batchnorm not in done]


def _inlined_modules(module: nn.Module, gm: fx.GraphModule) -> List[nn.Module]:
    """Submodules of ``module`` that ``gm``'s graph never calls: traced through (their code
    inlined) and not watched by a FusedChain (which handles its own modules' hooks)."""
    # a pooling module the graph passes to its lean call (passes/convert/pools.py) checks its own hooks
    submodules = dict(gm.named_modules())
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"
              or (n.op == "get_attr" and str(n.target) in submodules)]
    watched = {id(m) for c in gm.modules() if isinstance(c, FusedChain) for ms in c.watched for m in ms}
    return [m for name, m in module.named_modules() if name and id(m) not in watched
            and not any(name == t or name.startswith(t + ".") for t in called)]


def _validated_convert(module: nn.Module, prefix: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                       ctx: _Context) -> None:
    """:func:`_convert`, then run ``module`` as it was (:func:`eager`) and as converted on the
    inputs and compare (:func:`convbn.passes.check.validate.check_step`: outputs, every gradient,
    buffers, the RNG state afterwards). On a mismatch, undo and convert finer: each module
    called inside (recorded from an eager run, however the parent reaches it), each
    validated the same way."""
    if id(module) in ctx.done:
        return
    mark = ctx.mark()
    _convert(module, prefix, ctx)
    if not any(installed(m) is not None for m in module.modules()):
        return
    stage(f"check {prefix.rstrip('.') or 'the model'}: one training step, converted against eager")
    result = check_step(module, args, kwargs)
    if result.ok:
        ctx.report.validated.append(prefix.rstrip("."))
        return
    ctx.rollback(mark)
    uninstall(module)
    _forget(module, ctx)
    ctx.report.untraced.append((prefix.rstrip("."), f"the traced rewrite differs from eager ({result.describe()}); "
                                "converted part by part"))
    ctx.done.add(id(module))
    inputs = called_inputs(module, args, kwargs)
    _finer(module, prefix, inputs, ctx)


def _forget(module: nn.Module, ctx: _Context) -> None:
    for m in module.modules():
        ctx.done.discard(id(m))


def _finer(module: nn.Module, prefix: str, inputs: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]],
           ctx: _Context) -> None:
    """Convert, each on its own inputs, the outermost modules under ``module`` that were called."""
    for name, child in module.named_children():
        if id(child) in inputs:
            _validated_convert(child, f"{prefix}{name}.", *inputs[id(child)], ctx)
        else:  # a container the parent iterates, indexes or walks: look inside
            _finer(child, f"{prefix}{name}.", inputs, ctx)


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
            recompute (recompute is counted as MACs plus bytes moved plus a cost per call;
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
        example_inputs: a tensor or tuple of inputs. The result is *validated* on them:
            the original and the rewrite each run one forward and one backward (random
            upstream gradient) and outputs, gradients and running statistics are compared;
            where a part differs (a trace that misleads), that part is converted finer,
            child by child, and the report says so. Also used to measure and plan. Running
            stats, ``num_batches_tracked``, RNG and modes are restored exactly afterwards.
            Without it, each rewritten part validates its outputs against the original on
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
    check_args(model, strategy, memory_budget, example_inputs, peak_budget, memory_limit)
    check_progress(progress)
    with progress_scope("convert", progress), transaction(model):  # Note: [a failed pass changes nothing]
        return _convert_model(model, strategy, memory_budget, example_inputs, inplace, chain, peak_budget,
                              memory_limit)


def _convert_model(model: nn.Module, strategy: str, memory_budget: Optional[float], example_inputs: Any,
                   inplace: bool, chain: bool, peak_budget: Optional[float], memory_limit: Any) -> nn.Module:
    """:func:`convert` once its arguments are checked (warnings: stack level 3, the caller of ``convert``)."""
    report = ConvertReport(strategy=strategy)
    inputs = as_args(example_inputs) if example_inputs is not None else None
    work = model if inplace else share_copy(model)
    swap_sync_batchnorm(work, inplace=True)
    ctx = _Context(strategy, chain, report, lazy=example_inputs is None, example=inputs, root=work)
    # Conversion changes no state: reading a parametrized weight (spectral_norm's power
    # iteration) or tracing must not move buffers or the RNG.
    stage(f"trace and match {type(model).__name__}")
    with StateSnapshot(work):
        if inputs is not None:
            _validated_convert(work, "", inputs, {}, ctx)
        else:
            _convert(work, "", ctx)
    forget_undo(work)
    _dedupe(report)
    # every BatchNorm module gets an outcome: fused, left with a reason, or not reached
    untraced = [m for m, _ in report.untraced]
    report.recorded += unreached(bn_module_names(model), report.recorded, untraced, report.traced)
    report.recorded += frozen_lookalikes(model, report.recorded)
    report.recorded = explain_ghost_loops(model, report.recorded)
    if strategy == "auto" and inputs is not None and report.pairs:
        target = None
        if memory_limit is not None:
            device = next((t.device for t in (*work.parameters(), *work.buffers())), torch.device("cpu"))
            target = usable_bytes(parse_memory(memory_limit), device) - resident_bytes(work)
        with eager(work):  # the eager model: the very same modules, their own forwards
            reference = share_copy(work)
        plan_auto(reference, work, inputs, memory_budget, report, peak_budget, target)
        del reference
    elif inputs is not None and report.pairs:
        with StateSnapshot(work):
            with eager(work):
                report.eager_saved_bytes = measure_saved(work, inputs)
            report.saved_bytes = measure_saved(work, inputs)
    work.__dict__["convbn_report"] = report
    _arm_guards(ctx)
    report.attach(work)  # Note: [a report says what runs]
    if not report.pairs and not ctx.deferred:
        why = "; ".join([f"{s.batchnorm}: {s.reason}" for s in report.skipped[:3]]
                        + [f"{m or '<root>'} not traceable: {e}" for m, e in report.untraced[:2]])
        warnings.warn(f"convbn.convert fused nothing in {type(model).__name__} (no Conv -> BatchNorm pair found"
                      f"{': ' + why if why else ''}); it computes exactly as before", stacklevel=3)
    return work


def explain(model: nn.Module, example_inputs: Any = None, **kwargs: Any) -> ConvertReport:
    """What :func:`convert` would do to ``model``, without changing it.

    Args:
        model: the model.
        example_inputs: inputs for measuring saved bytes and planning (recommended).
        **kwargs: ``strategy``, ``memory_budget``, ``peak_budget``, ``chain``, ``progress`` as for :func:`convert`.

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
