"""The copies of a model's buffers that its state snapshots hold, shared where they are nested.

Note: [nested snapshots share their copies]
A check runs one training step inside :class:`~convbn.passes.check.validate.StateSnapshot`, and
``convert`` runs its whole check inside another one (tracing and checking must leave the running
statistics as they were). Each took its own copy of every buffer, so while the check's eager
step ran (its peak is a training step's) two copies of the BatchNorm statistics sat beside it,
both holding the same values. A snapshot now takes the copy an enclosing snapshot of the same
thread already holds for a buffer, where that copy still has the buffer's very bits (compared
as bytes: ``-0.0`` and ``0.0`` differ, a NaN equals itself); it restores from it exactly as
from its own, and only reads it. A buffer changed since the enclosing snapshot was taken, or
one whose bytes cannot be read (sparse, quantised, meta), gets a copy of its own.
"""
from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Dict, List, Tuple

import torch
from torch import Tensor

__all__ = ["buffer_copy", "open_copies", "close_copies"]

#: the copies held by the snapshots open in this thread (innermost last), each by its buffer's id
_OPEN: ContextVar[Tuple[Dict[int, Tuple[Tensor, Tensor]], ...]] = ContextVar("convbn_snapshot_copies", default=())


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes (same dtype, shape and device); ``False`` where
    their bytes cannot be read as such."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    try:
        return bool(torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def buffer_copy(buffer: Tensor) -> Tensor:
    """A copy of ``buffer``'s values: the one an enclosing snapshot holds where it still has the
    buffer's bits, else a fresh clone (Note: [nested snapshots share their copies])."""
    for copies in reversed(_OPEN.get()):
        held = copies.get(id(buffer))
        if held is not None and held[0] is buffer and same_bits(buffer, held[1]):
            return held[1]
    return buffer.detach().clone()


def open_copies(pairs: List[Tuple[Tensor, Tensor]]) -> Token:
    """Offer a snapshot's ``(buffer, copy)`` pairs to the snapshots opened inside it; the token
    closes them (:func:`close_copies`)."""
    return _OPEN.set((*_OPEN.get(), {id(b): (b, v) for b, v in pairs}))


def close_copies(token: Token) -> None:
    """Withdraw the copies :func:`open_copies` offered."""
    _OPEN.reset(token)
