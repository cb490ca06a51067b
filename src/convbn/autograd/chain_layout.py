"""Memory layouts of the chain custom ops' outputs: one rule, shared by the real and fake kernels.

# Note: [the chain ops' output strides]
# Under ``torch.compile`` the fake kernel of ``convbn::chain_fwd`` / ``chain_bwd`` says the
# strides of every output, and the compiled graph checks the real op's outputs against them
# (``assert_size_stride``): a mismatch fails, and a wrong claim would let inductor read a
# buffer with wrong strides. The real strides come from the kernels the chain calls
# (convolution, batch norm, activation), which pick their own layout per backend, so the
# fake kernel cannot predict them in general. Instead both kernels apply one rule:
#
#   layer i's output format  f_i = channels_last  if f_{i-1} or W_i suggests channels_last
#                                  (f_{-1}: the chain input's format), else contiguous
#   parameter gradient       the parameter's own strides (dense) or contiguous
#   chain input gradient     the chain input's strides (dense) or contiguous in its format
#
# and the real kernel *conforms* each output to it (:func:`conform`): no copy where the
# backend already chose that layout -- the rule follows what CPU (oneDNN) and CUDA (cuDNN)
# convolutions choose, channels_last when the input or the weight is -- and a copy only
# where a kernel chose otherwise (e.g. a CPU 1x1 Conv3d returning contiguous).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from .._compat import (
    is_non_overlapping_and_dense_or_false,
    make_channels_last_strides_for,
    make_contiguous_strides_for,
    suggest_memory_format,
)

__all__ = ["memory_format_of", "layer_formats", "strides_for", "dense_strides", "conform", "empty_strided_like"]


def memory_format_of(t: Tensor) -> torch.memory_format:
    """The memory format ``t.suggest_memory_format()`` gives (contiguous where ambiguous).

    Args:
        t: a tensor (real, fake or with symbolic sizes).

    Returns:
        ``torch.channels_last`` / ``torch.channels_last_3d`` or ``torch.contiguous_format``.

    Example:
        >>> memory_format_of(torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last))
        torch.channels_last
    """
    return suggest_memory_format(t)


def layer_formats(x0: Tensor, weights: Sequence[Optional[Tensor]]) -> List[torch.memory_format]:
    """Each layer's output format (Note: [the chain ops' output strides]).

    Args:
        x0: the chain input (a head's first piece).
        weights: per layer its conv weight, ``None`` for a head.

    Returns:
        One memory format per layer.
    """
    fmt = memory_format_of(x0)
    out: List[torch.memory_format] = []
    for w in weights:
        if w is not None and fmt == torch.contiguous_format:
            fmt = memory_format_of(w) if w.dim() == x0.dim() else fmt
        out.append(fmt)
    return out


def strides_for(shape: Sequence[Any], fmt: torch.memory_format) -> Tuple[Any, ...]:
    """Strides of a dense tensor of ``shape`` in ``fmt`` (what ``torch.empty(..., memory_format=fmt)`` gives)."""
    if fmt == torch.contiguous_format or len(shape) not in (4, 5):
        return tuple(make_contiguous_strides_for(shape))
    return tuple(make_channels_last_strides_for(shape))


def dense_strides(t: Tensor) -> Tuple[Any, ...]:
    """``t``'s own strides when it is dense and non-overlapping (what ``empty_like`` keeps),
    else contiguous strides in its suggested format."""
    if is_non_overlapping_and_dense_or_false(t):
        return tuple(t.stride())
    return strides_for(t.shape, memory_format_of(t))


def empty_strided_like(ref: Tensor, shape: Sequence[Any], stride: Sequence[Any], dtype: Optional[torch.dtype] = None) -> Tensor:
    """An uninitialised tensor of ``shape``/``stride`` on ``ref``'s device, in ``dtype`` (default ``ref``'s)."""
    return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype or ref.dtype, device=ref.device)


def conform(t: Tensor, stride: Sequence[Any]) -> Tensor:
    """``t`` itself when its strides are ``stride``, else a copy with those strides."""
    if tuple(t.stride()) == tuple(stride):
        return t
    return empty_strided_like(t, t.shape, stride).copy_(t)
