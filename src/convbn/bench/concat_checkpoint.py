"""The checkpoint-based memory-efficient DenseNet, for any traceable model: a baseline.

Pleiss et al. ("Memory-Efficient Implementation of DenseNets", 2017) keep only the
individual feature maps of a dense block and recompute concatenation + BN + ReLU in
backward; torchvision's ``memory_efficient=True`` does it with
:func:`torch.utils.checkpoint.checkpoint` around concatenation + BN + ReLU + 1x1 conv of
each dense layer. :func:`checkpoint_concat_heads` applies that recipe to an unmodified
model through its traced graph, so ``convbn bench`` can compare it with
:func:`convbn.convert` on models that do not offer it (MONAI's DenseNets):

1. nested concatenations are flattened to their leaves
   (:func:`convbn.passes.graph.concat_heads.flatten_cats`), so no intermediate concatenation is
   an input of a checkpoint (MONAI's layers concatenate their input with their output);
2. every *concatenation head* -- a ``torch.cat`` along the channel dimension whose only
   user is a BatchNorm module, whose only user is an element-wise activation, whose only
   user is a convolution module -- becomes one call of a :class:`CheckpointedConcatHead`
   taking the pieces.

Note: [Checkpoint and BatchNorm running statistics]
    Non-reentrant checkpointing re-runs the head's forward in backward, BatchNorm
    included, so running statistics are updated twice per training step (and
    ``num_batches_tracked`` counted twice): the numbers differ from eager's. That is a
    property of the baseline, measured and reported by the benchmark, not corrected here.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.utils.checkpoint import checkpoint

from ..functional.activations import activation_from_module, activation_functions
from ..passes.graph.concat_heads import channel_cat_pieces, flatten_cats
from ..passes.tracing.trace import trace

__all__ = ["CheckpointedConcatHead", "NoConcatHead", "checkpoint_concat_heads"]



class NoConcatHead(ValueError):
    """Raised by :func:`checkpoint_concat_heads` for a model without a concatenation head."""


class CheckpointedConcatHead(nn.Module):
    """``conv(act(bn(torch.cat(pieces, 1))))`` under non-reentrant checkpointing when grad is on.

    Args:
        bn: the BatchNorm module (the same object as in the model).
        act: the activation, a module or a function of one tensor.
        conv: the convolution module (the same object as in the model).

    Example:
        >>> head = CheckpointedConcatHead(nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 4, 1))
        >>> head(torch.randn(2, 2, 5, 5), torch.randn(2, 4, 5, 5)).shape
        torch.Size([2, 4, 5, 5])
    """

    def __init__(self, bn: nn.Module, act: Any, conv: nn.Module) -> None:
        super().__init__()
        self.bn = bn
        self.conv = conv
        if isinstance(act, nn.Module):
            self.act = act
        else:
            self.act_fn = act

    def _run(self, *pieces: Tensor) -> Tensor:
        act = self.act if hasattr(self, "act") else self.act_fn
        return self.conv(act(self.bn(torch.cat(pieces, 1))))

    def forward(self, *pieces: Tensor) -> Tensor:
        if torch.is_grad_enabled() and any(p.requires_grad for p in pieces + tuple(self.parameters())):
            return checkpoint(self._run, *pieces, use_reentrant=False)
        return self._run(*pieces)


def _sole_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _activation(node: fx.Node, src: fx.Node, gm: fx.GraphModule) -> Any:
    """The activation ``node`` applies to ``src`` (a module or a function), else ``None``."""
    if not node.args or node.args[0] is not src or any(isinstance(a, fx.Node) for a in node.args[1:]):
        return None
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        act = activation_from_module(mod)
        return mod if act is not None and not node.kwargs else None
    if node.op == "call_function" and node.target in activation_functions() and not node.kwargs and len(node.args) == 1:
        return node.target
    return None


def _match_head(cat: fx.Node, gm: fx.GraphModule) -> Optional[Tuple[List[fx.Node], List[fx.Node], nn.Module, Any,
                                                                        nn.Module]]:
    bn_node = _sole_user(cat)
    if bn_node is None or bn_node.op != "call_module" or bn_node.args[:1] != (cat,) or len(bn_node.args) != 1:
        return None
    bn = gm.get_submodule(str(bn_node.target))
    act_node = _sole_user(bn_node)
    if not isinstance(bn, _BatchNorm) or act_node is None:
        return None
    act = _activation(act_node, bn_node, gm)
    conv_node = _sole_user(act_node)
    if act is None or conv_node is None or conv_node.op != "call_module" or conv_node.args != (act_node,):
        return None
    conv = gm.get_submodule(str(conv_node.target))
    if not isinstance(conv, _ConvNd) or conv.transposed:
        return None
    pieces = channel_cat_pieces(cat, conv.weight.dim())
    if pieces is None:
        return None
    return pieces, [cat, bn_node, act_node, conv_node], bn, act, conv


def checkpoint_concat_heads(model: nn.Module) -> fx.GraphModule:
    """``model`` as a GraphModule running each concatenation head under checkpointing.

    Parameters and buffers are the same objects as ``model``'s (only the graph around them
    changes, so ``state_dict`` keys of the heads move under ``concat_head_N``).

    Args:
        model: a traceable model (submodules that cannot be traced stay whole).

    Returns:
        The rewritten GraphModule; ``gm.num_concat_heads`` says how many heads it checkpoints.

    Raises:
        NoConcatHead: (a ``ValueError``) the model has no concatenation head (``cat`` along channels -> BN -> act -> conv).

    Example:
        >>> class Layer(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.bn, self.act, self.conv = nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 2, 1)
        ...     def forward(self, a, b):
        ...         return self.conv(self.act(self.bn(torch.cat([a, b], 1))))
        >>> checkpoint_concat_heads(Layer()).num_concat_heads
        1
    """
    gm = trace(model).gm
    graph = gm.graph
    flatten_cats(graph)
    n = 0
    erased: set = set()
    for node in list(graph.nodes):
        match = None if node in erased else _match_head(node, gm)
        if match is None:
            continue
        pieces, nodes, bn, act, conv = match
        name = f"concat_head_{n}"
        gm.add_submodule(name, CheckpointedConcatHead(bn, act, conv))
        with graph.inserting_before(nodes[-1]):
            call = graph.call_module(name, tuple(pieces))
        nodes[-1].replace_all_uses_with(call)
        for old in reversed(nodes):
            graph.erase_node(old)
            erased.add(old)
        n += 1
    if n == 0:
        raise NoConcatHead(f"{type(model).__name__} has no concatenation head (torch.cat along channels -> BatchNorm -> "
                         "activation -> convolution) to checkpoint")
    gm.delete_all_unused_submodules()
    graph.lint()
    gm.recompile()
    gm.num_concat_heads = n
    return gm
