"""Convolution geometry and the native convolution kernels the fused layers call.

A fused layer resolves ``nn.ConvNd``'s options once into a :class:`ConvSpec`: the
symmetric padding the kernel applies itself, plus an optional *pre-pad* (asymmetric
``"same"`` padding, or a non-``zeros`` ``padding_mode``) applied to the input first,
exactly as ``nn.ConvNd`` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ConvSpec", "make_conv_spec", "conv_spec_from_module", "conv_forward", "conv_backward", "conv_output_shape", "conv_flops"]

aten = torch.ops.aten

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


@dataclass(frozen=True)
class ConvSpec:
    """Resolved geometry of a convolution.

    Attributes:
        dims: spatial dimensions (1, 2 or 3).
        stride, padding, dilation: per-dimension ints given to the kernel.
        groups: channel groups.
        pre_pad: ``F.pad`` amounts applied to the input first (last dim first), or ``()``.
        pre_pad_mode: ``F.pad`` mode for ``pre_pad`` (``"constant"`` for zeros).
    """

    dims: int
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]
    dilation: Tuple[int, ...]
    groups: int = 1
    pre_pad: Tuple[int, ...] = ()
    pre_pad_mode: str = "constant"

    def pad_input(self, x: Tensor) -> Tensor:
        """Apply the pre-pad (differentiable); identity when there is none."""
        if not self.pre_pad:
            return x
        return F.pad(x, list(self.pre_pad), mode=self.pre_pad_mode)


def _ntuple(v: Union[int, Sequence[int]], n: int, name: str) -> Tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * n
    t = tuple(int(i) for i in v)
    if len(t) == 1:
        return t * n
    if len(t) != n:
        raise ValueError(f"{name} must be an int or a tuple of {n} ints, but got {name}={v!r}")
    return t


def make_conv_spec(
    dims: int,
    kernel_size: Sequence[int],
    stride: Union[int, Sequence[int]] = 1,
    padding: Union[str, int, Sequence[int]] = 0,
    dilation: Union[int, Sequence[int]] = 1,
    groups: int = 1,
    padding_mode: str = "zeros",
) -> ConvSpec:
    """Resolve ``nn.ConvNd``-style options into a :class:`ConvSpec`.

    Raises:
        ValueError: an unknown ``padding``/``padding_mode`` string, or ``"same"`` with stride > 1
            (as ``nn.ConvNd`` raises).
    """
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode must be one of {PADDING_MODES}, but got padding_mode={padding_mode!r}")
    k = _ntuple(kernel_size, dims, "kernel_size")
    s = _ntuple(stride, dims, "stride")
    d = _ntuple(dilation, dims, "dilation")
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise ValueError(f"padding must be 'same', 'valid' or ints, but got padding={padding!r}")
        if padding == "same" and any(si != 1 for si in s):
            raise ValueError("padding='same' is not supported for strided convolutions")
        if padding == "valid":
            left = right = (0,) * dims
        else:
            total = [di * (ki - 1) for di, ki in zip(d, k)]
            left = tuple(t // 2 for t in total)
            right = tuple(t - t // 2 for t in total)
    else:
        left = right = _ntuple(padding, dims, "padding")
    if padding_mode != "zeros":
        # nn.ConvNd pads with the mode first and then convolves without padding.
        pre = tuple(p for l, r in zip(reversed(left), reversed(right)) for p in (l, r))
        mode = padding_mode
        pad = (0,) * dims
    elif left != right:
        # asymmetric "same": the kernel pads ``left`` on both sides; the extra goes on the right.
        pre = tuple(p for l, r in zip(reversed(left), reversed(right)) for p in (0, r - l))
        mode = "constant"
        pad = left
    else:
        pre, mode, pad = (), "constant", left
    if not any(pre):
        pre = ()
    return ConvSpec(dims, s, pad, d, int(groups), pre, mode)


def conv_spec_from_module(conv: nn.modules.conv._ConvNd) -> ConvSpec:
    """The :class:`ConvSpec` of an ``nn.Conv1d/2d/3d``."""
    if conv.transposed:
        raise TypeError(f"transposed convolutions are not fusable for training, got {type(conv).__name__}")
    return make_conv_spec(
        len(conv.kernel_size),
        conv.kernel_size,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        conv.padding_mode,
    )


def conv_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], spec: ConvSpec) -> Tensor:
    """``y = conv(x, W) + b`` on an already pre-padded input (native kernel)."""
    return torch.convolution(
        x, weight, bias, list(spec.stride), list(spec.padding), list(spec.dilation), False, [0] * spec.dims, spec.groups
    )


def conv_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor,
    spec: ConvSpec,
    mask: Tuple[bool, bool, bool],
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(grad_x, grad_W, grad_b)`` of :func:`conv_forward`, only where ``mask`` asks.

    Uses ``aten.convolution_backward``: ``grad_x`` is the transposed convolution of
    ``grad_y`` with ``W`` and ``grad_W`` the convolution of ``x`` with ``grad_y`` with
    batch and channel roles swapped.
    """
    if not any(mask):
        return None, None, None
    bias_sizes: Optional[List[int]] = [weight.shape[0]] if mask[2] else None
    gx, gw, gb = aten.convolution_backward(
        grad_y,
        x,
        weight,
        bias_sizes,
        list(spec.stride),
        list(spec.padding),
        list(spec.dilation),
        False,
        [0] * spec.dims,
        spec.groups,
        list(mask),
    )
    return gx, gw, gb


def conv_output_shape(in_shape: Sequence[int], weight_shape: Sequence[int], spec: ConvSpec) -> Tuple[int, ...]:
    """Output shape ``(N, C_out, *spatial)`` of the convolution of an (unpadded) input."""
    n, _, *sp = in_shape
    pre = list(spec.pre_pad)
    out = []
    for i in range(spec.dims):
        extra = 0
        if pre:
            j = spec.dims - 1 - i  # F.pad lists the last dim first
            extra = pre[2 * j] + pre[2 * j + 1]
        k = weight_shape[2 + i]
        size = sp[i] + extra + 2 * spec.padding[i] - spec.dilation[i] * (k - 1) - 1
        out.append(size // spec.stride[i] + 1)
    return (n, weight_shape[0], *out)


def conv_flops(out_shape: Sequence[int], weight_shape: Sequence[int]) -> int:
    """Multiply-accumulates of a forward convolution: ``numel(y) * C_in/groups * prod(k)``."""
    numel = 1
    for s in out_shape:
        numel *= int(s)
    per = 1
    for s in weight_shape[1:]:
        per *= int(s)
    return numel * per
