"""Saving tensors for backward without keeping a second reference to parameters.

``ctx.save_for_backward`` is the right way to keep activations: autograd checks their
version and the saved-tensor hooks (offloading, memory accounting) see them. A module's
``nn.Parameter`` is different: the module keeps it alive anyway, so keeping it for
backward costs no memory. The fused Functions therefore hold parameters by reference
on ``ctx`` -- with the same in-place-modification check ``save_for_backward`` does -- and
save everything else (activations, statistics, autocast copies of weights) normally.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = ["save_tensors", "load_tensors"]


def save_tensors(ctx: Any, tensors: Sequence[Optional[Tensor]]) -> None:
    """Save ``tensors`` for backward: parameters by reference, the rest with ``save_for_backward``.

    Under ``torch.compile`` everything goes through ``save_for_backward``: the compiled
    graph takes parameters as inputs and plans its own saved set.
    """
    if torch.compiler.is_compiling():
        ctx.save_for_backward(*tensors)
        ctx.saving_slots = None
        return
    slots: List[Tuple[int, Any]] = []  # (kind, payload): 0 = saved index, 1 = (param, version)
    normal: List[Optional[Tensor]] = []
    for t in tensors:
        if isinstance(t, nn.Parameter):
            slots.append((1, (t, t._version)))
        else:
            slots.append((0, len(normal)))
            normal.append(t)
    ctx.save_for_backward(*normal)
    ctx.saving_slots = slots


def load_tensors(ctx: Any) -> Tuple[Optional[Tensor], ...]:
    """The tensors given to :func:`save_tensors`, in order.

    Raises:
        RuntimeError: a parameter was modified in place between forward and backward
            (as ``save_for_backward`` would report).
    """
    normal = ctx.saved_tensors
    if ctx.saving_slots is None:
        return tuple(normal)
    out: List[Optional[Tensor]] = []
    for kind, payload in ctx.saving_slots:
        if kind == 0:
            out.append(normal[payload])
            continue
        t, version = payload
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a parameter of shape {tuple(t.shape)} is at version {t._version}; expected "
                f"version {version} instead. Step the optimizer after backward, not between forward and backward."
            )
        out.append(t)
    return tuple(out)
