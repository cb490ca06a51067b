"""Hooks: which modules must run as module calls because something is attached to them."""
from __future__ import annotations

from typing import Any, Optional

from torch import nn
from ..._compat import global_module_hooks

from ...nn.fused_conv_bn import OBSERVER_ATTR

__all__ = ["hook_reason", "global_hooks"]

_OLD_STYLE_PARAMETRIZATIONS = {
    "WeightNorm": "torch.nn.utils.weight_norm (hook-based)",
    "SpectralNorm": "torch.nn.utils.spectral_norm (hook-based)",
}


def _hook_name(hook: Any) -> str:
    cls = type(hook).__name__
    if cls in _OLD_STYLE_PARAMETRIZATIONS:
        return _OLD_STYLE_PARAMETRIZATIONS[cls]
    if any(k.__name__ == "BasePruningMethod" for k in type(hook).__mro__):
        return "torch.nn.utils.prune"
    return getattr(hook, "__qualname__", None) or cls


def hook_reason(m: nn.Module) -> Optional[str]:
    """Why ``m``'s forward must run as a module call: the hooks it has, or ``None``.

    Forward pre-hooks, forward hooks and backward hooks all see (or change) what the
    module computes; hook-based parametrizations (old-style ``weight_norm`` /
    ``spectral_norm``) and pruning are forward pre-hooks that recompute ``weight``.
    State-dict hooks are not listed: the module stays registered, so they keep running.
    Observer hooks (``convbn_observer = True``, e.g. :func:`convbn.saved_bytes` with
    ``per_module``) are not listed either.
    """
    found = []
    for attr, what in (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
                       ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook")):
        hooks = getattr(m, attr, None)
        if hooks:
            found += [f"{what} {_hook_name(h)}" for h in hooks.values() if not getattr(h, OBSERVER_ATTR, False)]
    return ", ".join(found) if found else None


def global_hooks() -> bool:
    """Whether global module hooks (``nn.modules.module.register_module_*_hook``) are registered."""
    return any(global_module_hooks())
