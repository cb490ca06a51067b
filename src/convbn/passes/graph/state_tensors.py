"""Tensors a model keeps in its own mutable state, outside parameters and buffers.

Note: [a tensor read from the model's state is not a constant]
A module may read, in its forward, a tensor another part of the model stored during the same
call: a U-Net whose decoder reads ``self.store["e1"]``, written by a forward hook on an
encoder block. ``torch.fx`` runs the hook's module as one call and never runs its hooks while
tracing, so the read finds nothing (``KeyError``) or the tensor a *previous* call stored,
which fx then records as a constant (``_tensor_constant0``): the rewrite would compute with
a stale activation (``Sizes of tensors must match`` at another input size, or, at the same
size, silently wrong values and no gradient into the encoder). A tensor the trace meets that
sits in a plain container (``dict``, ``list``, ``tuple``, ``set``, a plain object's attributes) of a
module's attributes is
such a read: the tracer refuses it (``TraceHazard``), the module stays whole and the report
says why.
"""
from __future__ import annotations

from typing import Any, Dict, Set

from torch import Tensor, nn

__all__ = ["state_tensor_ids", "held_tensors"]

_REGISTRIES = frozenset(nn.Module().__dict__)  # _parameters, _buffers, _modules, the hook tables...


def _collect(value: Any, found: Dict[int, Tensor], depth: int) -> None:
    if isinstance(value, Tensor):
        found[id(value)] = value
    elif not depth or isinstance(value, (nn.Module, type, str, bytes, int, float, bool)) or callable(value):
        return  # modules are walked on their own; classes, functions and scalars hold no activation
    elif isinstance(value, dict):
        for v in list(value.values()):
            _collect(v, found, depth - 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in list(value):
            _collect(v, found, depth - 1)
    elif isinstance(getattr(value, "__dict__", None), dict):  # a record object: what a hook stored in it
        for v in list(vars(value).values()):
            _collect(v, found, depth - 1)


def state_tensor_ids(root: nn.Module, depth: int = 3) -> Set[int]:
    """``id``s of the tensors held in plain containers among the attributes of ``root``'s modules
    (up to ``depth`` containers deep), the model's own mutable state (Note: [a tensor read from
    the model's state is not a constant]). Tensors held directly as attributes are left out:
    fx reads those as attributes of the module, not as constants.

    Example:
        >>> import torch
        >>> net = nn.Linear(2, 2)
        >>> net.store = {"x": torch.zeros(1)}
        >>> id(net.store["x"]) in state_tensor_ids(net)
        True
    """
    return set(held_tensors(root, depth, direct=False))


def held_tensors(root: nn.Module, depth: int = 3, direct: bool = True) -> Dict[int, Tensor]:
    """``id -> tensor`` for every tensor ``root``'s modules hold outside their parameters and
    buffers: in plain containers among their attributes (up to ``depth`` deep) and, with
    ``direct``, as attributes themselves."""
    found: Dict[int, Tensor] = {}
    for m in root.modules():
        for key, value in vars(m).items():
            if key in _REGISTRIES:
                continue
            if isinstance(value, Tensor):
                if direct:
                    found[id(value)] = value
            else:
                _collect(value, found, depth)
    return found
