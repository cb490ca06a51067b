"""Whether convbn's tracer works on this torch at all: a failed trace said out loud.

# Note: [a tracer that fails everywhere says so]
# convert and fold treat a module whose trace fails as untraceable: its children are tried one
# by one and the reason goes into the report's ``untraced`` list. That is right for a user's
# module whose code does not trace; it is wrong when the tracer itself fails, as it does on a
# torch release that renamed a private name convbn's tracer reads (Note: [one door to private
# torch]): every trace fails, nothing fuses, and a user who upgraded torch would see only
# ``0 pairs fused``. So after a failed trace the pass traces a plain Conv2d -> BatchNorm2d ->
# ReLU; where that fails too the tracer is broken on this torch and the pass warns, naming the
# torch, the error and the supported range. A success is remembered (the check runs once per
# process); a failure is checked again each time (it costs one small trace).
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch
from torch import nn

from ..._compat import MINIMUM_TORCH
from .trace import LayerTracer, short_reason, trace

__all__ = ["tracer_failure", "warn_if_tracer_broken"]

_WORKS: List[bool] = []


def tracer_failure() -> Optional[str]:
    """``None`` where convbn's tracer traces a plain Conv2d -> BatchNorm2d -> ReLU on this torch,
    else the reason it fails (Note: [a tracer that fails everywhere says so])."""
    if _WORKS:
        return None
    probe = nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1), nn.ReLU())
    try:
        trace(probe, LayerTracer, training=True)
    except Exception as exc:  # noqa: BLE001 - any failure here is the tracer's, not a user's module's
        return f"{type(exc).__name__}: {short_reason(exc)}"
    _WORKS.append(True)
    return None


def warn_if_tracer_broken(pass_name: str) -> bool:
    """After a failed trace in ``pass_name`` (``"convert"`` / ``"fold"``): warn where the tracer
    fails on every model. Returns whether it warned."""
    why = tracer_failure()
    if why is None:
        return False
    warnings.warn(
        f"convbn.{pass_name} cannot trace even nn.Sequential(Conv2d, BatchNorm2d, ReLU) on torch "
        f"{torch.__version__} ({why}): it fuses and folds nothing on this torch. convbn supports torch >= "
        f"{MINIMUM_TORCH}; docs/torch-versions.md lists the releases it is tested on.", RuntimeWarning, stacklevel=3)
    return True
