"""A per-sample norm computed in float32 and cast back: ``norm(x.float()).type(x.dtype)``.

Note: [a norm's float32 round trip]
OpenAI's guided-diffusion U-Net (and the libraries built on it: torchcfm, improved-diffusion,
score_sde ports) normalises with ``GroupNorm32``, an ``nn.GroupNorm`` whose forward is
``super().forward(x.float()).type(x.dtype)``, so that fp16 weights normalise in float32. In a
traced graph the convolution's output reaches the norm through ``.float()``, and the norm's
output reaches the activation through ``.type(x.dtype)``: matching saw no convolution before
the norm and no activation after it, and every GroupNorm of such a net was left (torchcfm's
``UNetModelWrapper``: 0 of 27). :func:`norm_float_round_trips` (a canonicalising rewrite of
convert's pipeline) removes the two casts where both read the same tensor ``x``:
``norm(x.float()).type(x.dtype)`` becomes ``norm(x)`` (in a graph traced with real shapes, ``x.dtype``
is a constant: the dtype the trace recorded for ``x``, kept in ``node.meta``). Where ``x`` is float32 (a float32 model,
the case convert fuses) both casts return their input itself, so the graph computes the very
same values. Where ``x`` is of a lower precision the norm runs at ``x``'s precision instead
(torch's CPU and CUDA group / instance / layer norms accumulate their statistics in float32
for half and bfloat16 inputs; under autocast those norms run in float32 anyway): not the same
bits, which convert's checks compare like any other rewrite (with ``example_inputs``, and on
the first call and first backward without them).
"""
from __future__ import annotations

import builtins
from typing import Any, Optional

import torch
import torch.fx as fx

from ...functional.norms import channel_layer_norm, row_of_function, row_of_module
from ..graph.shape_capture import DTYPE

__all__ = ["norm_float_round_trips"]


def _float_cast_of(node: Any) -> Optional[fx.Node]:
    """The tensor a ``.float()`` / ``.to(torch.float32)`` node casts, or ``None``."""
    if not isinstance(node, fx.Node) or node.op != "call_method" or node.kwargs:
        return None
    if node.target == "float" and len(node.args) == 1:
        return node.args[0]
    if node.target in ("to", "type") and len(node.args) == 2 and node.args[1] is torch.float32:
        return node.args[0]
    return None


def _is_norm(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_function":
        return node.target is channel_layer_norm or row_of_function(node.target) is not None
    if node.op == "call_module":
        return row_of_module(gm.get_submodule(str(node.target))) is not None
    return False


def _cast_back_to(node: fx.Node, src: fx.Node) -> bool:
    """``node`` is ``t.type(src.dtype)`` or ``t.to(src.dtype)``: ``src.dtype`` read in the graph, or,
    in a graph traced with real shapes (guarded on its inputs' dtypes), the constant dtype the
    trace recorded for ``src``."""
    if node.op != "call_method" or node.target not in ("type", "to") or len(node.args) != 2 or node.kwargs:
        return False
    dtype = node.args[1]
    if isinstance(dtype, torch.dtype):
        return src.meta.get(DTYPE) == dtype
    return (isinstance(dtype, fx.Node) and dtype.op == "call_function" and dtype.target is builtins.getattr
            and dtype.args == (src, "dtype"))


def norm_float_round_trips(gm: fx.GraphModule) -> int:
    """Rewrite each ``norm(x.float()).type(x.dtype)`` into ``norm(x)`` (Note: [a norm's float32
    round trip]). Returns how many were rewritten."""
    graph, done = gm.graph, 0
    for cast in list(graph.nodes):
        src = _float_cast_of(cast)
        if src is None or len(cast.users) != 1:
            continue
        norm = next(iter(cast.users))
        if not _is_norm(norm, gm) or not norm.args or norm.args[0] is not cast or len(norm.users) != 1:
            continue
        back = next(iter(norm.users))
        if not _cast_back_to(back, src) or back.args[0] is not norm:
            continue
        dtype = back.args[1]
        norm.args = (src, *norm.args[1:])
        back.replace_all_uses_with(norm)
        graph.erase_node(back)
        if isinstance(dtype, fx.Node) and not dtype.users:
            graph.erase_node(dtype)
        graph.erase_node(cast)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
