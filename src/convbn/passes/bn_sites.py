"""BatchNorm sites: where a traced graph normalises with a BatchNorm that convert may fuse.

A :class:`BNSite` is one BatchNorm computation in the graph: the node whose value is the
normalised tensor, the node it normalises, and the module that holds the parameters,
running statistics and mode the computation reads (read again at every call of the fused
chain). :func:`find_bn_sites` lists them in graph order; a BatchNorm that cannot be a
site is reported left, with the reason. The matcher
(:mod:`convbn.passes.match`) then looks for the convolution before and the tail after.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch.fx as fx
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..nn.bn_call import BatchNormView, frozen_batch_norm, has_standard_bn_forward, standard_batch_norm
from .bn_frozen import frozen_bn_ranks
from .bn_recognise import BN_FUNCTIONS, bn_call_args, recognise_norm_act
from .report import ConvertReport

__all__ = ["BNSite", "find_bn_sites"]


@dataclass
class BNSite:
    """One BatchNorm computation in a traced graph.

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


def _input_of(node: fx.Node) -> object:
    return node.args[0] if node.args else node.kwargs.get("input")


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


def find_bn_sites(gm: fx.GraphModule, prefix: str, report: ConvertReport,
                  root: Optional[nn.Module] = None) -> List[BNSite]:
    """The BatchNorm sites of ``gm`` in graph order (``prefix``: ``gm``'s qualified name + ".").

    A site is a call of a ``_BatchNorm`` module with the standard forward, the
    ``standard_batch_norm`` of a norm-act module inlined by the tracer
    (:mod:`convbn.passes.trace`), a call of a frozen BatchNorm module (fused as an eval-mode
    BatchNorm: no statistics update, no gradient to its buffers), or an ``F.batch_norm``
    call on one module's stored tensors (fused with its traced training flag, momentum and
    eps, which the graph only runs with: see :class:`~convbn.nn.bn_call.BatchNormView`).

    Args:
        gm: the traced graph module (BatchNorm modules are leaves).
        prefix: qualified-name prefix for report lines.
        report: receives a ``"left"`` outcome for each BatchNorm that cannot be a site.
        root: the module ``gm`` was traced from (default ``gm``): the owner of tensors that
            ``F.batch_norm`` calls read (``gm`` holds stand-in containers for ``get_attr``
            targets, which ``.to()`` or ``load_state_dict(assign=True)`` on the model would
            not reach).

    Returns:
        The sites, in graph order.
    """
    graph = gm.graph
    found: List[Tuple[fx.Node, str, Union[nn.Module, str], Any, Tuple[int, ...]]] = []
    for node in graph.nodes:
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            if isinstance(mod, _BatchNorm):
                if not has_standard_bn_forward(mod):
                    why = recognise_norm_act(mod).reason or "it is called with other than one tensor argument"
                    found.append((node, str(node.target), f"{why}; left as is", None, ()))
                else:
                    found.append((node, str(node.target), mod, _input_of(node), ()))
            else:
                ranks = frozen_bn_ranks(mod)
                if ranks:
                    view = BatchNormView(mod, mod.running_mean.numel(), eps=float(mod.eps))
                    found.append((node, str(node.target), view, _input_of(node), ranks))
        elif node.op == "call_function" and node.target is standard_batch_norm:
            owner = node.args[0] if len(node.args) == 2 else None
            if isinstance(owner, fx.Node) and owner.op == "get_attr":
                found.append((node, str(owner.target), gm.get_submodule(str(owner.target)), node.args[1], ()))
        elif node.op == "call_function" and node.target is frozen_batch_norm:  # inlined with a tail
            owner, src, ranks = node.args
            mod = gm.get_submodule(str(owner.target))  # type: ignore[union-attr]
            view = BatchNormView(mod, mod.running_mean.numel(), eps=float(mod.eps))
            found.append((node, str(owner.target), view, src, tuple(ranks)))  # type: ignore[arg-type]
        elif node.op == "call_function" and node.target in BN_FUNCTIONS:
            got = _functional_site(node, gm if root is None else root)
            if isinstance(got, str):
                found.append((node, f"{node.target.__name__}() call '{node.name}'", got, None, ()))
            elif got is not None:
                found.append((node, got[0], got[2], _input_of(node), ()))
    calls: Dict[str, int] = {}
    for _, target, _, _, _ in found:
        calls[target] = calls.get(target, 0) + 1
    sites: List[BNSite] = []
    for node, target, bn, src, ranks in found:
        name = prefix + target

        def skip(reason: str) -> None:
            report.leave(name, reason)

        if isinstance(bn, str):
            skip(bn)
            continue
        if calls[target] > 1:
            if not any(o.batchnorm == name for o in report.outcomes):  # one line per module, not per call
                skip(f"the BatchNorm module is called {calls[target]} times (shared running statistics)")
            continue
        if bn.running_mean is not None and bn.running_mean.is_meta:
            skip("the BatchNorm's buffers are on the meta device")
            continue
        if not isinstance(src, fx.Node):
            skip("its input is not a traced tensor")
            continue
        sites.append(BNSite(node, src, bn, name, ranks))  # type: ignore[arg-type]
    return sites
