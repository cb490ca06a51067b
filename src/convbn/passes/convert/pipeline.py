"""``convert``'s pipeline, stage by stage: for a whole model, and again for one module.

Each traced module goes through these stages, in order (:func:`rewrite_module`); the whole
model adds the plan and the check around them (``convert/api.py``):

============  =======================  ==========================================================
stage         function                 values in -> values out
============  =======================  ==========================================================
trace         :func:`trace_module`     module (+ its real inputs, where known) -> ``Traced``
canonicalise  :func:`canonicalise`     graph -> the same graph rewritten by :data:`CANONICALISE`
match         :func:`match`            graph -> chains of ``MatchedLayer`` (reasons in the report)
build         :func:`build`            graph + chains -> graph calling ``FusedChain``s, each with
                                       its plan (a strategy's, or a lazy one for ``"auto"``)
install       :func:`install_graph`    module + graph -> the installed ``GraphForward``
plan          ``plan/auto_plan.py``    (with ``example_inputs``) chains -> each one's ``ChainPlan``
check         ``check/step.py``        (with ``example_inputs``) the model against itself eager
guard         :func:`arm_guards`       installed forwards -> their guards, re-capture, variants
============  =======================  ==========================================================

A module whose forward cannot be traced is walked instead (:func:`convert_module`): each
child goes through the pipeline on its own. The pipeline runs again on one module where the
model changed after ``convert`` (:func:`reconvert`: Note: [captured again when the model
changes] in recapture.py), where a module is first called (:func:`capture_on_call`: Note:
[captured on the first call] in first_call_capture.py) and for a new kind of call
(:func:`capture_variant`: Note: [a variant per kind of call] in variants.py); each of those
is :func:`run_again` with what differs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch.fx as fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...nn.chain import FusedChain
from ...nn.fused_conv_bn import _FusedConvBNNd
from ..bn.recognise import may_normalise
from ..bn.conv_crops import absorb_conv_crops
from ..bn.tokens import drop_noop_flattens, flatten_token_bns
from ..check.first_call import BackwardCheck, FirstCallCheck
from ..check.step import called_inputs, check_step
from ..check.validate import StateSnapshot, tolerance
from ..graph.bypassed import mark_if_bypassed
from ..graph.graph_module import GraphForward, eager, forget_undo, install, installed
from ..graph.concat_heads import flatten_cats
from ..graph.zero_pads import drop_zero_pads
from ..graph.noop_casts import drop_noop_casts
from ..graph.absolute_dims import absolute_reduction_dims
from ..graph.zero_adds import drop_zero_adds
from ..graph.specialize import Defaults, constant_defaults, none_used_as_value
from ..report.convert_report import ConvertReport
from ..tracing.self_check import warn_if_tracer_broken
from ..tracing.example_trace import trace_example_call
from ..tracing.trace import LayerTracer, Traced, short_reason, trace
from .cat_norms import split_cat_norms
from .first_call_capture import CaptureOnFirstCall, CaptureWhenMaterialised
from ...functional.norms import row_of_last_dim_module, row_of_module
from ..bn.hand_layer_norms import hand_channel_layer_norms
from ..bn.hand_rms_norms import hand_channel_rms_norms
from ..bn.norm_casts import norm_float_round_trips
from ..bn.norm_sites import channel_layer_norms
from .match import MatchedLayer, find_layers, group_chains, split_heads
from .norm_linears import norm_linears
from .pools import lean_pools
from .recapture import Recapture, _merge, _remove_installed, attach_guards, refuse_flat_parameters
from .rewrite import drop_hooked, rewrite_chains, swap_sync_batchnorm, watch_hooks
from .variants import Variants

__all__ = ["Conversion", "GraphRewrite", "CANONICALISE", "convert_module", "rewrite_module", "trace_module",
           "canonicalise", "match", "build", "install_graph", "arm_guards", "run_again", "reconvert",
           "capture_on_call", "capture_variant", "dedupe", "defer_until_materialised"]


@dataclass(frozen=True)
class GraphRewrite:
    """One canonicalising rewrite: the graph made into the form matching reads, same values.

    Attributes:
        name: what it rewrites (for readers and tests).
        run: ``(graph module, traced module, its qualified-name prefix) -> anything``; edits
            the graph in place.
        chains_only: run only where chains are built (``convert(chain=True)``).
    """

    name: str
    run: Callable[[fx.GraphModule, nn.Module, str], Any]
    chains_only: bool = False


#: the canonicalising rewrites, run in this order on every traced graph before matching
CANONICALISE: Tuple[GraphRewrite, ...] = (
    # cat([.., pad(x, [0, .., 0]), ..]) -> cat([.., x, ..]) (graph/zero_pads.py)
    GraphRewrite("zero-width pads read by concatenations", lambda gm, root, prefix: drop_zero_pads(gm)),
    # nested channel concatenations -> one cat of their leaves (graph/concat_heads.py)
    GraphRewrite("flatten nested concatenations", lambda gm, root, prefix: flatten_cats(gm.graph)),
    # bn(linear(t).transpose(1, 2)) -> BatchNorm1d on rows (bn/tokens.py)
    GraphRewrite("token BatchNorms on rows", lambda gm, root, prefix: flatten_token_bns(gm)),
    # bn(linear(x).flatten(1)) on a 2-D x -> bn(linear(x)) (bn/tokens.py)
    GraphRewrite("no-op flattens before a BatchNorm1d", lambda gm, root, prefix: drop_noop_flattens(gm)),
    # x.type(d) / x.to(d) / x.float() where a trace with real inputs gave x the dtype d -> x (graph/noop_casts.py)
    GraphRewrite("casts to a value's own dtype", lambda gm, root, prefix: drop_noop_casts(gm)),
    # mean / var / std / sum over dim -k of a value whose rank a trace with real inputs knows -> over its dim (graph/absolute_dims.py)
    GraphRewrite("reduction dims from the end made absolute", lambda gm, root, prefix: absolute_reduction_dims(gm)),
    # permute -> LayerNorm(C) -> permute back -> one channel_layer_norm node (bn/norm_sites.py)
    GraphRewrite("channel LayerNorms as one node", lambda gm, root, prefix: channel_layer_norms(gm)),
    # ln(x) -> act -> linear on a channels-last map -> channel_layer_norm -> act -> channel_linear between permutes
    # (norm_linears.py)
    GraphRewrite("channels-last LayerNorms read by a Linear as a norm and a 1x1 convolution", norm_linears,
                 chains_only=True),
    # mean / var over dim 1, (x - u) / sqrt(v + eps) * w + b -> one channel_layer_norm node (bn/hand_layer_norms.py)
    GraphRewrite("hand-written channel LayerNorms as one node", lambda gm, root, prefix: hand_channel_layer_norms(gm)),
    # F.normalize(x, dim=1) * g * s, x * rsqrt(mean(x^2, 1) + eps) * g -> one channel_rms_norm node
    # (bn/hand_rms_norms.py)
    GraphRewrite("hand-written channel RMSNorms as one node", lambda gm, root, prefix: hand_channel_rms_norms(gm)),
    # channel_layer_norm(x) + 0 of a floating value no one else reads -> channel_layer_norm(x) (graph/zero_adds.py)
    GraphRewrite("additions of zero", lambda gm, root, prefix: drop_zero_adds(gm)),
    # norm(x.float()).type(x.dtype) -> norm(x): GroupNorm32 (bn/norm_casts.py)
    GraphRewrite("float32 round trips around a norm", lambda gm, root, prefix: norm_float_round_trips(gm)),
    # bn(conv(x)[..., :-p]) -> bn(conv'(x)), the crop in its padding (bn/conv_crops.py)
    GraphRewrite("crops of a convolution's output as padding", lambda gm, root, prefix: absorb_conv_crops(gm, root)),
    # BN(cat(conv_i)) -> cat(BN_i(conv_i)) (cat_norms.py)
    GraphRewrite("BatchNorms of a concatenation per piece", split_cat_norms),
    # act(bn(x)) read by several convs -> one head each (shared_heads.py)
    GraphRewrite("shared pre-activation heads per conv", split_heads, chains_only=True),
)


@dataclass
class Conversion:
    """What one run of the pipeline carries through its walk over modules (instead of arguments
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
    reuse: Optional[Any] = None  # a ConvertPlan whose checks and plans are taken (Note: [a conversion made once])
    checks: List[Tuple[str, str]] = field(default_factory=list)  # (module, why it differs or "") per check
    checked_at: List[int] = field(default_factory=list)  # the batch each passing check ran at (the layers' shapes are its)
    _called: Optional[Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]]] = None

    @property
    def whole_report(self) -> ConvertReport:
        """The model's report (``report`` itself, or the model's where this run fills a part)."""
        return self.model_report or self.report

    def inputs_of(self, module: nn.Module) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        """The inputs ``module`` runs on in an eager run of the model on ``example`` (its first
        call), or ``None`` (no example, or not called)."""
        if self.example is None or self.root is None:
            return None
        if self._called is None:
            try:
                self._called = called_inputs(self.root, self.example, {})
            except Exception:  # noqa: BLE001 - the validation will report what eager raises
                self._called = {}
            self._called[id(self.root)] = (self.example, {})
        return self._called.get(id(module))

    def mark(self) -> Tuple[int, int, int, int, int]:
        r = self.report
        return (len(r.pairs), len(r.recorded), len(r.untraced), len(r.traced), len(r.lean_pools))

    def rollback(self, mark: Tuple[int, int, int, int, int]) -> None:
        r = self.report
        del r.pairs[mark[0]:], r.recorded[mark[1]:], r.untraced[mark[2]:], r.traced[mark[3]:], r.lean_pools[mark[4]:]


# --------------------------------------------------------------------------- the walk over modules


def convert_module(module: nn.Module, prefix: str, conv: Conversion, exposed: bool = False) -> None:
    """Convert ``module`` (qualified name ``prefix``) in place. Traced with partial tracing:
    a submodule that cannot be traced, would trace misleadingly or has hooks is a leaf of
    ``module``'s trace and is converted on its own; when ``module``'s own forward cannot be
    traced, each child is converted instead (its own forward, called however the parent
    reaches it: directly, iterated, indexed or through ``_modules``). A traced module gets
    its rewritten graph as its forward (:func:`rewrite_module`); with ``conv.lazy`` that graph
    checks itself against the module's own forward on its first call.

    ``exposed``: the module's parent could not be traced, so its forward may reach the
    module's children itself (``for m in self.layers``, ``self.blocks[i]``): the children
    of an exposed container (``Sequential``, ``ModuleList``, ``ModuleDict``) are converted
    on their own too, even where the container's own graph inlines them."""
    if id(module) in conv.done or isinstance(module, (FusedChain, _FusedConvBNNd)) or not may_normalise(module):
        return
    conv.done.add(id(module))
    if isinstance(module, _BatchNorm) or row_of_module(module) is not None \
            or row_of_last_dim_module(module) is not None:
        if prefix:  # a lone norm child (BatchNorm, a norm-table row): nothing to fuse, nothing to trace
            return
    own_forward = type(module).forward is not nn.Module.forward
    try:
        if not own_forward and "forward" not in module.__dict__:
            raise TypeError(f"{type(module).__name__} has no forward (a container)")
        traced = trace_module(module, conv)  # the graph convert builds is for training
        traced = _fewer_opaque(module, traced, lambda: _shape_trace(module, conv))
        if conv.lazy and conv.example is None and traced.opaque_to_retrace(module):
            # no inputs to trace with real shapes: on the first call (Note: [opaque children
            # traced again with real shapes]); until then each child is converted on its own
            _defer(module, prefix, conv)
            for name, child in module.named_children():
                convert_module(child, f"{prefix}{name}.", conv, exposed=True)
            return
    except Exception as err:  # any tracing failure: with real shapes where known, else the children
        traced = _shape_trace(module, conv) if own_forward else None
        if traced is None:
            if own_forward:  # a container without forward is no failure
                conv.report.untraced.append((prefix.rstrip("."), short_reason(err, 120)))
                warn_if_tracer_broken("convert")  # Note: [a tracer that fails everywhere says so]
                if conv.lazy and conv.example is None:  # Note: [captured on the first call]
                    _defer(module, prefix, conv)
            for name, child in module.named_children():
                convert_module(child, f"{prefix}{name}.", conv, exposed=True)
            return
    conv.report.traced.append(prefix.rstrip("."))
    rewrite_module(module, prefix, traced, conv)
    if exposed and isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        for name, child in module.named_children():
            convert_module(child, f"{prefix}{name}.", conv, exposed=True)
    if exposed and conv.example is not None:  # Note: [a container its parent does not call]
        mark_if_bypassed(module, lambda m: conv.inputs_of(m) is not None)


def _defer(module: nn.Module, prefix: str, conv: Conversion) -> None:
    """Give ``module`` (not traceable symbolically, no ``example_inputs``; its children are
    converted one by one) a forward that captures it whole with its real inputs on its first
    call (Note: [captured on the first call])."""
    conv.deferred.append(prefix)
    module.__dict__["forward"] = CaptureOnFirstCall(module, prefix, conv.whole_report, conv.mode,
                                                    conv.chain, conv.recaptures, "", capture_on_call)


def defer_until_materialised(module: nn.Module, conv: Conversion) -> None:
    """Give the model, converted on the meta device, a forward that converts it on its first call
    once its tensors have values (Note: [a model converted on the meta device])."""
    conv.deferred.append("")
    module.__dict__["forward"] = CaptureWhenMaterialised(module, "", conv.whole_report, conv.mode, conv.chain,
                                                         conv.recaptures, "", capture_on_call)


# --------------------------------------------------------------------------- the stages


def trace_module(module: nn.Module, conv: Conversion) -> Traced:
    """Stage *trace*: ``module`` traced for training. With ``example_inputs``, its optional
    arguments are specialised to what its parent passes in the eager run on them (a Hugging
    Face model's inner modules get ``return_dict=True``, not the signature's ``None``), so the
    first calls need no variant; where that trace fails, as the signature has them."""
    optional = constant_defaults(module)
    call = conv.inputs_of(module) if optional.names else None
    if call is not None:
        try:
            traced = trace(module, LayerTracer, training=True, defaults=optional.for_call(*call))
            if not none_used_as_value(traced.graph):
                return traced
        except Exception:  # noqa: BLE001 - traced below as the signature has it
            pass
    return trace(module, LayerTracer, training=True)


def _fewer_opaque(module: nn.Module, traced: Any, shaped: Callable[[], Any]) -> Any:
    """``traced``, or the trace with real shapes (``shaped()``) where ``traced`` left conv /
    linear layers of ``module`` opaque because their code did not trace (a convolution computing
    TF-"SAME" padding from its input's shape), or modules shaped like a hand-written norm
    (``Traced.opaque_norms``: an eps picked by ``x.dtype``), and the shaped trace leaves fewer
    (and no more layers): they then fuse with the parent's norms and convolutions (Note: [opaque
    children traced again with real shapes]).

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
        each guarded on its own shapes, so the parent keeps its symbolic trace.

        The same holds for a hand-written norm that asks its input's dtype (``eps = 1e-5 if
        x.dtype == torch.float32 else 1e-3``): opaque in the symbolic trace, it is converted
        alone and has no convolution beside it. A module shaped like a norm (a forward and
        parameters of its own, none below it: ``Traced.opaque_norms``) left opaque is a reason
        to trace again with real inputs too, which answer the dtype (Note: [dtype questions
        answered by the capture] in ``graph/shape_capture.py``); a block with layers inside is
        not one, so models whose opaque blocks hold convolutions keep their symbolic trace."""
    failed = traced.opaque_to_retrace(module)
    if not failed:
        return traced
    again = shaped()
    if again is None or len(again.opaque_layers(module)) > len(traced.opaque_layers(module)):
        return traced
    return again if len(again.opaque_to_retrace(module)) < len(failed) else traced


def _shape_trace(module: nn.Module, conv: Conversion) -> Optional[Traced]:
    """``module`` traced with the real shapes of the inputs it runs on (``example_inputs``):
    Python code on shapes takes eager's branch; its optional arguments are those the call passes
    (Note: [a trace with real inputs is specialised to their call]); the graph is guarded on
    them. ``None`` where they are not known or that trace fails too."""
    example = conv.inputs_of(module)
    if example is None:
        return None
    try:
        return trace_example_call(module, example, training=True)
    except Exception:  # noqa: BLE001 - not traceable even so (data-dependent control flow ...)
        return None


def _trace_for_call(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Traced]:
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


def canonicalise(gm: fx.GraphModule, module: nn.Module, prefix: str, chain: bool) -> fx.GraphModule:
    """Stage *canonicalise*: run :data:`CANONICALISE` in order on ``gm`` (traced from ``module``)."""
    for rewrite in CANONICALISE:
        if chain or not rewrite.chains_only:
            rewrite.run(gm, module, prefix)
    return gm


def match(gm: fx.GraphModule, module: nn.Module, prefix: str, conv: Conversion) -> Optional[List[List[MatchedLayer]]]:
    """Stage *match*: the chains to fuse in ``gm`` (every BatchNorm left gets its reason in the
    report); ``None`` where no layer matched at all (the module keeps its own forward)."""
    layers = drop_hooked(find_layers(gm, module, prefix, conv.report, conv.chain), gm, conv.report)
    return group_chains(layers, conv.chain, conv.report) if layers else None


def build(module: nn.Module, prefix: str, gm: fx.GraphModule, chains: List[List[MatchedLayer]],
          conv: Conversion) -> fx.GraphModule:
    """Stage *build*: ``gm`` with each chain a ``FusedChain`` call (its plan: the strategy's, or
    for ``"auto"`` a lazy one), pooling kept lean, hooks registered later watched."""
    before = [n for n, _ in gm.named_children()]
    out = rewrite_chains(module, gm, chains, conv.mode, conv.report, lazy=conv.lazy)
    conv.report.lean_pools += lean_pools(out, prefix)  # after the chains: their outputs feed pools
    watch_hooks(out, chains, before)
    return out


def install_graph(module: nn.Module, prefix: str, traced: Traced, out: fx.GraphModule,
                  conv: Conversion) -> GraphForward:
    """Stage *install*: ``out`` as ``module``'s forward, with what the trace assumed; guarded
    later (:func:`arm_guards`), once convert's own checks and planning are done."""
    inlined = _inlined_modules(module, out)
    fwd = install(module, out)
    fwd.defaults = traced.guard()  # the calls the graph applies to (defaults kept, traced shapes)
    fwd.inlined = inlined
    conv.to_guard.append((fwd, out, prefix))
    if traced.mode_dependent:  # traced in one mode; the other runs the module's own forward
        fwd.modes = list(traced.modes)
    if conv.lazy:
        fwd.pending = FirstCallCheck(tolerance)
        fwd.backward_check = BackwardCheck(check_step)  # Note: [gradients checked on the first backward]
    return fwd


def rewrite_module(module: nn.Module, prefix: str, traced: Traced, conv: Conversion) -> None:
    """The stages after *trace* for one traced module: its leaves converted on their own, then
    canonicalise, match, build and install."""
    for name in traced.descend():
        convert_module(module.get_submodule(name), f"{prefix}{name}.", conv)
    gm = canonicalise(traced.gm, module, prefix, conv.chain)
    chains = match(gm, module, prefix, conv)
    if chains is not None:
        install_graph(module, prefix, traced, build(module, prefix, gm, chains, conv), conv)


def arm_guards(conv: Conversion) -> None:
    """Stage *guard*: guard every forward this run installed and kept (Note: [captured again when
    the model changes] in recapture.py), from the model as convert leaves it: the checks and
    measurements before ran the model, and its own forward may have side effects."""
    for fwd, gm, prefix in conv.to_guard:
        if installed(fwd.owner) is fwd:
            report = conv.whole_report
            attach_guards(fwd, gm, prefix, Recapture(report, prefix, conv.mode, conv.chain, conv.recaptures, reconvert))
            if fwd.defaults is not None:  # Note: [a variant per kind of call] in variants.py
                fwd.variants = Variants(report, prefix, conv.mode, conv.chain, conv.recaptures, capture_variant)
                # a call of convert's own check off the traced values ran the module's forward before
                # any variant was armed; the next such call gets its variant: not what the report says
                fwd.off_call = ""
    conv.to_guard.clear()


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


def dedupe(report: ConvertReport) -> None:
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


# --------------------------------------------------------------------------- the pipeline again, on one module


def run_again(module: nn.Module, prefix: str, report: ConvertReport, model_report: ConvertReport, strategy: str,
              chain: bool, count: int, traced: Optional[Traced] = None) -> Conversion:
    """The pipeline on ``module`` alone (qualified name ``prefix``), as ``convert`` without
    ``example_inputs`` runs it (lazy plans, first-call checks), into ``report`` (a new part of
    the model's ``model_report``); ``traced``: its trace, where the caller traced it for a
    call (and holds a :class:`StateSnapshot`), else it is walked as :func:`convert_module`
    walks, with state (buffers, RNG) restored. The caller guards what it keeps (:func:`arm_guards`)."""
    conv = Conversion(strategy, chain, report, lazy=True, recaptures=count, model_report=model_report)
    if traced is None:
        with StateSnapshot(module):
            convert_module(module, prefix, conv)
    else:
        conv.done.add(id(module))
        report.traced.append(prefix.rstrip("."))
        rewrite_module(module, prefix, traced, conv)
    return conv


def reconvert(module: nn.Module, prefix: str, report: ConvertReport, model_report: ConvertReport,
              strategy: str, chain: bool, count: int) -> None:
    """Convert ``module`` again into ``report`` (Note: [captured again when the model changes])."""
    refuse_flat_parameters(module)
    swap_sync_batchnorm(module, inplace=True)
    conv = run_again(module, prefix, report, model_report, strategy, chain, count)
    forget_undo(module)
    dedupe(report)
    arm_guards(conv)


def capture_on_call(module: nn.Module, prefix: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
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
        conv = run_again(module, prefix, fresh, report, strategy, chain, count, traced)
        fwd = installed(module)
        if fwd is not None and traced.shapes is not None:  # a graph for this batch size (see capture_variant)
            fwd.backward_check = None
    forget_undo(module)
    dedupe(fresh)
    _merge(report, prefix, fresh, module)
    arm_guards(conv)


def capture_variant(module: nn.Module, prefix: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                    variants: Variants) -> Optional[GraphForward]:
    """A variant of converted ``module`` for calls like this one (Note: [a variant per kind of call]
    in variants.py): traced for the call and run through the stages after *trace*, installed
    next to the module's forward (its chains under new names), checked on its first call;
    ``None`` where nothing fuses."""
    traced = _trace_for_call(module, args, kwargs)
    if traced is None:
        return None
    entry, main = module.__dict__["forward"], installed(module)
    fresh = ConvertReport(strategy=variants.report.strategy)
    conv = Conversion(variants.strategy, variants.chain, fresh, lazy=True, recaptures=variants.count,
                      model_report=variants.report)
    conv.done = {id(m) for m in module.modules() if m is not module and installed(m) is not None}
    try:
        with StateSnapshot(module):
            rewrite_module(module, prefix, traced, conv)
        variant = installed(module)
    finally:
        module.__dict__["forward"] = entry
    if variant is None or variant is main:
        return None
    variant.undo = [u for u in variant.undo or () if u[2]]
    if traced.shapes is not None:  # a graph for this batch size: the first-backward check's sample is not one
        variant.backward_check = None
    main.added += variant.added  # removed with the module's forward (re-capture)
    variant.variant_outcomes = list(fresh.recorded)  # what it left and why, for the live report
    for fwd, gm, pfx in conv.to_guard:
        if fwd is variant:
            attach_guards(variant, gm, prefix, main.on_change)
    arm_guards(conv)  # modules under it converted for the first time now
    return variant
