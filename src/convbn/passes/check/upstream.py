"""A check's upstream gradients, each held by the backward only until its output's node has used it.

Note: [an upstream gradient let go once used]
A check's step differentiates its outputs with a random upstream gradient (one per output, the
output's bytes). Passed to ``torch.autograd.grad`` / ``backward`` as a list, each stayed alive
for the whole backward (the caller's list holds it), where a training loop's loss gradient is
let go once the output's node has run: one output's bytes above a training step at its peak.
The backward is therefore handed a zero-stride placeholder of the output's shape and dtype
(one element's bytes), and a hook on the output hands the real gradient over as the
output's node is about to run, dropping every other reference to it: the node's use is then the
last. Where other outputs' gradients also flow into an output (one output computed from
another), the hook adds the upstream gradient to what arrived. Outputs given twice, or without
a node (leaves), keep the plain list.
"""
from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["handed_once"]


def handed_once(outs: Sequence[Tensor], ups: List[Tensor]) -> Tuple[List[Tensor], List[Any]]:
    """The ``grad_outputs`` to give the backward for ``outs`` and the hook handles to remove after
    it (Note: [an upstream gradient let go once used]). ``ups`` is emptied: the hooks hold the
    gradients until each is used."""
    if len({id(o) for o in outs}) != len(outs) or any(o.grad_fn is None for o in outs):
        return list(ups), []
    slots: List[Any] = list(ups)
    ups.clear()
    places = [torch.zeros((), dtype=u.dtype, device=u.device).expand(u.shape) for u in slots]
    handles = [o.register_hook(_hand_over(slots, i, places[i])) for i, o in enumerate(outs)]
    return places, handles


def _hand_over(slots: List[Any], i: int, place: Tensor) -> Callable[[Tensor], Tensor]:
    def hook(grad: Tensor) -> Tensor:
        up, slots[i] = slots[i], None
        if up is None:  # a second call (a graph run twice): nothing left to add
            return grad
        if grad.data_ptr() == place.data_ptr() and all(s == 0 for s in grad.stride()):
            return up  # the placeholder alone arrived
        return grad + up

    return hook
