"""A copy of a model whose module objects are new but whose tensors are the model's own.

``convert(inplace=False)`` rewrites such a copy: the user's model stays as it was, while an
optimizer built on its parameters keeps working on the converted one.

Note: [a copy of a model sharded by fully_shard]
FSDP2 (``fully_shard``) keeps, for each parameter, the module object and attribute name it
registers the sharded or the unsharded parameter on (before and after each forward and
backward), and hooks bound to its state on the modules it shards. A copy of such a model
shares with each module FSDP manages its parameter registry (the ``_parameters`` dict
object itself, not a copy): whatever FSDP registers on the user's module, the copy's module
sees, so the copy computes with the unsharded parameters FSDP gathered and its gradients
reach FSDP's reduce-scatter. The copy keeps FSDP's hooks (bound to the same state) and is
entered into FSDP's module -> state map, so ``unshard``, ``reshard``,
``set_requires_gradient_sync`` and ``state_dict`` work on it as on the original. The
user's modules are not changed; parameters replaced on the copy are replaced on the original.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Dict, Optional

from torch import Tensor, nn

from ..._compat import fsdp_new_init_disabled, fsdp_state_of, insert_module_state
from .model_copy import model_copy

__all__ = ["share_copy"]


def share_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose modules are new objects (same classes, attributes, hooks)
    but whose parameters, buffers and other tensor attributes are ``model``'s own (an
    optimizer built on ``model`` keeps working on the copy).

    On a model sharded by ``fully_shard`` (FSDP2), each managed module of the copy shares
    the original's parameter registry (Note: [a copy of a model sharded by fully_shard]).

    Raises:
        ValueError: a parameter is a ``DTensor`` that ``fully_shard`` does not manage (tensor
            parallelism alone): its sharding state lives with the original modules.
    """
    fsdp_states = _fsdp_states(model)
    if fsdp_states is not None:
        clone = _clone_tree(model, {}, share_managed=True)
        _enter_fsdp_states(model, clone, fsdp_states)
        return clone
    sharded = _sharded_parameter(model)
    if sharded is not None:
        raise ValueError(
            f"convert(inplace=False) rewrites a copy of the model's modules, but parameter {sharded!r} is a DTensor "
            "that fully_shard (FSDP2) does not manage (tensor parallelism), whose state stays with the original "
            "modules: convert the sharded model in place (convbn.convert(model, inplace=True)), or convert before "
            "sharding")
    memo: Dict[int, Any] = {}
    for m in model.modules():
        for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            if isinstance(t, Tensor):
                memo[id(t)] = t
    try:
        return model_copy(model, memo)  # hooks closing over the model close over the copy
    except Exception:  # noqa: BLE001 - something in the model refuses deepcopy: copy the tree only
        return _clone_tree(model, {})


def _sharded_parameter(model: nn.Module) -> Optional[str]:
    """The name of a parameter of ``model`` that is a ``DTensor``, or ``None``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)


def _fsdp_states(model: nn.Module) -> Optional[Dict[int, Any]]:
    """``id(module) -> FSDP2 state`` for each module of ``model`` that ``fully_shard`` was
    applied to, or ``None`` where there is none (or this torch has no FSDP2)."""
    states = {id(m): s for m in model.modules() if (s := fsdp_state_of(m)) is not None}
    return states or None


def _enter_fsdp_states(model: nn.Module, clone: nn.Module, states: Dict[int, Any]) -> None:
    """Enter each module of ``clone`` whose original in ``model`` has an FSDP2 state into
    FSDP's module -> state map (a weak map: the entries go with the copy)."""
    # the same walk over both trees (a module reached twice is entered once)
    for (_, original), (_, copied) in zip(model.named_modules(remove_duplicate=False),
                                          clone.named_modules(remove_duplicate=False)):
        state = states.get(id(original))
        if state is not None and fsdp_state_of(copied) is None:
            insert_module_state(copied, state)


def _copy_fsdp_module(module: nn.Module) -> nn.Module:
    """``copy.copy(module)`` for a module of a model sharded by ``fully_shard``: FSDP's class
    would construct (``__init__``) the module's original class instead; the copy keeps
    ``module``'s class."""
    no_init = fsdp_new_init_disabled()
    if no_init is None:  # a torch without FSDP's switch: make the object without its class's __new__
        clone = object.__new__(type(module))
        clone.__setstate__(dict(module.__dict__))
        return clone
    with no_init:
        clone = copy.copy(module)
    if type(clone) is not type(module):
        clone.__class__ = type(module)
    return clone


def _clone_tree(module: nn.Module, seen: Dict[int, nn.Module], share_managed: bool = False) -> nn.Module:
    if id(module) in seen:
        return seen[id(module)]
    clone = _copy_fsdp_module(module) if share_managed else copy.copy(module)
    seen[id(module)] = clone
    clone._modules = OrderedDict((k, None if c is None else _clone_tree(c, seen, share_managed))
                                 for k, c in module._modules.items())
    # FSDP2 registers the sharded / unsharded parameters on the original module's registry:
    # the copy reads the very same dict (Note: [a copy of a model sharded by fully_shard])
    managed = share_managed and getattr(module, "_is_fsdp_managed_module", False)
    clone._parameters = module._parameters if managed else OrderedDict(module._parameters)
    clone._buffers = OrderedDict(module._buffers)
    for key, value in vars(module).items():
        if "hook" in key and isinstance(value, dict):
            clone.__dict__[key] = copy.copy(value)
    return clone
