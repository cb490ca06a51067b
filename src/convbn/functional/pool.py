"""Max and average pooling whose backward needs only the input's *shape*.

ATen's pooling backwards (``max_pool{2,3}d_with_indices_backward``, ``avg_pool{2,3}d_backward``)
take the forward input, but read nothing from it except its sizes, dtype, device and
memory format: max pooling routes each output gradient to the position its ``indices``
name, average pooling spreads it over its window. Eager autograd nevertheless saves the
whole input from forward to backward. These functions run the same ATen kernels; the
backward gets a *stand-in* for the input (:func:`shape_stand_in`, no memory), which gives
eager's gradient bit for bit.

.. math::
    \\text{max:}\\ \\frac{\\partial L}{\\partial x_j} = \\sum_{o\\,:\\,\\mathrm{idx}_o = j} g_o
    \\qquad
    \\text{avg:}\\ \\frac{\\partial L}{\\partial x_j} = \\sum_{o\\,\\ni\\, j} \\frac{g_o}{d_o}

with ``d_o`` the window's divisor (its size, its in-bounds size without
``count_include_pad``, or ``divisor_override``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["PoolSpec", "pool_forward", "pool_backward", "shape_stand_in", "stand_in_fits", "compact_indices"]

aten = torch.ops.aten

IntOrSeq = Union[int, Sequence[int]]


def _ints(v: IntOrSeq, dims: int, name: str) -> List[int]:
    """``v`` as a list of ``dims`` ints (one int is repeated), as ``nn`` pooling reads it."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int or a sequence of ints, but got {v!r}")
    if isinstance(v, int):
        return [v] * dims
    out = [int(e) for e in v]
    if len(out) == 1:
        return out * dims
    if len(out) != dims:
        raise ValueError(f"{name} must be an int or {dims} ints, but got {v!r}")
    return out


@dataclass(frozen=True)
class PoolSpec:
    """One pooling call's arguments, normalised.

    Attributes:
        kind: ``"max"`` or ``"avg"``.
        dims: spatial dimensions, 2 or 3.
        kernel_size, stride, padding, dilation: per spatial dimension (``stride`` empty: the
            kernel size, as ATen reads it; ``dilation`` ones for average pooling).
        ceil_mode: output size rounded up.
        count_include_pad: average pooling divides by the padded window size.
        divisor_override: average pooling's fixed divisor, if given.
    """

    kind: str
    dims: int
    kernel_size: Tuple[int, ...]
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]
    dilation: Tuple[int, ...]
    ceil_mode: bool = False
    count_include_pad: bool = True
    divisor_override: Optional[int] = None

    @classmethod
    def make(cls, kind: str, dims: int, kernel_size: IntOrSeq, stride: Optional[IntOrSeq] = None,
             padding: IntOrSeq = 0, dilation: IntOrSeq = 1, ceil_mode: bool = False,
             count_include_pad: bool = True, divisor_override: Optional[int] = None) -> "PoolSpec":
        """Normalise ``nn``/``F``-style arguments (``stride=None`` or ``[]``: the kernel size).

        Example:
            >>> PoolSpec.make("max", 2, 3, 2, 1).stride
            (2, 2)
        """
        if kind not in ("max", "avg"):
            raise ValueError(f"kind must be 'max' or 'avg', but got {kind!r}")
        if dims not in (2, 3):
            raise ValueError(f"dims must be 2 or 3, but got {dims!r}")
        no_stride = stride is None or (not isinstance(stride, int) and len(stride) == 0)
        return cls(
            kind, dims, tuple(_ints(kernel_size, dims, "kernel_size")),
            () if no_stride else tuple(_ints(stride, dims, "stride")),  # type: ignore[arg-type]
            tuple(_ints(padding, dims, "padding")),
            tuple(_ints(dilation, dims, "dilation")) if kind == "max" else (1,) * dims,
            bool(ceil_mode), bool(count_include_pad), divisor_override,
        )


def pool_forward(x: Tensor, spec: PoolSpec, indices: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """``(output, indices)``: ATen's pooling of ``x`` (``indices`` ``None`` for average pooling,
    and for max pooling when not asked for: ``aten.max_pool{2,3}d``, as eager calls it)."""
    k, s, p = list(spec.kernel_size), list(spec.stride), list(spec.padding)
    if spec.kind == "max" and not indices:
        op = aten.max_pool2d if spec.dims == 2 else aten.max_pool3d
        return op(x, k, s, p, list(spec.dilation), spec.ceil_mode), None
    if spec.kind == "max":
        op = aten.max_pool2d_with_indices if spec.dims == 2 else aten.max_pool3d_with_indices
        out, idx = op(x, k, s, p, list(spec.dilation), spec.ceil_mode)
        return out, idx
    op = aten.avg_pool2d if spec.dims == 2 else aten.avg_pool3d
    return op(x, k, s, p, spec.ceil_mode, spec.count_include_pad, spec.divisor_override), None


def shape_stand_in(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor with ``shape``, ``dtype`` and ``device`` and no memory (one element, expanded).

    # Note: [a stand-in for the pooling input]
    # The pooling backwards size their result like the input, in the input's memory format
    # (``suggest_memory_format``), and read nothing else of it. An expanded 0-d tensor has
    # the sizes; its all-zero strides read as the default (contiguous) format, so it stands
    # in for a contiguous input only (:func:`stand_in_fits`); any other input is kept.
    """
    return torch.empty((), dtype=dtype, device=device).expand(*shape)


def stand_in_fits(x: Tensor) -> bool:
    """Whether :func:`shape_stand_in` gives ``x``'s gradient its layout (``x`` contiguous)."""
    return x.is_contiguous()


def pool_backward(grad: Tensor, like: Tensor, spec: PoolSpec, indices: Optional[Tensor]) -> Tensor:
    """The input's gradient; ``like`` is the input or its :func:`shape_stand_in`.

    Differentiable when ``grad`` requires grad (double backward: ATen's own formulas)."""
    k, s, p = list(spec.kernel_size), list(spec.stride), list(spec.padding)
    if spec.kind == "max":
        op = aten.max_pool2d_with_indices_backward if spec.dims == 2 else aten.max_pool3d_with_indices_backward
        # Note: [max-pool indices in half the bytes]: ATen's kernel reads int64 indices
        return op(grad, like, k, s, p, list(spec.dilation), spec.ceil_mode, indices.to(torch.int64))
    op = aten.avg_pool2d_backward if spec.dims == 2 else aten.avg_pool3d_backward
    return op(grad, like, k, s, p, spec.ceil_mode, spec.count_include_pad, spec.divisor_override)


def compact_indices(indices: Tensor, spec: PoolSpec, x_shape: Sequence[int]) -> Tensor:
    """Max pooling's ``indices`` in ``int32`` where every flat index into one input plane fits,
    else as given: the same numbers in half of ``int64``'s bytes (:func:`pool_backward` widens
    them again).

    # Note: [max-pool indices in half the bytes]
    # ATen names each output's maximum by its flat position in its ``(n, c)`` input plane, an
    # ``int64`` per output element, which a lean pool keeps from forward to backward. A plane
    # below ``2**31`` elements (every real one) needs 32 bits: on MONAI's BasicUNet 3-D at batch
    # 2, 48^3, that is 2.0 MiB fewer held through the whole backward, at its peak included. The
    # backward's ``int64`` copy lives only while its pooling's backward runs, and the ``int32`` one
    # is let go before ATen's kernel runs (``LeanPoolFunction.backward``): that moment holds what
    # eager's holds, so a step peaking in a pool's backward (a small ResNet's stem) is not raised.
    """
    plane = 1
    for size in list(x_shape)[-spec.dims:]:
        plane *= int(size)
    return indices.to(torch.int32) if indices.dtype == torch.int64 and plane < 2 ** 31 else indices

