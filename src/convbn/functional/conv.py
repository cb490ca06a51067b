"""Convolution geometry and the native convolution kernels the fused layers call.

A fused layer resolves ``nn.ConvNd``'s options once into a :class:`ConvSpec`: the
symmetric padding the kernel applies itself, plus an optional *pre-pad* (asymmetric
``"same"`` padding, or a non-``zeros`` ``padding_mode``) applied to the input first,
exactly as ``nn.ConvNd`` does.

# Note: [three kinds of convolution]
# One spec describes every linear map a fused layer may start with, so single layers,
# chains, the custom op and the planner handle them alike:
#   * a convolution ``nn.Conv{1,2,3}d``: weight ``(C_out, C_in/g, *k)``;
#   * a transposed convolution ``nn.ConvTranspose{1,2,3}d`` (``transposed=True``, with its
#     ``output_padding``): weight ``(C_in, C_out/g, *k)``, so output channel
#     ``o = group * C_out/g + j`` sits on dim 1 of its group's block of rows;
#   * a linear layer ``nn.Linear`` on ``(N, C_in)`` (``dims == 0``: a convolution with no
#     spatial dimensions): weight ``(C_out, C_in)``, ``y = x W^T + b``;
#   * a linear layer on the channels of an ``(N, C_in, *spatial)`` map (``channel_linear``,
#     ``dims >= 1``): a 1x1 convolution spelled as ``F.linear`` over the channels moved last,
#     weight ``(C_out, C_in)`` (Note: [a Linear on a channels-last map is a 1x1 convolution]).
# Every place that needs the output channels of a weight (bias gradient, BatchNorm
# folding, per-channel sums) goes through :func:`conv_out_channels`,
# :func:`scale_out_channels` and :func:`sum_per_out_channel`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ConvSpec", "make_conv_spec", "make_linear_spec", "make_channel_linear_spec", "channel_linear", "conv_spec_from_module", "conv_forward", "conv_backward",
           "conv_output_shape", "conv_flops", "conv_in_channels", "conv_out_channels", "scale_out_channels",
           "sum_per_out_channel", "recompute_cost", "COST_PER_BYTE", "COST_PER_CALL"]

aten = torch.ops.aten

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


@dataclass(frozen=True)
class ConvSpec:
    """Resolved geometry of a convolution, transposed convolution or linear layer.

    Attributes:
        dims: spatial dimensions (1, 2 or 3; 0 for a linear layer, see
            Note: [three kinds of convolution]).
        stride, padding, dilation: per-dimension ints given to the kernel.
        groups: channel groups.
        pre_pad: ``F.pad`` amounts applied to the input first (last dim first), or ``()``.
        pre_pad_mode: ``F.pad`` mode for ``pre_pad`` (``"constant"`` for zeros).
        transposed: a transposed convolution (``nn.ConvTranspose{N}d``).
        output_padding: the transposed convolution's extra output size per dimension
            (``()`` for none).
        channel_linear: a linear layer on the channels of an ``(N, C_in, *spatial)`` map
            (:func:`channel_linear`): a 1x1 convolution whose weight is ``(C_out, C_in)``.
    """

    dims: int
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]
    dilation: Tuple[int, ...]
    groups: int = 1
    pre_pad: Tuple[int, ...] = ()
    pre_pad_mode: str = "constant"
    transposed: bool = False
    output_padding: Tuple[int, ...] = ()
    channel_linear: bool = False

    def __post_init__(self) -> None:
        if self.channel_linear and (self.dims < 1 or self.transposed or self.pre_pad or self.groups != 1
                                    or set(self.stride) != {1} or set(self.padding) != {0}):
            raise ValueError(f"a linear layer on the channels is a 1x1 convolution over 1 or more spatial dims, "
                             f"but got {self}")
        if self.transposed and (self.pre_pad or self.dims == 0):
            raise ValueError(f"a transposed convolution has {self.dims} spatial dims and pre-pad {self.pre_pad}; "
                             "expected 1-3 dims and no pre-pad (ConvTranspose pads with zeros only)")
        if self.output_padding and not self.transposed:
            raise ValueError(f"output_padding={self.output_padding} is for transposed convolutions only")

    @property
    def is_linear(self) -> bool:
        """A linear layer (``dims == 0``)."""
        return self.dims == 0

    def kernel_output_padding(self) -> List[int]:
        """``output_padding`` as the native kernel takes it (zeros when there is none)."""
        return list(self.output_padding) if self.output_padding else [0] * self.dims

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


def make_linear_spec() -> ConvSpec:
    """The :class:`ConvSpec` of a linear layer (Note: [three kinds of convolution])."""
    return ConvSpec(0, (), (), ())


def make_channel_linear_spec(dims: int) -> ConvSpec:
    """The :class:`ConvSpec` of a linear layer on the channels of an ``(N, C, *spatial)`` map
    with ``dims`` spatial dimensions (:func:`channel_linear`)."""
    if type(dims) is not int or dims < 1:
        raise ValueError(f"dims must be an int >= 1 (the map's spatial dimensions), but got dims={dims!r}")
    return ConvSpec(dims, (1,) * dims, (0,) * dims, (1,) * dims, channel_linear=True)


def channel_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` over the channels (dim 1) of an ``(N, C_in, *spatial)`` map: a 1x1 convolution.

    Note: [a Linear on a channels-last map is a 1x1 convolution]
    A model that keeps its maps channels-last (``(N, H, W, C)``, MaxViT, MambaOut, EdgeNeXt) or
    its tokens as ``(B, T, C)`` applies ``nn.Linear`` over the last dimension: a pointwise
    convolution. Seen through ``x.permute(0, 3, 1, 2)`` the map is ``(N, C, H, W)`` with
    channels-last strides, and this function moves the channels back last and runs the very
    ``F.linear`` of the model on the very tensor it would get (same strides, so the same kernel
    and the same values), its output seen as ``(N, C_out, H, W)`` again. Its backward is the
    linear layer's (``grad_x = G W``, ``grad_W = G^T x``, ``grad_b = sum_rows G``) on the same
    views. A per-sample norm chain then treats it as any convolution after a norm
    (``passes/convert/norm_linears.py`` writes a LayerNorm -> Linear so).

    Example:
        >>> x, w = torch.randn(2, 5, 4, 3), torch.randn(6, 3)
        >>> ref = F.linear(x, w).permute(0, 3, 1, 2)
        >>> torch.equal(channel_linear(x.permute(0, 3, 1, 2), w), ref)
        True
    """
    return F.linear(input.movedim(1, -1), weight, bias).movedim(-1, 1)


def conv_spec_from_module(conv: Union[nn.modules.conv._ConvNd, nn.Linear]) -> ConvSpec:
    """The :class:`ConvSpec` of an ``nn.Conv{1,2,3}d``, ``nn.ConvTranspose{1,2,3}d`` or ``nn.Linear``.

    Raises:
        TypeError: another module.
        ValueError: a transposed convolution with a ``padding_mode`` other than ``"zeros"``.
    """
    if isinstance(conv, nn.Linear):
        return make_linear_spec()
    if not isinstance(conv, nn.modules.conv._ConvNd):
        raise TypeError(f"expected a convolution or nn.Linear module, but got {type(conv).__name__}")
    if conv.transposed:
        if conv.padding_mode != "zeros":
            raise ValueError(f"only 'zeros' padding mode is supported for {type(conv).__name__}, "
                             f"but got padding_mode={conv.padding_mode!r}")
        dims = len(conv.kernel_size)
        op = _ntuple(conv.output_padding, dims, "output_padding")
        return ConvSpec(dims, _ntuple(conv.stride, dims, "stride"), _ntuple(conv.padding, dims, "padding"),  # type: ignore[arg-type]
                        _ntuple(conv.dilation, dims, "dilation"), int(conv.groups), transposed=True,
                        output_padding=op if any(op) else ())
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
    """``y = conv(x, W) + b`` on an already pre-padded input (native kernel; ``F.linear`` for a linear layer)."""
    if spec.is_linear:
        return F.linear(x, weight, bias)
    if spec.channel_linear:
        return channel_linear(x, weight, bias)
    return torch.convolution(
        x, weight, bias, list(spec.stride), list(spec.padding), list(spec.dilation), spec.transposed,
        spec.kernel_output_padding(), spec.groups
    )


def conv_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor,
    spec: ConvSpec,
    mask: Tuple[bool, bool, bool],
    weight_first: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(grad_x, grad_W, grad_b)`` of :func:`conv_forward`, only where ``mask`` asks.

    Uses ``aten.convolution_backward``: ``grad_x`` is the transposed convolution of
    ``grad_y`` with ``W`` and ``grad_W`` the convolution of ``x`` with ``grad_y`` with
    batch and channel roles swapped (the roles of the two swap for a transposed
    convolution). A linear layer: ``grad_x = G W``, ``grad_W = G^T x``, ``grad_b = sum_rows G``
    (the matrix products eager's ``addmm`` backward runs).

    ``weight_first``: where both ``grad_x`` and ``grad_W`` are asked, ``grad_W`` (and ``grad_b``)
    in one call and ``grad_x`` in a second, the same values bit for bit (Note: [the weight's
    gradient first]).
    """
    if not any(mask):
        return None, None, None
    if spec.channel_linear:  # Note: [a Linear on a channels-last map is a 1x1 convolution]
        gx, gw, gb = conv_backward(grad_y.movedim(1, -1), x.movedim(1, -1), weight, make_linear_spec(), mask)
        return None if gx is None else gx.movedim(-1, 1), gw, gb
    if weight_first and mask[0] and mask[1] and not spec.is_linear:
        # Note: [the weight's gradient first]
        # One ``convolution_backward`` computes ``grad_x`` first and then ``grad_W``, and on
        # the CPU ``grad_W``'s kernel (oneDNN) makes reordered copies of both ``x`` and
        # ``grad_y``: that scratch (``x`` + ``grad_y`` bytes) lands on top of the finished
        # ``grad_x``. Two calls, ``grad_W`` first, never hold both: the high-water mark is
        # ``max(scratch_W, grad_x + scratch_x)`` instead of ``grad_x + max(scratch_x, scratch_W)``
        # (``benchmarks/bm_conv_scratch.py`` measures the scratch). Each kernel computes the
        # same sums in the same order alone as together, so the values are the same bits. The
        # norm chain asks for it on the CPU only: one more operator dispatched per convolution
        # (``tests/test_norm_chain_ops.py`` counts it), and CUDA's measured peaks stay as they were.
        _, gw, gb = conv_backward(grad_y, x, weight, spec, (False, True, mask[2]))
        gx, _, _ = conv_backward(grad_y, x, weight, spec, (True, False, False))
        return gx, gw, gb
    if spec.is_linear:
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        gx = grad_y.matmul(weight) if mask[0] else None
        gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if mask[1] else None
        gb = g2.sum(0) if mask[2] else None
        return gx, gw, gb
    bias_sizes: Optional[List[int]] = [conv_out_channels(weight.shape, spec)] if mask[2] else None
    gx, gw, gb = aten.convolution_backward(
        grad_y,
        x,
        weight,
        bias_sizes,
        list(spec.stride),
        list(spec.padding),
        list(spec.dilation),
        spec.transposed,
        spec.kernel_output_padding(),
        spec.groups,
        list(mask),
    )
    return gx, gw, gb


def conv_in_channels(weight_shape: Sequence[int], spec: ConvSpec) -> int:
    """Input channels (features) the layer with this weight expects."""
    return int(weight_shape[0]) if spec.transposed else int(weight_shape[1]) * spec.groups


def conv_out_channels(weight_shape: Sequence[int], spec: ConvSpec) -> int:
    """Output channels (features) of the layer with this weight."""
    return int(weight_shape[1]) * spec.groups if spec.transposed else int(weight_shape[0])


def _out_channel_blocks(weight: Tensor, spec: ConvSpec) -> Tensor:
    """A transposed weight ``(C_in, C_out/g, *k)`` as ``(g, C_in/g, C_out/g, *k)``."""
    return weight.reshape(spec.groups, weight.shape[0] // spec.groups, *weight.shape[1:])


def scale_out_channels(weight: Tensor, scale: Tensor, spec: ConvSpec) -> Tensor:
    """``weight`` with every output channel's slice multiplied by ``scale`` (``(C_out,)``)."""
    if not spec.transposed:
        return weight * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    s = scale.reshape(spec.groups, 1, weight.shape[1], *([1] * (weight.dim() - 2)))
    return (_out_channel_blocks(weight, spec) * s).reshape(weight.shape)


def sum_per_out_channel(t: Tensor, spec: ConvSpec) -> Tensor:
    """Sum of a weight-shaped tensor over everything but the output channel: ``(C_out,)``."""
    if not spec.transposed:
        return t.flatten(1).sum(1)
    blocks = _out_channel_blocks(t, spec)  # (g, C_in/g, C_out/g, *k)
    return blocks.sum([1, *range(3, blocks.dim())]).flatten()


def conv_output_shape(in_shape: Sequence[int], weight_shape: Sequence[int], spec: ConvSpec) -> Tuple[int, ...]:
    """Output shape ``(N, C_out, *spatial)`` of the convolution of an (unpadded) input
    (``(*, C_out)`` for a linear layer on ``(*, C_in)``)."""
    if spec.is_linear:
        return (*(int(s) for s in in_shape[:-1]), int(weight_shape[0]))
    n, _, *sp = in_shape
    if spec.channel_linear:
        return (int(n), int(weight_shape[0]), *(int(s) for s in sp))
    if spec.transposed:
        op = spec.kernel_output_padding()
        out = [(sp[i] - 1) * spec.stride[i] - 2 * spec.padding[i] + spec.dilation[i] * (weight_shape[2 + i] - 1)
               + op[i] + 1 for i in range(spec.dims)]
        return (n, conv_out_channels(weight_shape, spec), *out)
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


def conv_flops(out_shape: Sequence[int], weight_shape: Sequence[int], spec: Optional[ConvSpec] = None,
               in_shape: Optional[Sequence[int]] = None) -> int:
    """Multiply-accumulates of a forward convolution: ``numel(y) * C_in/groups * prod(k)``;
    for a transposed one (``spec`` and ``in_shape`` given) ``numel(x) * C_out/groups * prod(k)``
    (each input element meets ``C_out/groups * prod(k)`` weights); a linear layer ``numel(y) * C_in``."""
    if spec is not None and spec.transposed:
        if in_shape is None:
            raise ValueError("conv_flops of a transposed convolution needs in_shape")
        out_shape = in_shape  # the roles of input and output swap
    numel = 1
    for s in out_shape:
        numel *= int(s)
    per = 1
    for s in weight_shape[1:]:
        per *= int(s)
    return numel * per


# Note: [what a recompute costs]
# The planner chooses which convolutions to run again in backward; their cost is time,
# and a convolution's time is not its multiply-accumulates alone. Thin and depthwise
# convolutions (EfficientNet's 16 -> 96 expansion at 112², its 3x3 depthwise convs) do a
# few MACs per byte they read and write, so memory traffic and the kernel's fixed cost set
# their time. A MACs-only cost made the planner recompute exactly those layers first (they
# free the most bytes per MAC): on EfficientNet-B0 (batch 8, 224²) a plan of 0.66 GMAC took
# 6-10 % longer per step than one of 0.32. The cost is therefore
#     MACs + COST_PER_BYTE * (input + output bytes) + COST_PER_CALL      (MAC equivalents),
# the three terms fitted by ``benchmarks/bm_conv_cost.py`` (every conv of six models timed
# alone, 2 threads, non-negative least squares on relative error): 8.6 MAC per byte and
# 8.6e6 MAC per call, which cut the mean per-layer error of MACs alone on EfficientNet-B0
# from 0.63 to 0.15, ResNet-18 0.31 -> 0.05, DenseNet121 0.17 -> 0.05 (ResNet-50 0.19 ->
# 0.17, 3-D UNet 0.32 -> 0.28). Rounded and device independent, so the same model gets the
# same plan everywhere: the constants rank layers, they do not predict milliseconds.
#: Cost, in MAC equivalents, of each byte a convolution reads (input) or writes (output).
COST_PER_BYTE = 8
#: Fixed cost, in MAC equivalents, of one convolution call.
COST_PER_CALL = 10_000_000


def recompute_cost(macs: int, in_bytes: int, out_bytes: int) -> int:
    """Cost of running a convolution again, in MAC equivalents (Note: [what a recompute costs]):
    ``macs + COST_PER_BYTE * (in_bytes + out_bytes) + COST_PER_CALL``; 0 when ``macs`` is 0
    (nothing is recomputed).

    Args:
        macs: the convolution's multiply-accumulates (:func:`conv_flops`).
        in_bytes: bytes of its input.
        out_bytes: bytes of its output.

    Returns:
        The cost the planner minimises.

    Example:
        >>> recompute_cost(0, 100, 100)
        0
        >>> recompute_cost(1_000_000, 1000, 2000) == 1_000_000 + 8 * 3000 + COST_PER_CALL
        True
    """
    if macs < 0 or in_bytes < 0 or out_bytes < 0:
        raise ValueError(f"recompute_cost expects non-negative sizes, but got macs={macs}, in_bytes={in_bytes}, "
                         f"out_bytes={out_bytes}")
    if macs == 0:
        return 0
    return macs + COST_PER_BYTE * (in_bytes + out_bytes) + COST_PER_CALL
