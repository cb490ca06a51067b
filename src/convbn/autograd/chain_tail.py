"""A chain layer's general tail: forward, rebuild and backward of a sequence of element-wise ops.

A layer whose tail is one :class:`~convbn.functional.activations.Activation` takes the
fast path in :mod:`convbn.autograd.chain` (in-place buffers). Any other tail -- PReLU,
dropout, several ops -- runs here. Dropouts replay eager's random stream from the RNG
state captured in forward (Note: [dropout in a chain] in functional/tail.py).

# Note: [general tail backward]
# Backward recomputes the tail's intermediates from ``z`` (the BN output, itself
# recomputed from the conv output), keeping for each op only what its derivative needs:
# an activation or PReLU its input, a dropout nothing but its input's shape and strides
# (its slope is regenerated from the RNG state). Then it walks the ops last to first.
# An activation's derivative is written into its (consumed) input's buffer where that
# buffer is the backward's own, as on the fast path.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

from torch import Tensor

from ..functional.activations import Activation
from ..functional.tail import DropoutOp, PReLUOp, RNGState, TailOp, dropout_draw, replay_rng

__all__ = ["tail_forward", "tail_backward", "tail_reference", "n_tail_params"]


def n_tail_params(tail: Sequence[TailOp]) -> int:
    """Parameters the tail takes in the chain's flat layout (one per PReLU)."""
    return sum(isinstance(op, PReLUOp) for op in tail)


def tail_forward(
    z: List[Tensor],
    tail: Sequence[TailOp],
    weights: Sequence[Tensor],
    owned: bool,
    capture: Optional[List[RNGState]] = None,
    replay: Optional[Sequence[RNGState]] = None,
) -> Tensor:
    """Apply ``tail`` to ``z`` (no autograd).

    Args:
        z: a one-element list holding the BN output (or an end layer's conv output): the
            tensor is taken out of it, so its buffer is freed as soon as the ops are done
            with it (an argument would stay referenced by the caller for the whole call).
        tail: the ops; ``weights`` the PReLU weights in order.
        owned: ``z``'s buffer may be overwritten (else in-place ops work on a copy).
        capture: forward: each dropout's RNG state is appended here before it draws.
        replay: rebuild in backward: each dropout runs from its captured state, leaving
            the global streams alone.

    Returns:
        The tail's output.
    """
    ws = iter(weights)
    states: Optional[Iterator[RNGState]] = None if replay is None else iter(replay)
    u = z.pop()
    for op in tail:
        if isinstance(op, Activation):
            u = op(u, inplace=owned)
        elif isinstance(op, PReLUOp):
            u = op(u, next(ws))
        else:
            u = dropout_draw(op, u, owned, capture, states)
        owned = True  # every op above left a buffer of the tail's own
    return u


def tail_backward(
    grad_out: Tensor,
    z: List[Tensor],
    tail: Sequence[TailOp],
    weights: Sequence[Tensor],
    states: Sequence[RNGState],
    needs_w: Sequence[bool],
    owned: bool,
) -> Tuple[Tensor, List[Optional[Tensor]]]:
    """``(grad_z, grad of each PReLU weight)`` of :func:`tail_forward` (Note: [general tail backward]).

    ``grad_out`` is never written to; ``z`` (a one-element list, as in :func:`tail_forward`)
    is consumed when ``owned``.
    """
    ws = list(weights)
    saved, own = _rebuild_op_inputs(z, tail, ws, states, owned)
    grads_w: List[Optional[Tensor]] = [None] * len(ws)
    g = grad_out
    wi = n_tail_params(tail)
    for j in reversed(range(len(tail))):
        op, s = tail[j], saved.pop()
        if isinstance(op, DropoutOp):
            size, stride, state = s  # type: ignore[misc]
            with replay_rng(state):
                slope = op.slope(size, stride, grad_out.dtype, grad_out.device)
            g = g * slope  # eager: grad * noise
            del slope
        elif isinstance(op, PReLUOp):
            wi -= 1
            g, grads_w[wi] = op.backward(g, s, ws[wi], needs_w[wi])  # type: ignore[arg-type]
        else:
            g = op.backward_(g, s) if own[j] else op.backward(g, s)  # type: ignore[arg-type]
        del s
    return g, grads_w


def _rebuild_op_inputs(z: List[Tensor], tail: Sequence[TailOp], ws: Sequence[Tensor], states: Sequence[RNGState],
                       owned: bool) -> Tuple[List[object], List[bool]]:
    """Per op of ``tail``, what its derivative needs: its input (activation, PReLU), rebuilt
    from ``z`` (consumed), or ``(size, stride, RNG state)`` (dropout); and whether that input's
    buffer is the backward's own. The ops are replayed only as far as the last one whose
    derivative needs its input."""
    need_input = [not isinstance(op, DropoutOp) for op in tail]
    last_needed = max((j for j, n in enumerate(need_input) if n), default=-1)
    saved: List[object] = []
    own: List[bool] = []
    u: Optional[Tensor] = z.pop()
    meta = (u.size(), u.stride())  # element-wise ops keep size and (dense) strides
    u_owned, wi, si = owned, 0, 0
    for j, op in enumerate(tail):
        if isinstance(op, DropoutOp):
            saved.append((*meta, states[si]))
            own.append(False)
            if j < last_needed and u is not None:
                if op.inplace and not u_owned:
                    u = u.clone()
                with replay_rng(states[si]):
                    u = op(u)
                u_owned = True
            si += 1
            continue
        saved.append(u)
        own.append(u_owned)
        if j < last_needed and u is not None:
            u = op(u) if isinstance(op, Activation) else op(u, ws[wi])  # type: ignore[call-arg]
            u_owned = True
        if isinstance(op, PReLUOp):
            wi += 1
        if j >= last_needed:
            u = None  # nothing after this op needs an input: stop rebuilding
    return saved, own


def tail_reference(z: Tensor, tail: Sequence[TailOp], weights: Sequence[Tensor],
                   states: Sequence[RNGState]) -> Tensor:
    """:func:`tail_forward` with differentiable ops (double backward); dropouts draw the
    masks of forward from their captured states."""
    ws, st = iter(weights), iter(states)
    u = z
    for op in tail:
        if isinstance(op, Activation):
            u = op(u)
        elif isinstance(op, PReLUOp):
            u = op.reference(u, next(ws))
        else:
            with replay_rng(next(st)):
                u = op(u, inplace=False) if not op.inplace else op(u.clone(), inplace=True)
    return u
