"""A chain's input ``x0`` given as pieces concatenated along the channel dimension.

.. math::
    x_0 = \\operatorname{cat}(p_1, \\dots, p_m;\\ \\text{dim}=1), \\qquad
    \\frac{\\partial L}{\\partial p_j} = \\frac{\\partial L}{\\partial x_0}[:, c_j : c_j + C_j]

where ``c_j`` is the first channel of piece ``j`` and ``C_j`` its channel count.

A DenseNet layer normalises the concatenation of every earlier feature map. The pieces
are earlier layers' outputs that later layers keep alive anyway, so a chain that keeps
the *pieces* for backward instead of their concatenation keeps nothing new: memory
linear in depth instead of quadratic (Pleiss et al., "Memory-Efficient Implementation of
DenseNets", 2017). :class:`ChainInput` is the one place a chain turns its pieces into
``x0`` (forward, and again in backward when ``x0`` is needed) and the gradient of ``x0``
back into the pieces' gradients (narrow views of one buffer, no copy). Keeping a piece
keeps its whole storage: a piece that is a view into a larger tensor keeps that tensor.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["ChainInput", "concat_shape", "split_channels", "split_grad"]


def concat_shape(pieces: Sequence[Tensor]) -> Tuple[int, ...]:
    """The shape of ``torch.cat(pieces, 1)`` (pieces agree on every other dimension).

    Raises:
        ValueError: no piece, or pieces whose other dimensions differ.
    """
    if not pieces:
        raise ValueError("a chain input needs at least one piece")
    first = tuple(pieces[0].shape)
    for p in pieces[1:]:
        if p.dim() != len(first) or tuple(p.shape[:1]) + tuple(p.shape[2:]) != first[:1] + first[2:]:
            raise ValueError(
                f"pieces concatenated along dim 1 must agree on every other dimension, but got shapes "
                f"{[tuple(q.shape) for q in pieces]}"
            )
    return (first[0], sum(int(p.shape[1]) for p in pieces)) + first[2:]


def split_grad(grad: Optional[Tensor], sizes: Sequence[int], needs: Sequence[bool]) -> List[Optional[Tensor]]:
    """The pieces' gradients (``sizes`` channels each) from the chain input's ``grad``:
    narrow views of one buffer; ``None`` where a piece needs none (or ``grad`` is ``None``)."""
    if grad is None:
        return [None] * len(sizes)
    if len(sizes) == 1:
        return [grad if needs[0] else None]
    return [g if want else None for g, want in zip(split_channels(grad, sizes), needs)]


def split_channels(grad: Tensor, sizes: Sequence[int]) -> List[Tensor]:
    """``grad`` split along dim 1 into ``sizes`` channels each: narrow views of one buffer."""
    out: List[Tensor] = []
    start = 0
    for c in sizes:
        out.append(grad.narrow(1, start, c))
        start += c
    return out


class ChainInput:
    """The chain input: pieces to concatenate along dim 1 (one piece: the tensor itself).

    Args:
        pieces: the tensors, in channel order.

    Example:
        >>> a, b = torch.randn(2, 3, 4, 4), torch.randn(2, 5, 4, 4)
        >>> x = ChainInput([a, b])
        >>> x.shape, x.sizes
        ((2, 8, 4, 4), [3, 5])
        >>> torch.equal(x.build(), torch.cat([a, b], 1))
        True
    """

    def __init__(self, pieces: Sequence[Tensor]) -> None:
        self.pieces: List[Tensor] = list(pieces)
        self.shape: Tuple[int, ...] = concat_shape(self.pieces)
        self.sizes: List[int] = [int(p.shape[1]) for p in self.pieces]

    def __len__(self) -> int:
        return len(self.pieces)

    def build(self) -> Tensor:
        """``x0``: the pieces concatenated into one new buffer (one piece: that tensor, not a copy).

        With several pieces the result is the caller's own buffer, which it may overwrite.
        A differentiable ``torch.cat`` when grad mode is on (double backward rebuilds ``x0``
        from the pieces inside the graph).
        """
        if len(self.pieces) == 1:
            return self.pieces[0]
        return torch.cat(self.pieces, 1)  # the memory format eager's cat gives
