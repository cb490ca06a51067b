"""A copy of a model whose module objects are new but whose tensors are the model's own.

``convert(inplace=False)`` rewrites such a copy: the user's model stays as it was, while an
optimizer built on its parameters keeps working on the converted one.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Dict, Optional

from torch import Tensor, nn

__all__ = ["share_copy"]


def share_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose modules are new objects (same classes, attributes, hooks)
    but whose parameters, buffers and other tensor attributes are ``model``'s own (an
    optimizer built on ``model`` keeps working on the copy).

    Raises:
        ValueError: a parameter is a ``DTensor`` (sharded by ``fully_shard`` or tensor
            parallelism): its sharding state lives with the original modules, so a copy would
            train stale shards.
    """
    sharded = _sharded_parameter(model)
    if sharded is not None:
        raise ValueError(
            f"convert(inplace=False) rewrites a copy of the model's modules, but parameter {sharded!r} is a DTensor "
            "sharded by fully_shard (FSDP2) or tensor parallelism, whose state stays with the original modules: "
            "convert the sharded model in place (convbn.convert(model, inplace=True)), or convert before "
            "sharding (convbn.convert(model), then fully_shard)")
    memo: Dict[int, Any] = {}
    for m in model.modules():
        for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            if isinstance(t, Tensor):
                memo[id(t)] = t
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - something in the model refuses deepcopy: copy the tree only
        return _clone_tree(model, {})


def _sharded_parameter(model: nn.Module) -> Optional[str]:
    """The name of a parameter of ``model`` that is a ``DTensor``, or ``None``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)


def _clone_tree(module: nn.Module, seen: Dict[int, nn.Module]) -> nn.Module:
    if id(module) in seen:
        return seen[id(module)]
    clone = copy.copy(module)
    seen[id(module)] = clone
    clone._modules = OrderedDict((k, None if c is None else _clone_tree(c, seen)) for k, c in module._modules.items())
    clone._parameters = OrderedDict(module._parameters)
    clone._buffers = OrderedDict(module._buffers)
    for key, value in vars(module).items():
        if "hook" in key and isinstance(value, dict):
            clone.__dict__[key] = copy.copy(value)
    return clone
