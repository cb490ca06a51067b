"""The transient scratch a CPU kernel allocates inside its operator (convolutions, BatchNorm's
backward), modelled per call.

# Note: [kernel scratch]
# A CPU convolution allocates buffers that are not tensors (oneDNN's operands reordered into
# its blocked layouts, the slow path's im2col columns) and frees them before the operator
# returns. No tensor meter sees them, yet they are the process's memory while the operator
# runs: the bytes in use during an operator are the live tensors before it, its outputs and
# this scratch. :func:`timeline` with ``kernel_scratch=True`` records the scratch of each
# convolution (:attr:`TimelinePoint.scratch`) and stops a step against ``bytes + scratch``;
# :func:`convbn.max_batch` fits with it (Note: [what the limit holds] in batch_search.py).
# The step's peak (:attr:`Timeline.peak`, every figure of SPEC section 3) stays live tensors.
#
# The scratch is read off a table (:data:`ROWS`), a row per kernel family torch picks
# (``_compat.conv_backend``: torch's own choice from shapes, dtype and threads; a 1x1,
# stride-1 float32 convolution on one thread runs the slow path below batch 16 and oneDNN from
# 16 on, so the row is chosen again at every batch). Each row is a bound, in bytes of the
# call's operands, measured with the CPU allocator's peak during the operator less its
# outputs (:func:`convbn.memory.allocator_peak`; torch 2.13.0+cpu, one thread):
# ``tests/test_kernel_scratch.py`` holds every row against that measurement on a grid of
# convolutions, so a torch whose kernels need more fails there instead of breaking the bound.
# ``x``, ``y``: the input's and output's bytes in oneDNN's blocked layouts (channels rounded up
# to 16; the input plain below 8 channels, unless backward makes its gradient), ``w`` the
# weight's, ``cols`` the im2col columns
# (``N * C_in * prod(kernel) * prod(output size)`` elements; transposed: the output's channels and
# the input's size), ``s``: a stride above 1 (0 or 1), ``e``: ``s`` where the input's gradient is
# asked, ``groups == 1`` and no dilation (else 0), ``K`` 64 KiB. Measured in brackets (exact bytes,
# batch 4 unless said):
#
# =====================  =========================================  =================================
# family (CPU only)      forward                                    backward
# =====================  =========================================  =================================
# oneDNN, contiguous     max(x + w, y) + s x / 8 + K                (1 + e) x + y + 2 w + K
#                        (3x3 s1 64 ch 56: x + w; stem 7x7 s2:      (3x3 s1: x + y; 3x3 s2: 2 x - w;
#                        y; 1x1 s2: x + w + x / 16 + 128)           grouped or dilated s2: x + y)
# oneDNN, transposed     (1 + s) y + w + K (s2: 2 y; s1: y + w)     x + y + 2 w + K (x + y)
# oneDNN, channels-last  w + K (w + 8 KiB)                          2 w + 4 MiB (3x3: 2 w; the
#                                                                   3-channel stem 3.41 MiB at
#                                                                   batch 8 and 21, 224²)
# slow (im2col)          cols + K (float64 3x3 s2: cols)            cols + K (cols)
# slow, 1x1 s1 no pad    0 (0)                                      0 (0)
# family unknown         the most of the rows above                 the same
# =====================  =========================================  =================================
#
# ``aten.native_batch_norm_backward`` (CPU) takes a buffer the size of its input where the
# input's gradient is asked, none otherwise: exact for float32, float64 and bfloat16, 1-D, 2-D
# and 3-D, training and eval, affine or not, batches 2 to 52 (``tests/test_kernel_scratch.py``).
# An eager step of a BatchNorm net peaks there as often as in a convolution's backward.
#
# The bound is loose by up to 1.6x where torch's kernels take less than the row (a strided 1x1
# convolution's backward: 1.32x), 2.4x for a 3-channel input whose gradient is asked (the row
# pads it to 16 channels, the kernel less), never below what was measured on the grid.
#
# On CUDA the allocator meter already counts workspaces (a point is the allocator's peak during
# its operator), and no row applies: the scratch of a call on any device but the CPU is 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from .._compat import conv_backend

__all__ = ["ConvCall", "NormCall", "ROWS", "conv_call", "kernel_call", "scratch_bytes"]

aten = torch.ops.aten

#: the constant of the oneDNN and slow rows (oneDNN's own scratchpad and small reorders)
K = 64 * 1024
#: the constant of oneDNN's channels-last backward (the 3-channel stem: 3.41 MiB at batch 8 and 21)
K_CHANNELS_LAST = 4 * 1024 * 1024

#: the table's rows: family -> (forward, backward), as Note: [kernel scratch] states them
ROWS = {
    "onednn": ("max(x + w, y) + s x / 8 + K", "(1 + e) x + y + 2 w + K"),
    "onednn transposed": ("(1 + s) y + w + K", "x + y + 2 w + K"),
    "onednn channels-last": ("w + K", "2 w + 4 MiB"),
    "slow": ("cols + K", "cols + K"),
    "slow pointwise": ("0", "0"),
    "batch norm": ("0", "x where the input's gradient is asked, else 0"),
}


@dataclass(frozen=True)
class NormCall:
    """One ``aten.native_batch_norm_backward`` call, as the table reads it.

    Attributes:
        device: the device type.
        x_shape: the input's sizes.
        dtype: the input's dtype.
        grad_input: whether the input's gradient is asked (the output mask's first entry).
    """

    device: str
    x_shape: Tuple[int, ...]
    dtype: torch.dtype
    grad_input: bool
    backward: bool = True

    def at_batch(self, n: int) -> "NormCall":
        """The same call with ``n`` samples."""
        return replace(self, x_shape=(n, *self.x_shape[1:]))

    def family(self) -> str:
        """``"batch norm"``: its row of :data:`ROWS`."""
        return "batch norm"


@dataclass(frozen=True)
class ConvCall:
    """One convolution operator's call, as the scratch table reads it (shapes, not tensors):
    ``aten.convolution`` (``backward=False``) or ``aten.convolution_backward``.

    Attributes:
        backward: the backward operator (else the forward).
        device: the device type (``"cpu"``, ``"cuda"``).
        x_shape / w_shape / y_shape: input, weight and output sizes.
        dtype: the input's dtype.
        channels_last: the input or the weight is in a channels-last memory format.
        stride / padding / dilation / output_padding / groups / transposed: the convolution's.
        grads: backward's output mask (input, weight, bias) (forward: all ``False``).
    """

    backward: bool
    device: str
    x_shape: Tuple[int, ...]
    w_shape: Tuple[int, ...]
    y_shape: Tuple[int, ...]
    dtype: torch.dtype
    channels_last: bool
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]
    dilation: Tuple[int, ...]
    output_padding: Tuple[int, ...]
    groups: int
    transposed: bool
    grads: Tuple[bool, ...] = (False, False, False)

    def at_batch(self, n: int) -> "ConvCall":
        """The same call with ``n`` samples (input's and output's first dimension)."""
        return replace(self, x_shape=(n, *self.x_shape[1:]), y_shape=(n, *self.y_shape[1:]))

    def family(self) -> str:
        """The row of :data:`ROWS` (``"unknown"``: torch did not say), from torch's own choice."""
        stand_in = torch.empty(1, dtype=self.dtype).expand(*self.x_shape)  # no data read, nothing allocated
        w = torch.empty(1, dtype=self.dtype).expand(*self.w_shape)
        backend = conv_backend(stand_in, w, self.stride, self.padding, self.dilation, self.transposed,
                               self.output_padding, self.groups)
        if backend is None:
            return "unknown"
        if backend == "???" and self.transposed:  # torch's Python enum has no name for MkldnnTranspose
            return "onednn transposed"
        if backend.startswith("Mkldnn"):
            if self.transposed:
                return "onednn transposed"
            return "onednn channels-last" if self.channels_last else "onednn"
        if backend.startswith("Slow"):
            pointwise = all(k == 1 for k in self.w_shape[2:]) and all(s == 1 for s in self.stride) \
                and not any(self.padding) and not self.transposed
            return "slow pointwise" if pointwise else "slow"
        return "unknown"


def _bytes(shape: Tuple[int, ...], size: int, blocked: bool = True) -> int:
    """Bytes of a tensor of ``shape`` in oneDNN's blocked layout (channels rounded up to 16), or
    plain (``blocked=False``)."""
    c = shape[1] if len(shape) > 1 else 1
    c = -(-c // 16) * 16 if blocked else c
    return prod(shape[:1]) * c * prod(shape[2:]) * size


def scratch_bytes(call: Union[ConvCall, NormCall, None]) -> int:
    """The scratch bytes :data:`ROWS` bounds for ``call`` (0 for ``None`` and off the CPU;
    Note: [kernel scratch]).

    Example:
        >>> c = ConvCall(True, "cpu", (4, 64, 56, 56), (64, 64, 3, 3), (4, 64, 56, 56), torch.float32, False,
        ...              (1, 1), (1, 1), (1, 1), (0, 0), 1, False, (True, True, False))
        >>> scratch_bytes(c) - (3211264 + 3211264 + 2 * 147456 + 65536)  # x + y + 2 w + K
        0
    """
    if call is None or call.device != "cpu":
        return 0
    if isinstance(call, NormCall):
        return prod(call.x_shape) * torch.empty((), dtype=call.dtype).element_size() if call.grad_input else 0
    family = call.family()
    if family == "unknown":
        return max(_row(call, f) for f in ROWS if f != "batch norm")
    return _row(call, family)


def _row(call: ConvCall, family: str) -> int:
    size = torch.empty((), dtype=call.dtype).element_size()
    x, y = _bytes(call.x_shape, size), _bytes(call.y_shape, size)
    w = prod(call.w_shape) * size
    if family == "slow pointwise":
        return 0
    if family == "slow":
        side = call.y_shape[1] if call.transposed else call.x_shape[1]
        spatial = call.x_shape[2:] if call.transposed else call.y_shape[2:]
        return call.x_shape[0] * side * prod(call.w_shape[2:]) * prod(spatial) * size + K
    s = int(any(v > 1 for v in call.stride))
    if family == "onednn channels-last":
        return 2 * w + K_CHANNELS_LAST if call.backward else w + K
    if family == "onednn transposed":
        return x + y + 2 * w + K if call.backward else (1 + s) * y + w + K
    # below 8 channels oneDNN reads the input plain (a first layer's image), but blocks its gradient
    if call.x_shape[1] < 8 and not (call.backward and call.grads[0]):
        x = _bytes(call.x_shape, size, blocked=False)
    if not call.backward:
        return max(x + w, y) + s * x // 8 + K
    # an input-sized buffer beside the input's gradient: strided, ungrouped, undilated, input grad asked
    extra = s * int(call.groups == 1 and all(d == 1 for d in call.dilation) and call.grads[0])
    return (1 + extra) * x + y + 2 * w + K


def _channels_last(t: Tensor) -> bool:
    if t.dim() == 4:
        fmt = torch.channels_last
    elif t.dim() == 5:
        fmt = torch.channels_last_3d
    else:
        return False
    return t.is_contiguous(memory_format=fmt) and not t.is_contiguous()


def kernel_call(func: Any, args: Any, kwargs: Any = None) -> Union[ConvCall, NormCall, None]:
    """The :class:`ConvCall` or :class:`NormCall` of an operator about to run, ``None`` for an
    operator the table has no row for."""
    if func is aten.native_batch_norm_backward.default and not kwargs:
        x, mask = args[1], args[-1]
        if isinstance(x, Tensor):
            return NormCall(x.device.type, tuple(x.shape), x.dtype, bool(mask[0]))
        return None
    return conv_call(func, args, kwargs)


def conv_call(func: Any, args: Any, kwargs: Any = None) -> Optional[ConvCall]:
    """The :class:`ConvCall` of an operator about to run, ``None`` for any other operator."""
    if kwargs:
        return None
    if func is aten.convolution.default:
        x, w, _, stride, padding, dilation, transposed, output_padding, groups = args
        y_shape = _output_shape(x, w, stride, padding, dilation, transposed, output_padding, groups)
        grads = (False, False, False)
    elif func is aten.convolution_backward.default:
        gy, x, w, _, stride, padding, dilation, transposed, output_padding, groups, mask = args
        y_shape, grads = tuple(gy.shape), tuple(bool(m) for m in mask)
    else:
        return None
    if not isinstance(x, Tensor) or not isinstance(w, Tensor) or x.dim() < 3:
        return None
    return ConvCall(func is aten.convolution_backward.default, x.device.type, tuple(x.shape), tuple(w.shape), y_shape,
                    x.dtype, _channels_last(x) or _channels_last(w), tuple(stride), tuple(padding), tuple(dilation),
                    tuple(output_padding), int(groups), bool(transposed), grads)


def _output_shape(x: Tensor, w: Tensor, stride: Any, padding: Any, dilation: Any, transposed: bool,
                  output_padding: Any, groups: int) -> Tuple[int, ...]:
    """The convolution's output size (``torch.nn`` docs' formulas)."""
    sizes = []
    for i, n in enumerate(x.shape[2:]):
        k = (w.shape[2 + i] - 1) * dilation[i] + 1
        if transposed:
            sizes.append((n - 1) * stride[i] - 2 * padding[i] + k + output_padding[i])
        else:
            sizes.append((n + 2 * padding[i] - k) // stride[i] + 1)
    channels = w.shape[1] * groups if transposed else w.shape[0]
    return (x.shape[0], channels, *sizes)
