"""``convbn.convert``: one call turns a CNN into a memory-lean training model.

The pass traces the model with ``torch.fx``, finds every Conv -> BatchNorm (-> activation)
in the data flow, groups consecutive ones into chains, and replaces each chain by a
:class:`convbn.nn.chain.FusedChain` call. The model's own modules stay registered
where they were (the chains only reference them), so parameters, buffers and
``state_dict()`` are the very same objects and keys.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..memory.budget import parse_memory, resident_bytes, usable_bytes
from ..nn.chain import FusedChain
from ..nn.fused import _FusedConvBNNd
from ..functional.strategies import CONVERT_STRATEGIES, check_strategy
from .auto_plan import as_inputs, measure_peak, measure_saved, plan_auto
from .bn_recognise import may_normalise
from .concat_heads import flatten_cats
from .graph_module import ConvbnGraphModule
from .match import find_layers, group_chains
from .outcome import bn_module_names, unreached
from .pools import lean_pools
from .report import ConvertReport
from .rewrite import drop_hooked, rewrite_chains, set_submodule, shallow_clone, swap_sync_batchnorm, watch_hooks
from .trace import LayerTracer, short_reason, trace
from .validate import StateSnapshot, compare_outputs, run_step

__all__ = ["convert", "explain", "CONVERT_STRATEGIES"]

M = TypeVar("M", bound=nn.Module)



def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance for validating a rewrite: rounding differences pass, a changed computation not."""
    return {torch.float64: 1e-7, torch.float32: 1e-3}.get(dtype, 5e-2)


def _convert(module: nn.Module, prefix: str, mode: str, chain: bool, inplace: bool,
             report: ConvertReport, lazy: bool = False) -> nn.Module:
    """Convert ``module`` (qualified name ``prefix``). Traced with partial tracing: a
    submodule that cannot be traced, would trace misleadingly or has hooks is a leaf of
    ``module``'s trace and is converted on its own; when ``module``'s own forward cannot be
    traced, each child is converted instead. ``lazy``: rewritten GraphModules validate
    themselves against the module they replace on their first call."""
    if isinstance(module, (FusedChain, _FusedConvBNNd)) or not may_normalise(module):
        return module
    if isinstance(module, _BatchNorm) and prefix:  # a lone BatchNorm child: nothing to fuse, nothing to trace
        return module
    try:
        traced = trace(module, LayerTracer, training=True)  # the graph convert builds is for training
    except Exception as err:  # any tracing failure: convert the children instead
        report.untraced.append((prefix.rstrip("."), short_reason(err, 120)))
        target = module if inplace else shallow_clone(module)
        for name, child in module.named_children():
            new = _convert(child, f"{prefix}{name}.", mode, chain, inplace, report, lazy)
            if new is not child:
                target._modules[name] = new
        return target
    report.traced.append(prefix.rstrip("."))
    gm = traced.gm
    flatten_cats(gm.graph)  # nested concatenations -> one cat of their leaves (concat_heads.py)
    replaced: List[Tuple[str, nn.Module]] = []
    for name in traced.descend():
        sub = module.get_submodule(name)
        new = _convert(sub, f"{prefix}{name}.", mode, chain, inplace, report, lazy)
        if new is not sub:
            replaced.append((name, new))
    layers = drop_hooked(find_layers(gm, module, prefix, report, chain), gm, report)
    if not layers:
        if not replaced:
            return module
        target = module if inplace else shallow_clone(module)
        for name, new in replaced:
            set_submodule(target, name, new, inplace)
        return target
    chains = group_chains(layers, chain, report)
    before = [n for n, _ in gm.named_children()]
    out = rewrite_chains(module, gm, chains, mode, report)
    report.lean_pools += lean_pools(out, prefix)  # after the chains: their outputs feed pools
    watch_hooks(out, chains, before)
    for name, new in replaced:
        set_submodule(out, name, new, inplace)
    if isinstance(out, ConvbnGraphModule):
        out.watch_inlined(module, _inlined_modules(module, out))
        if traced.mode_dependent:  # traced in one mode; the other runs the original (eager) code
            out.guard_modes(module, traced.modes)
        if lazy:
            out.validate_on_first_call(module, _tolerance)
    return out


def _inlined_modules(module: nn.Module, gm: fx.GraphModule) -> List[nn.Module]:
    """Submodules of ``module`` that ``gm``'s graph never calls: traced through (their code
    inlined) and not watched by a FusedChain (which handles its own modules' hooks)."""
    # a pooling module the graph passes to its lean call (passes/pools.py) checks its own hooks
    submodules = dict(gm.named_modules())
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"
              or (n.op == "get_attr" and str(n.target) in submodules)]
    watched = {id(m) for c in gm.modules() if isinstance(c, FusedChain) for ms in c.watched for m in ms}
    return [m for name, m in module.named_modules() if name and id(m) not in watched
            and not any(name == t or name.startswith(t + ".") for t in called)]


def _validated_convert(module: nn.Module, prefix: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], mode: str,
                       chain: bool, inplace: bool, report: ConvertReport) -> nn.Module:
    """:func:`_convert`, then run ``module`` and the result on the inputs (forward and a
    backward with a random upstream gradient, state restored) and compare outputs,
    gradients and buffers. On a mismatch, convert finer: each child on its own inputs
    (recorded from an eager run), each validated the same way."""
    mark = (len(report.pairs), len(report.outcomes), len(report.untraced), len(report.traced))
    converted = _convert(module, prefix, mode, chain, inplace, report)
    if converted is module:
        return module
    params = list(module.parameters())
    buffers = list(module.buffers())
    runs = []
    for model in (module, converted):
        with StateSnapshot(module), StateSnapshot(converted):
            try:
                out, grads = run_step(_Bound(model, kwargs), args, params, seed=0)
            except Exception as exc:  # noqa: BLE001 - the original must run; the rewrite must not fail
                if model is module:
                    raise
                out, grads = exc, []
            runs.append((out, grads, [b.detach().clone() for b in buffers]))
    if isinstance(runs[1][0], Exception):
        result_note = f"the rewrite fails: {short_reason(runs[1][0])}"
        ok = False
    else:
        result = compare_outputs(runs[0], runs[1], _tolerance, relative=True)
        if not result.ok:  # rounding amplified by the model itself? ask a float64 copy (costly: only now)
            slack = _eager_error(module, args, kwargs, runs[0])
            if slack is not None:
                result = compare_outputs(runs[0], runs[1], _tolerance, slack=slack, relative=True)
        ok, result_note = result.ok, result.describe()
    if ok:
        report.validated.append(prefix.rstrip("."))
        return converted
    del report.pairs[mark[0]:], report.outcomes[mark[1]:], report.untraced[mark[2]:], report.traced[mark[3]:]
    report.untraced.append((prefix.rstrip("."), f"the traced rewrite differs from eager ({result_note}); "
                            "converted child by child"))
    inputs = _child_inputs(module, args, kwargs)
    target = module if inplace else shallow_clone(module)
    for name, child in module.named_children():
        if name not in inputs:
            continue
        new = _validated_convert(child, f"{prefix}{name}.", *inputs[name], mode, chain, inplace, report)
        if new is not child:
            target._modules[name] = new
    return target


# Note: [validation tolerance follows eager's own rounding]
# A rewrite only reorders rounding, but how much rounding matters depends on the model:
# a BatchNorm over two nearly equal values (small images deep in a network) amplifies
# float32 rounding by up to 1/sqrt(eps). So, below float64, the validation also runs a
# float64 copy of the original and allows each compared tensor ``_EAGER_ERROR_FACTOR``
# times eager's own distance to it on top of the relative tolerance (as fold's check does).
_EAGER_ERROR_FACTOR = 4.0


def _eager_error(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], eager: Any) -> Optional[List[float]]:
    """Per floating leaf of ``eager`` (outputs, gradients, buffers of one step), 4x its
    distance to the same step of a float64 copy; ``None`` when everything is float64 already
    or the copy cannot be made (e.g. old-style ``weight_norm`` tensors refuse deepcopy)."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(eager) if isinstance(t, Tensor) and t.is_floating_point()]
    if all(t.dtype == torch.float64 for t in leaves):
        return None
    to64 = lambda t: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
    try:
        model64 = copy.deepcopy(module).double()
        args64 = torch.utils._pytree.tree_map(to64, args)
        kwargs64 = torch.utils._pytree.tree_map(to64, kwargs)
        with StateSnapshot(model64):
            out, grads = run_step(_Bound(model64, kwargs64), args64, list(model64.parameters()), seed=0)
            exact = (out, grads, [b.detach().clone() for b in model64.buffers()])
    except Exception:  # noqa: BLE001 - no float64 reference: the relative tolerance alone
        return None
    exact_leaves = [t for t in torch.utils._pytree.tree_leaves(exact) if isinstance(t, Tensor) and t.is_floating_point()]
    if len(exact_leaves) != len(leaves):
        return None
    slack = []
    for a, e in zip(leaves, exact_leaves):
        finite = torch.isfinite(a) & torch.isfinite(e)
        err = (a.detach().double() - e.detach())[finite].abs().max().item() if a.shape == e.shape and finite.any() else 0.0
        slack.append(_EAGER_ERROR_FACTOR * err)
    return slack


class _Bound:
    """``model`` called with fixed keyword arguments (for :func:`run_step`)."""

    def __init__(self, model: nn.Module, kwargs: Dict[str, Any]) -> None:
        self.model, self.kwargs = model, kwargs

    def __call__(self, *args: Any) -> Any:
        return self.model(*args, **self.kwargs)


def _child_inputs(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                  ) -> Dict[str, Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """Each direct child's inputs at its first call in one eager forward of ``module`` (state restored)."""
    seen: Dict[str, Tuple[Tuple[Any, ...], Dict[str, Any]]] = {}
    clone = lambda t: t.detach().clone() if isinstance(t, Tensor) else t  # noqa: E731

    def record(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, a: Tuple[Any, ...], k: Dict[str, Any]) -> None:
            if name not in seen:
                seen[name] = (tuple(torch.utils._pytree.tree_map(clone, a)), torch.utils._pytree.tree_map(clone, k))
        return hook

    handles = [c.register_forward_pre_hook(record(n), with_kwargs=True) for n, c in module.named_children()]
    try:
        with StateSnapshot(module), torch.no_grad():
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _check_args(model: Any, strategy: str, memory_budget: Optional[float], example_inputs: Any,
                peak_budget: Optional[float] = None, memory_limit: Any = None) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects an nn.Module, but got {type(model).__name__}")
    check_strategy(strategy, CONVERT_STRATEGIES)
    if memory_limit is not None:
        parse_memory(memory_limit)  # TypeError / ValueError naming the value
        if strategy != "auto":
            raise ValueError(f"memory_limit is used by strategy='auto' only, but got strategy={strategy!r}")
        if peak_budget is not None:
            raise ValueError("give memory_limit (bytes for the whole step) or peak_budget (a fraction of eager's "
                             "peak), not both")
        if example_inputs is None:
            raise ValueError("memory_limit needs example_inputs: the plan is made for their batch")
    if peak_budget is not None:
        if strategy != "auto":
            raise ValueError(f"peak_budget is used by strategy='auto' only, but got strategy={strategy!r}")
        if isinstance(peak_budget, bool) or not isinstance(peak_budget, (int, float)) or not 0 < peak_budget <= 1:
            raise ValueError(f"peak_budget must be a fraction of the eager step's peak memory in (0, 1], "
                             f"but got {peak_budget!r}")
        if example_inputs is None:
            raise ValueError("peak_budget needs example_inputs: the planner measures the eager step's peak on them")
    if memory_budget is not None:
        if strategy != "auto":
            raise ValueError(f"memory_budget is used by strategy='auto' only, but got strategy={strategy!r}")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not 0 < memory_budget <= 1:
            raise ValueError(
                f"memory_budget must be a fraction of eager saved activation bytes in (0, 1], but got {memory_budget!r}"
            )
        if example_inputs is None:
            raise ValueError("memory_budget needs example_inputs: the planner measures eager saved bytes on them")


def convert(
    model: M,
    *,
    strategy: str = "auto",
    memory_budget: Optional[float] = None,
    example_inputs: Any = None,
    inplace: bool = False,
    chain: bool = True,
    peak_budget: Optional[float] = None,
    memory_limit: Any = None,
) -> nn.Module:
    """Fuse every Conv -> BatchNorm (-> activation) of ``model`` for memory-lean training.

    The result computes the same outputs, gradients and running statistics as
    ``model``; its parameters and buffers are ``model``'s own objects (an optimizer
    built before conversion keeps working) and its ``state_dict()`` has the same keys.

    Args:
        model: any ``nn.Module``. Traced with ``torch.fx``; when the whole model cannot be
            traced, each child is converted instead (recursively).
        strategy: ``"auto"`` (plan per layer), ``"recompute_bn"`` (every layer keeps its
            conv output; element-wise recompute only) or ``"recompute_conv"`` (keep no
            layer's conv output; with ``chain=False`` this is the tutorial's method).
        memory_budget: with ``"auto"``, the target *saved* activation bytes (held from
            forward to backward, parameters excluded) as a fraction of the eager model's
            (e.g. ``0.35``): the plan recomputes least within it. ``None`` plans for the
            step's *peak* alone: the least recompute among plans whose predicted peak is
            within 8 % of the lowest reachable (``PEAK_TOLERANCE``), whatever their saved bytes, and a lower
            peak within that where a byte of it costs at most 16 MAC-equivalents of
            recompute (recompute is counted as MACs plus bytes moved plus a cost per call; see
            :mod:`convbn.passes.planner`; ``explain`` shows predicted and measured peaks;
            without ``example_inputs`` each chain keeps the tutorial method's saved bytes).
            Needs ``example_inputs``. A budget below the reachable floor raises
            ``ValueError`` naming the floor.
        peak_budget: with ``"auto"``, the training step's *peak* memory allowed, as a fraction
            of the eager model's peak measured on ``example_inputs`` (one step, gradients set
            to None first, parameters not counted, as :func:`explain` measures it): the least
            recompute whose predicted peak fits. Needs ``example_inputs``. Where no plan
            reaches it, the plan with the lowest reachable peak, with a warning (the report's
            ``target_peak_bytes`` / ``lowest_peak_bytes`` say so too). With ``memory_budget``
            too, both are limits (Note: [saved bytes or peak] in ``passes/auto_plan.py``).
        memory_limit: with ``"auto"``, the memory the training step may use in all on the
            model's device, in bytes or as text (``"16GiB"``, :func:`convbn.memory.parse_memory`):
            the parameters and buffers plus the step's peak on ``example_inputs`` (Note:
            [a step's peak] in ``convbn/memory/timelines.py``: weight gradients included;
            on CUDA less :data:`~convbn.memory.budget.CUDA_FRAGMENTATION_MARGIN`). The plan
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
        inplace: modify ``model`` itself where the pass replaces children of modules that
            could not be traced whole; by default those containers are shallow-copied.
        chain: group consecutive fused layers into chains (see :mod:`convbn.autograd.chain`).

    Hooks and parametrizations (see README "What convert preserves"): a conv, BatchNorm or
    activation module with hooks (including old-style ``weight_norm`` / ``spectral_norm`` and
    pruning) is left unfused and reported; hooks registered later are honoured at call time
    (the affected chain, or the affected part of the model, then runs as eager modules).

    Returns:
        The converted model (a ``torch.fx.GraphModule`` where the model traced, with the
        report in ``.convbn_report``), or ``model``'s structure with converted children.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> fast = convert(net)
        >>> fast[0].weight is net[0].weight
        True
    """
    _check_args(model, strategy, memory_budget, example_inputs, peak_budget, memory_limit)
    report = ConvertReport(strategy=strategy)
    root = swap_sync_batchnorm(model, inplace)
    # Conversion changes no state: reading a parametrized weight (spectral_norm's power
    # iteration) or tracing must not move buffers or the RNG.
    with StateSnapshot(root):
        if example_inputs is not None:
            converted = _validated_convert(root, "", as_inputs(example_inputs), {}, strategy, chain, inplace, report)
        else:
            converted = _convert(root, "", strategy, chain, inplace, report, lazy=True)
    # every BatchNorm module gets an outcome: fused, left with a reason, or not reached
    untraced = [m for m, _ in report.untraced]
    report.outcomes += unreached(bn_module_names(model), report.outcomes, untraced, report.traced)
    if strategy == "auto" and example_inputs is not None and report.pairs:
        # measure on ``root``: its SyncBatchNorms are convbn's, which run on CPU too
        target = None
        if memory_limit is not None:
            device = next((t.device for t in (*root.parameters(), *root.buffers())), torch.device("cpu"))
            target = usable_bytes(parse_memory(memory_limit), device) - resident_bytes(root)
        plan_auto(root, converted, as_inputs(example_inputs), memory_budget, report, peak_budget, target)
    elif example_inputs is not None and report.pairs:
        inputs = as_inputs(example_inputs)
        with StateSnapshot(root), StateSnapshot(converted):
            report.eager_saved_bytes = measure_saved(root, inputs)
            report.saved_bytes = measure_saved(converted, inputs)
    try:
        if converted is model and not inplace:
            converted = shallow_clone(model)  # nothing fused: carry the report without touching ``model``
        converted.convbn_report = report  # type: ignore[assignment]
    except AttributeError:  # pragma: no cover - modules refusing attributes
        pass
    if not report.pairs:
        why = "; ".join([f"{s.batchnorm}: {s.reason}" for s in report.skipped[:3]]
                        + [f"{m or '<root>'} not traceable: {e}" for m, e in report.untraced[:2]])
        warnings.warn(f"convbn.convert fused nothing in {type(model).__name__} (no Conv -> BatchNorm pair found"
                      f"{': ' + why if why else ''}); it computes exactly as before", stacklevel=2)
    return converted


def explain(model: nn.Module, example_inputs: Any = None, **kwargs: Any) -> ConvertReport:
    """What :func:`convert` would do to ``model``, without changing it.

    Args:
        model: the model.
        example_inputs: inputs for measuring saved bytes and planning (recommended).
        **kwargs: ``strategy``, ``memory_budget``, ``peak_budget``, ``chain`` as for :func:`convert`.

    Returns:
        The :class:`ConvertReport`: each pair with its strategy, kept bytes and extra
        MACs, and each BatchNorm skipped with its reason. With ``example_inputs`` it also
        has the measured peak of one training step (:func:`convbn.memory.timeline`, loss:
        the output's mean) of the converted and the eager model, and where the converted
        one peaks; with ``strategy="auto"`` the planner's predicted peak too.
    """
    converted = convert(model, example_inputs=example_inputs, inplace=False, **kwargs)
    report: ConvertReport = converted.convbn_report  # type: ignore[assignment]
    if example_inputs is not None and report.pairs:
        inputs = as_inputs(example_inputs)
        with StateSnapshot(model):
            eager = measure_peak(model, inputs)
        tl = measure_peak(converted, inputs)
        report.eager_peak_bytes = eager.peak
        report.measured_peak_bytes, report.measured_peak_where = tl.peak, tl.where()
    return report
