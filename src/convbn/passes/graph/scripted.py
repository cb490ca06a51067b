"""TorchScript modules are not what ``convert`` / ``fold`` rewrite: they say so up front.

A ``torch.jit.script`` / ``torch.jit.trace`` result is an ``nn.Module`` whose attributes are
TorchScript wrappers (its ``_buffers`` is no dict, its forward no Python), so tracing and
rewriting it can only fail part way. Both passes check the model, and every module in it,
before changing anything.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["reject_torchscript"]


def reject_torchscript(model: nn.Module, caller: str) -> None:
    """Raise ``TypeError`` if ``model`` or a module inside it is a TorchScript module.

    Args:
        model: the model given to ``caller``.
        caller: ``"convert"`` or ``"fold"`` (named in the message).

    Raises:
        TypeError: naming the TorchScript module and what to pass instead.
    """
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            where = "the model" if not name else f"its submodule {name!r}"
            raise TypeError(
                f"{caller}() needs an eager nn.Module, but {where} is a TorchScript module "
                f"({type(m).__name__}, from torch.jit.script / torch.jit.trace); pass the eager module it was "
                f"made from instead ({caller} first, then script or trace the result if you need TorchScript)"
            )
