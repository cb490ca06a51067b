"""The leaf policy of :func:`convbn.convert` and :func:`convbn.fold`: :class:`LayerTracer`, an
``fx.Tracer`` that keeps the modules they match (BatchNorms, conv / linear layers with torch's
forward, convbn's fused modules) as single calls. Partial tracing, hooks and hazards on top of
it: :func:`convbn.passes.tracing.trace.trace`, which re-exports :class:`LayerTracer`.
"""
from __future__ import annotations

import torch.fx as fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...nn.chain import FusedChain
from ...nn.fused_conv_bn import _FusedConvBNNd
from ...nn.standard_bn import has_standard_bn_forward
from ..graph.layers import LAYER_MODULES, has_standard_forward

__all__ = ["LayerTracer"]


class LayerTracer(fx.Tracer):
    """The leaf policy of :func:`convbn.convert` and :func:`convbn.fold`: the modules they
    match stay single calls.

    Leaves: BatchNorms with torch's forward (``_BatchNorm`` cannot be traced into: its
    ``_check_input_dim`` branches on the input's rank), conv / conv-transpose / linear
    modules that keep torch's ``forward`` (subclasses too; one with its own ``forward`` is
    traced into, and its ``F.conv2d`` call matched), and convbn's fused modules (already
    fused). Everything else as ``fx.Tracer``. Partial tracing, hooks and hazards:
    :func:`trace`.

    Note: [BatchNorm subclasses with their own forward]
    One that :func:`~convbn.passes.bn.recognise.recognise_norm_act` recognises is inlined
    (:class:`_PartialTracing`). One it does not is a leaf in training mode: its forward may
    update running statistics in ways a trace runs once, and convert reports it left. In
    eval mode (fold) it is traced into like any module: a ``batch_norm`` call on constant
    statistics inside it folds like any other, and fold's check runs the result.
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (FusedChain, _FusedConvBNNd)):
            return True
        if isinstance(m, _BatchNorm):
            return has_standard_bn_forward(m) or m.training or super().is_leaf_module(m, module_qualified_name)
        if isinstance(m, LAYER_MODULES):
            return has_standard_forward(m)
        return super().is_leaf_module(m, module_qualified_name)
