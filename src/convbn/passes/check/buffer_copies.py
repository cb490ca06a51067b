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

Note: [copies lent while a step cannot write them]
A copy is held to put a buffer back after a step that writes it. For a step that is known not
to write some buffers (the check's eager step with its BatchNorms' statistics left unwritten:
``check/quiet_norms.py``), every open snapshot's copy of them that still holds the buffer's bits
is *lent* for a block (:func:`copies_lent`): dropped, so that no copy of them is alive at the
step's peak, and taken again from the buffer after the block, which then still holds those
bits. A lent buffer whose version counter moved in the block was written after all; its copies
are gone, and :func:`copies_lent` raises rather than leave the model changed unseen.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar, Token
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["buffer_copy", "open_copies", "close_copies", "copies_lent"]

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


def open_copies(copies: Dict[int, Tuple[Tensor, Tensor]]) -> Token:
    """Offer a snapshot's copies (``id(buffer) -> (buffer, copy)``, the snapshot's own dict: a
    copy lent by :func:`copies_lent` is lent from the snapshot too) to the snapshots opened inside
    it; the token closes them (:func:`close_copies`)."""
    return _OPEN.set((*_OPEN.get(), copies))


def close_copies(token: Token) -> None:
    """Withdraw the copies :func:`open_copies` offered."""
    _OPEN.reset(token)


@contextlib.contextmanager
def copies_lent(buffers: Sequence[Tensor]) -> Iterator[None]:
    """Every open snapshot's copy of ``buffers`` that still holds the buffer's bits dropped for
    the block and taken again from the buffer after it (Note: [copies lent while a step cannot
    write them]).

    Raises:
        RuntimeError: a lent buffer was written in the block (its copies are gone).
    """
    lent = [(copies, b) for b in buffers for copies in _OPEN.get() if _holds_bits(copies, b)]
    for copies, b in lent:
        del copies[id(b)]  # no other reference to a copy is left in this frame while the block runs
    versions = {id(b): b._version for _, b in lent}
    try:
        yield
    finally:
        fresh: Dict[int, Tensor] = {}
        for copies, b in lent:
            if id(b) not in fresh:
                fresh[id(b)] = b.detach().clone()
            copies[id(b)] = (b, fresh[id(b)])
    moved = [tuple(b.shape) for _, b in lent if b._version != versions[id(b)]]
    if moved:
        raise RuntimeError(f"convbn's check: {len(moved)} buffer(s) its eager step was to leave unwritten were written "
                           f"(shapes {moved[:4]}); their values before the step are lost")


def _holds_bits(copies: Dict[int, Tuple[Tensor, Tensor]], b: Tensor) -> bool:
    held = copies.get(id(b))
    return held is not None and held[0] is b and same_bits(b, held[1])
