"""A check's backward where ``torch.autograd.grad`` is refused: ``.backward()`` with every
``.grad`` it could touch set aside and put back exactly.

Note: [a check's backward through a reentrant checkpoint]
A check differentiates with ``torch.autograd.grad`` so that the user's ``.grad`` fields are
never touched. A reentrant ``torch.utils.checkpoint`` (``use_reentrant=True``) refuses it: its
backward recomputes the block and calls ``torch.autograd.backward`` itself, which only the
``.grad`` fields of the leaves can receive. Where the graph holds such a checkpoint
(``CheckpointFunctionBackward``), the check runs a plain ``backward`` instead: first the
``.grad`` of each tensor it could accumulate into (the parameters given, the tensors
differentiated, every leaf the graph reaches before a checkpoint) is set aside and set to
``None``; after the backward each one's gradient is read, and the ``.grad`` set aside is put
back, the same tensor object, ``None`` staying ``None``. A leaf reached only inside the
checkpointed block that is neither a parameter given nor differentiated (a plain tensor that
requires grad, read from outside the model) would keep what the backward left there; hooks
run on gradient accumulation (``register_post_accumulate_grad_hook``) run as in any backward.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["holds_reentrant_checkpoint", "backward_grads"]

#: the autograd node of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``
REENTRANT_NODE = "CheckpointFunctionBackward"


def _walk(outs: Sequence[Tensor]) -> List[object]:
    """Every autograd node reachable from ``outs`` (the nodes kept, not their ids: a node's
    Python object can be freed once read and its id reused)."""
    seen: Dict[int, object] = {}
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(n for n, _ in node.next_functions)
    return list(seen.values())


def holds_reentrant_checkpoint(outs: Sequence[Tensor]) -> bool:
    """Whether the autograd graph of ``outs`` runs a reentrant checkpoint's backward.

    Example:
        >>> y = checkpoint(block, x, use_reentrant=True)    # doctest: +SKIP
        >>> holds_reentrant_checkpoint([y])                  # doctest: +SKIP
        True
    """
    return any(type(n).__name__ == REENTRANT_NODE for n in _walk(outs))


def backward_grads(outs: Sequence[Tensor], wrt: Sequence[Tensor], grad_outputs: Sequence[Tensor],
                   params: Sequence[Tensor], on_grad: Optional[Callable[[int, Tensor], None]] = None
                   ) -> List[Optional[Tensor]]:
    """The gradients of ``outs`` (upstream ``grad_outputs``) with respect to ``wrt``, computed
    by ``torch.autograd.backward`` with the ``.grad`` of ``wrt``, ``params`` and every leaf the
    graph reaches set aside and restored exactly afterwards (Note: [a check's backward through
    a reentrant checkpoint]).

    Args:
        outs: the outputs differentiated.
        wrt: the tensors (leaves) whose gradients are returned, ``None`` where none reaches them.
        grad_outputs: one upstream gradient per output.
        params: further leaves the backward may accumulate into (the model's parameters).
        on_grad: ``on_grad(i, grad)`` as soon as ``wrt[i]``'s gradient is accumulated (its
            ``register_post_accumulate_grad_hook``), which then lets it go (Note: [a check that
            holds one side's gradients] in step.py); its slot in the result is ``None``.

    Returns:
        One gradient (or ``None``) per tensor of ``wrt``.

    Example:
        >>> grads = backward_grads([out], [w, x], [torch.ones_like(out)], list(model.parameters()))  # doctest: +SKIP
    """
    leaves = [getattr(n, "variable") for n in _walk(outs) if type(n).__name__ == "AccumulateGrad"]
    aside: Dict[int, Tensor] = {}
    for t in [*wrt, *params, *leaves]:
        if id(t) not in aside:
            aside[id(t)] = t
    saved = [(t, t.grad) for t in aside.values()]
    handles = [t.register_post_accumulate_grad_hook(_handing(i, on_grad)) for i, t in enumerate(wrt)
               if on_grad is not None]
    try:
        for t, _ in saved:
            t.grad = None
        torch.autograd.backward(list(outs), list(grad_outputs))
        return [t.grad for t in wrt]
    finally:
        for h in handles:
            h.remove()
        for t, g in saved:
            t.grad = g


def _handing(i: int, on_grad: Optional[Callable[[int, Tensor], None]]) -> Callable[[Tensor], None]:
    """A post-accumulate-grad hook handing ``wrt[i]``'s gradient to ``on_grad``, then releasing it."""
    def hook(t: Tensor) -> None:
        grad, t.grad = t.grad, None
        if on_grad is not None and grad is not None:
            on_grad(i, grad)

    return hook
