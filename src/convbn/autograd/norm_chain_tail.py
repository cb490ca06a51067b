"""A per-sample norm chain layer's element-wise tail as differentiable eager ops, its dropouts
drawing from the global RNG (their states captured) or replaying captured states (Note: [a
dropout in a per-sample norm chain] in autograd/norm_chain.py)."""
from __future__ import annotations

from typing import List, Optional, Sequence

from torch import Tensor

from ..functional.activations import Activation
from ..functional.tail import DropoutOp, PReLUOp, RNGState, TailOp, dropout_draw

__all__ = ["norm_tail"]


def norm_tail(tail: Sequence[TailOp], act: Activation, z: Tensor, tws: Sequence[Tensor], owned: bool,
              capture: Optional[List[RNGState]] = None, replay: Optional[Sequence[RNGState]] = None) -> Tensor:
    """``tail`` on ``z`` (``act`` alone where ``tail`` is empty), with eager's differentiable ops.

    Args:
        tail: the layer's element-wise ops; ``tws`` the PReLU weights in order.
        owned: ``z`` is the norm's fresh output (else the caller's conv output, or a leaf of a
            recompute's graph: an in-place dropout works on a copy).
        capture: forward: each dropout's RNG state is appended here before it draws.
        replay: a recompute: each dropout runs from its captured state, the global streams
            left alone.
    """
    if not tail:
        return z if act.is_identity else act(z)
    ws, states = iter(tws), None if replay is None else iter(replay)
    for op in tail:
        if isinstance(op, DropoutOp):
            z = dropout_draw(op, z, owned, capture, states)
        else:
            z = op.reference(z, next(ws)) if isinstance(op, PReLUOp) else op(z)  # type: ignore[operator]
        owned = True
    return z
