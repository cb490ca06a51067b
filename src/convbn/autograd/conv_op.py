"""A chain's convolution as an opaque custom op, so that inductor saves no copy of its weight.

# Note: [a conv inductor cannot re-layout]
# Inductor's layout optimisation (``torch._inductor.config.layout_optimization``, on by
# default; on the CPU with oneDNN it is taken for every graph with a convolution) marks
# every node feeding an ``aten.convolution`` as "prefers channels_last", the conv weight's
# placeholder included. A forward-graph output that prefers channels_last is written out
# in that layout, and the weight the partitioner saves for the convolution's backward is
# such an output: the saved tensor is then a channels_last *copy* of the parameter, held
# from forward to backward (ResNet-18: 17 of its 20 convs, 42 MiB, more than the
# activations convbn's plan saves at batch 8 112²). Eager autograd saves the parameter
# itself (no bytes: the model holds it anyway).
#
# Behind ``convbn::conv`` the graph has no ``aten.convolution`` node: no layout decision
# reaches the weight, the autograd formula saves the input and the parameter as they are
# (no copy), and backward calls ``aten.convolution_backward`` on them. The normalisation and
# activation around it stay plain ops that inductor fuses (Note: [a chain inductor can see
# into]). The output strides follow the chain ops' rule (Note: [the chain ops' output
# strides]): channels_last where the input or the weight is, else contiguous. Used on the
# CPU, where inductor takes the layout optimisation for every training graph with a
# convolution when oneDNN is there (:func:`convbn.autograd.chain_compiled.hides_conv_layout`);
# on CUDA the convolution stays visible (inductor's own heuristic decides the layout there,
# and cuDNN's channels_last kernels are worth a weight copy: not measured, no GPU was lent).
#
# The op is registered on first use (``import convbn`` registers no ``convbn::`` operator).
"""
# no `from __future__ import annotations`: torch 2.5's custom_op reads the annotations as objects

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .chain_layout import conform, empty_strided_like, layer_formats, strides_for

__all__ = ["conv_op", "CONV_OP"]


def _out_strides(x: Tensor, w: Tensor, shape: Sequence[Any]) -> Tuple[Any, ...]:
    return strides_for(shape, layer_formats(x, [w])[0])


@torch.library.custom_op("convbn::conv", mutates_args=())
def _conv(x: Tensor, w: Tensor, b: Optional[Tensor], stride: List[int], padding: List[int], dilation: List[int],
          transposed: bool, output_padding: List[int], groups: int) -> Tensor:
    y = torch.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)
    return conform(y, _out_strides(x, w, y.shape))


@_conv.register_fake
def _(x: Tensor, w: Tensor, b: Optional[Tensor], stride: List[int], padding: List[int], dilation: List[int],
      transposed: bool, output_padding: List[int], groups: int) -> Tensor:
    y = torch.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)
    return empty_strided_like(y, y.shape, _out_strides(x, w, y.shape))


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tensor) -> None:
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = inputs
    ctx.save_for_backward(x, w)  # the parameter itself: no copy in another layout
    ctx.geometry = (stride, padding, dilation, transposed, output_padding, groups)
    ctx.bias_sizes = None if b is None else list(b.shape)
    ctx.needs_bias = b is not None and b.requires_grad


def _backward(ctx: Any, grad: Tensor) -> Tuple[Any, ...]:
    x, w = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_bias]
    gx, gw, gb = torch.ops.aten.convolution_backward(grad, x, w, ctx.bias_sizes, *ctx.geometry, mask)
    return (gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None,
            None, None, None, None, None, None)


torch.library.register_autograd("convbn::conv", _backward, setup_context=_setup_context)

CONV_OP = torch.ops.convbn.conv.default


def conv_op(x: Tensor, w: Tensor, b: Optional[Tensor], stride: Sequence[int], padding: Sequence[int],
            dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int) -> Tensor:
    """``torch.convolution`` with the same arguments, as the opaque op ``convbn::conv``
    (Note: [a conv inductor cannot re-layout]).

    Example:
        >>> x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
        >>> torch.equal(conv_op(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        ...             torch.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
        True
    """
    return _conv(x, w, b, list(stride), list(padding), list(dilation), bool(transposed), list(output_padding),
                 int(groups))

