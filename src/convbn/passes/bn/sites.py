"""BatchNorm calls and sites: where a traced graph normalises with a BatchNorm.

Both passes find BatchNorms the same way: :func:`bn_call` says whether a node computes a
batch norm and which (a :class:`BNCall`: a ``_BatchNorm`` module call, a frozen BatchNorm
module, the batch norm of a norm-act module the tracer inlined, or an ``F.batch_norm`` /
``torch.batch_norm`` call), with the name both reports give it. Each pass then applies its
own conditions: :func:`find_bn_sites` those of convert (fused in training: the module's
mode and statistics are read again at every call of the fused chain), giving convert's
:class:`BNSite` records in graph order, and each BatchNorm that cannot be a site with the
reason (the matcher reports it left); fold's (eval only: running statistics present, no hooks, torch's
forward) are in :func:`convbn.passes.fold.match.match_bn`. The matcher
(:mod:`convbn.passes.convert.match`) then looks for the convolution before and the tail after.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch.fx as fx
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...nn.standard_bn import BatchNormView, frozen_batch_norm, has_standard_bn_forward, standard_batch_norm
from ...nn.bn_shared import BatchNormOfSource, SharedBatchStats
from ...nn.bn_slice import BatchNormSlice
from .frozen import frozen_bn_eps, frozen_bn_ranks
from .recognise import BN_FUNCTIONS, bn_call_args, recognise_norm_act
from ..graph.computed_weight import weight_nodes
from ..graph.hooks import hook_reason
from ..graph.layers import node_arg
from .kind import bn_conv_dims

__all__ = ["BNCall", "bn_call", "BN_CALL_KINDS", "BNSite", "BNSites", "find_bn_sites", "splittable_bn_calls"]


#: what computes a batch norm: a ``_BatchNorm`` module call, a frozen BatchNorm module call
#: (buffers only, recognised numerically), the batch norm of a norm-act module inlined by the
#: tracer (``standard_batch_norm`` / ``frozen_batch_norm``), an ``F.batch_norm`` call
BN_CALL_KINDS = ("module", "frozen", "inlined", "functional")


@dataclass
class BNCall:
    """One batch norm computed in a traced graph, before either pass's own conditions.

    Attributes:
        node: the node computing it.
        kind: one of :data:`BN_CALL_KINDS`.
        name: the name both reports give it: the qualified name of the module holding its
            tensors, or for a functional call on no submodule's tensors
            ``"batch_norm() call '<node>' in <module>"``.
        target: the graph target of that module (``""``: the traced module, or none).
        module: the module holding its tensors (``None``: a functional call whose tensors
            are not one module's stored ones).
        input: the value it normalises (for a functional call not understood, the first argument).
        ranks: for a frozen BatchNorm, the input ranks it is a batch norm on; else ``()``.
        args: for a functional call, its arguments by name (``None``: not understood).
    """

    node: fx.Node
    kind: str
    name: str
    target: str
    module: Optional[nn.Module]
    input: Any
    ranks: Tuple[int, ...] = ()
    args: Optional[Dict[str, Any]] = None


def _qual(prefix: str, target: str) -> str:
    return f"{prefix}{target}" if target else prefix.rstrip(".") or "<root>"


def bn_call(node: fx.Node, gm: fx.GraphModule, prefix: str = "", root: Optional[nn.Module] = None) -> Optional[BNCall]:
    """The batch norm ``node`` computes, or ``None`` if it computes none.

    Args:
        node: a node of ``gm``'s graph.
        gm: the traced graph module (BatchNorm modules are leaves).
        prefix: ``gm``'s qualified name + ``"."`` (``""`` for the model itself), for names.
        root: the module ``gm`` was traced from (default ``gm``): the owner of the tensors
            that functional calls read.

    Returns:
        A :class:`BNCall`, or ``None``.
    """
    if node.op == "call_module":
        target = str(node.target)
        mod = gm.get_submodule(target)
        if isinstance(mod, (SharedBatchStats, BatchNormSlice)):  # part of one BatchNorm (shared_heads.py,
            # cat_norms.py): reported under its name
            return BNCall(node, "module", mod.source_name, target, mod, node_arg(node, 0, "input", None))
        if isinstance(mod, _BatchNorm):
            return BNCall(node, "module", prefix + target, target, mod, node_arg(node, 0, "input", None))
        ranks = frozen_bn_ranks(mod)
        if not ranks:
            return None
        return BNCall(node, "frozen", prefix + target, target, mod, node_arg(node, 0, "input", None), ranks)
    if node.op != "call_function":
        return None
    if node.target in (standard_batch_norm, frozen_batch_norm):
        owner = node.args[0] if node.args else None
        if not isinstance(owner, fx.Node) or owner.op != "get_attr":
            return None
        target = str(owner.target)
        ranks = tuple(node.args[2]) if node.target is frozen_batch_norm else ()  # type: ignore[arg-type]
        src = node.args[1] if len(node.args) > 1 else None
        return BNCall(node, "inlined", prefix + target, target, gm.get_submodule(target), src, ranks)
    if node.target in BN_FUNCTIONS:
        args = bn_call_args(node)
        stored = [args[k] for k in ("running_mean", "running_var", "weight", "bias")] if args else []
        first = next((v for v in stored if isinstance(v, fx.Node) and v.op == "get_attr"), None)
        path, module = "", None
        if first is not None:
            path, _, module = _owner(gm if root is None else root, str(first.target))
        if path and module is not None:  # a module calling batch_norm on its own tensors
            name = prefix + path
        else:
            name = f"{node.target.__name__}() call '{node.name}' in {_qual(prefix, '')}"  # type: ignore[union-attr]
        src = args["input"] if args else node_arg(node, 0, "input", None)
        if isinstance(src, fx.Node) and not isinstance(weight_nodes(src), str):
            return None  # it normalises module tensors, not activations: part of a computed weight (StdConv2d)
        return BNCall(node, "functional", name, path, module, src, (), args)
    return None


@dataclass
class BNSite:
    """One BatchNorm computation in a traced graph that convert may fuse.

    Attributes:
        node: the node whose value is the BatchNorm's output.
        input: the node it normalises.
        bn: the module holding weight, bias, running statistics, momentum and mode.
        name: the BatchNorm's qualified name, for reports.
        ranks: the input ranks the computation is a batch norm on (``()``: any), for
            modules recognised numerically (frozen BatchNorms).
    """

    node: fx.Node
    input: fx.Node
    bn: _BatchNorm
    name: str
    ranks: Tuple[int, ...] = ()


def _owner(root: nn.Module, target: str) -> Tuple[str, str, Optional[nn.Module]]:
    path, _, attr = target.rpartition(".")
    try:
        return path, attr, root.get_submodule(path)
    except AttributeError:
        return path, attr, None


def _functional_site(node: fx.Node, root: nn.Module) -> Union[Tuple[str, nn.Module, _BatchNorm], str, None]:
    """For an ``F.batch_norm`` / ``torch.batch_norm`` node on one module's tensors: ``(path,
    module, view)``; a reason string when it cannot be fused; ``None`` for other nodes."""
    args = bn_call_args(node)
    if args is None:
        return None if node.target not in BN_FUNCTIONS else "its batch_norm call has arguments this pass does not understand"
    tensors = {k: args[k] for k in ("weight", "bias", "running_mean", "running_var")}
    if any(v is not None and (not isinstance(v, fx.Node) or v.op != "get_attr") for v in tensors.values()):
        return "its statistics or affine parameters are computed in forward, not a module's stored tensors"
    owners = {_owner(root, str(v.target))[0] for v in tensors.values() if v is not None}
    if len(owners) != 1:
        return "its tensors belong to more than one module" if owners else "it has no stored tensors to fuse with"
    path = owners.pop()
    _, _, module = _owner(root, str(next(v for v in tensors.values() if v is not None).target))
    training, momentum, eps = args["training"], args["momentum"], args["eps"]
    if not isinstance(training, bool) or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return "its training flag or eps is computed in forward, not a constant"
    stats = tensors["running_mean"] is not None
    if stats != (tensors["running_var"] is not None):
        return "it passes only one of running_mean and running_var"
    if not training and not stats:
        return "it normalises with running statistics it does not pass"
    if training and stats and (isinstance(momentum, bool) or not isinstance(momentum, (int, float))):
        return f"its momentum ({momentum!r}) is computed in forward, not a constant"
    if module is None or isinstance(module, _BatchNorm):
        return "its tensors belong to a BatchNorm module whose forward is not the one calling it"
    if training and stats and isinstance(getattr(module, "num_batches_tracked", None), Tensor):
        return (f"'{path}' has a num_batches_tracked buffer, and a traced graph cannot show whether its "
                "forward advances it (torch.fx runs such updates once, while tracing)")
    for v in tensors.values():
        if v is not None and len(v.users) != 1:
            return f"its tensor {v.target} is also used elsewhere in the forward"
    first = next(v for v in tensors.values() if v is not None)
    channels = getattr(module, str(first.target).rpartition(".")[2]).numel()
    names = {k: (str(v.target).rpartition(".")[2] if v is not None else None) for k, v in tensors.items()}
    view = BatchNormView(module, channels, eps=float(eps), momentum=float(momentum or 0.0), training=training, **names)
    return path, module, view


def _candidates(gm: fx.GraphModule, prefix: str, owner_root: nn.Module) -> List[Tuple[BNCall, Union[_BatchNorm, str]]]:
    """Each batch norm of ``gm`` with the BatchNorm convert would fuse it as, or why it cannot."""
    found: List[Tuple[BNCall, Union[_BatchNorm, str]]] = []
    for node in gm.graph.nodes:
        call = bn_call(node, gm, prefix, owner_root)
        if call is None:
            continue
        mod = call.module
        if call.kind == "module" and not has_standard_bn_forward(mod):  # type: ignore[arg-type]
            why = (recognise_norm_act(mod).reason  # type: ignore[arg-type]
                   or "it is called with other than one tensor argument")
            found.append((call, f"{why}; left as is"))
        elif call.ranks:  # a frozen BatchNorm, called or inlined with a tail
            view = BatchNormView(mod, mod.running_mean.numel(), eps=frozen_bn_eps(mod))  # type: ignore[union-attr, arg-type]
            found.append((call, view))
        elif call.kind == "functional":
            got = _functional_site(node, owner_root)
            found.append((call, got if isinstance(got, str) or got is None else got[2]))  # type: ignore[arg-type]
        else:
            found.append((call, mod))  # type: ignore[arg-type]
    return found


class BNSites(NamedTuple):
    """What :func:`find_bn_sites` found: the sites, and the BatchNorms that cannot be one.

    Attributes:
        sites: the sites, in graph order.
        left: ``(name, why)`` for each BatchNorm that cannot be a site, one per BatchNorm
            however often it is called, in graph order (the caller reports them).
    """

    sites: List[BNSite]
    left: List[Tuple[str, str]]


def find_bn_sites(gm: fx.GraphModule, prefix: str, root: Optional[nn.Module] = None) -> BNSites:
    """The BatchNorm sites of ``gm`` convert may fuse, in graph order (``prefix``: ``gm``'s
    qualified name + ".").

    A site is a call of a ``_BatchNorm`` module with the standard forward, the
    ``standard_batch_norm`` of a norm-act module inlined by the tracer
    (:mod:`convbn.passes.tracing.trace`), a call of a frozen BatchNorm module (fused as an eval-mode
    BatchNorm: no statistics update, no gradient to its buffers), or an ``F.batch_norm``
    call on one module's stored tensors (fused with its traced training flag, momentum and
    eps, which the graph only runs with: see :class:`~convbn.nn.standard_bn.BatchNormView`).
    A BatchNorm module called more than once (shared running statistics) is no site.

    Args:
        gm: the traced graph module (BatchNorm modules are leaves).
        prefix: qualified-name prefix of the names given to sites and left BatchNorms.
        root: the module ``gm`` was traced from (default ``gm``): the owner of tensors that
            ``F.batch_norm`` calls read (``gm`` holds stand-in containers for ``get_attr``
            targets, which ``.to()`` or ``load_state_dict(assign=True)`` on the model would
            not reach).

    Returns:
        :class:`BNSites`: the sites in graph order, and why each other BatchNorm is none.
    """
    found = _candidates(gm, prefix, gm if root is None else root)

    def key(call: BNCall) -> str:  # the module whose statistics a call updates
        return call.target if call.module is not None else call.name

    calls: Dict[str, int] = {}
    for call, bn in found:
        if not isinstance(bn, str):
            calls[key(call)] = calls.get(key(call), 0) + 1
    sites: List[BNSite] = []
    left: Dict[str, str] = {}
    for call, bn in found:
        why: Optional[str] = None
        if isinstance(bn, str):
            why = bn
        elif calls[key(call)] > 1:
            why = f"the BatchNorm module is called {calls[key(call)]} times (shared running statistics)"
        elif bn.running_mean is not None and bn.running_mean.is_meta:
            why = "the BatchNorm's buffers are on the meta device"
        elif not isinstance(call.input, fx.Node):
            why = "its input is not a traced tensor"
        if why is None:
            sites.append(BNSite(call.node, call.input, bn, call.name, call.ranks))
        else:
            left.setdefault(call.name, why)  # one line per BatchNorm, not per call
    return BNSites(sites, list(left.items()))


def splittable_bn_calls(gm: fx.GraphModule) -> List[Tuple[fx.Node, _BatchNorm]]:
    """``(node, module)`` of each BatchNorm call a graph rewrite may split into parts
    (``convert/shared_heads.py``, ``convert/cat_norms.py``): a ``"module"`` :func:`bn_call`
    whose module is not itself a part of another BatchNorm (``BatchNormOfSource``), computes
    with torch's own ``_BatchNorm.forward`` (a SyncBatchNorm's parts would each reduce across
    processes), has no hooks, and is called with one tensor argument, once in ``gm``.

    Args:
        gm: the traced graph module (BatchNorm modules are leaves).

    Returns:
        The calls, in graph order.
    """
    calls = Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
    found: List[Tuple[fx.Node, _BatchNorm]] = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or bn_conv_dims(gm.get_submodule(str(node.target))) is None:
            continue  # no BatchNorm module: no frozen-BatchNorm recognition needed
        call = bn_call(node, gm)
        bn = call.module if call is not None and call.kind == "module" else None
        if bn is None or isinstance(bn, BatchNormOfSource):
            continue
        if len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], fx.Node) and \
                type(bn).forward is _BatchNorm.forward and not hook_reason(bn) and calls[node.target] == 1:
            found.append((node, bn))  # type: ignore[arg-type]
    return found
