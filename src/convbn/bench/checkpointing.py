"""``checkpoint per block``: the training benchmark's :func:`torch.utils.checkpoint.checkpoint` baseline.

:func:`find_blocks` picks the blocks of a model (the children of its top-level
``Sequential`` / ``ModuleList`` containers), :func:`checkpoint_blocks` wraps each in a
:class:`CheckpointBlock` (non-reentrant checkpointing whenever grad is on).
"""
from __future__ import annotations

import inspect
from typing import Any, List, Optional, Sequence

import torch
from torch import nn

__all__ = ["CheckpointBlock", "checkpoint_blocks", "find_blocks"]


class CheckpointBlock(nn.Module):
    """Runs ``block`` under non-reentrant :func:`torch.utils.checkpoint.checkpoint` when grad is on.

    The block stays a child named ``block`` (its parameters are the same objects).
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.block(*args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


_CONTAINERS = (nn.Sequential, nn.ModuleList)


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _takes_one_tensor(m: nn.Module) -> bool:
    try:
        params = list(inspect.signature(m.forward).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return len(positional) >= 1 and len(required) <= 1


def find_blocks(model: nn.Module) -> List[str]:
    """Qualified names of the modules ``checkpoint per block`` wraps.

    The children (with parameters) of the model's top-level ``Sequential`` / ``ModuleList``
    containers (the model itself if it is one): MONAI ResNet's ``layer1.0`` ... ``layer4.1``,
    EfficientNet's ``_blocks.0`` ...; without such containers, every direct child that has
    parameters and whose ``forward`` takes one tensor (the MNIST network's layers).
    """
    if isinstance(model, _CONTAINERS):
        containers = [("", model)]
    else:
        containers = [(f"{n}.", c) for n, c in model.named_children() if isinstance(c, _CONTAINERS)]
    blocks = [prefix + n for prefix, c in containers for n, child in c.named_children() if _has_params(child)]
    if not blocks:
        blocks = [n for n, c in model.named_children() if _has_params(c) and _takes_one_tensor(c)]
    return blocks


def checkpoint_blocks(model: nn.Module, blocks: Optional[Sequence[str]] = None) -> nn.Module:
    """Wrap each module named in ``blocks`` (default :func:`find_blocks`) of ``model``, in place,
    in a :class:`CheckpointBlock`; returns ``model``.

    Raises:
        ValueError: no block found, or a name that is not a submodule.
    """
    names = list(find_blocks(model) if blocks is None else blocks)
    if not names:
        raise ValueError(
            f"found no block to checkpoint in {type(model).__name__}: it has no Sequential/ModuleList child "
            "and no direct child with parameters taking one tensor; pass blocks=[...] explicitly"
        )
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            child = parent.get_submodule(attr)
        except AttributeError as exc:
            raise ValueError(f"{name!r} is not a submodule of {type(model).__name__}") from exc
        setattr(parent, attr, CheckpointBlock(child))
    return model
