"""Importing third-party model zoos (torchvision, timm) in tests.

The torchvision build installed here registers fake (meta) kernels for its C++ operators
at import time, and those operators do not exist in this CPU-only torch build, so a plain
``import torchvision`` fails ("operator torchvision::nms does not exist"). The models the
tests use never call those operators. :func:`import_torchvision_without_fake_kernels`
imports torchvision with ``torch.library.register_fake`` skipping ``torchvision::`` ops,
restoring it afterwards. Tests only: the product never imports torchvision.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable

import pytest
import torch

__all__ = ["import_torchvision_without_fake_kernels", "import_timm", "torchvision_or_skip", "timm_or_skip"]


def import_torchvision_without_fake_kernels() -> ModuleType:
    """``import torchvision`` with its fake-kernel registrations for ``torchvision::`` ops skipped.

    Returns:
        The torchvision module.

    Raises:
        ImportError: torchvision is not installed.
    """
    original = torch.library.register_fake

    def register_fake(op: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(op, str) and op.startswith("torchvision::"):
            return lambda fn: fn  # used as a decorator: keep the function, register nothing
        return original(op, *args, **kwargs)

    torch.library.register_fake = register_fake  # type: ignore[assignment]
    try:
        return importlib.import_module("torchvision")
    finally:
        torch.library.register_fake = original  # type: ignore[assignment]


def import_timm() -> ModuleType:
    """``import timm`` (which imports torchvision) through :func:`import_torchvision_without_fake_kernels`."""
    import_torchvision_without_fake_kernels()
    return importlib.import_module("timm")


def _or_skip(load: Callable[[], ModuleType], name: str) -> ModuleType:
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - not importable here: the test is skipped, saying why
        pytest.skip(f"{name} does not import here: {type(exc).__name__}: {exc}")
    raise AssertionError("unreachable")  # pragma: no cover


def torchvision_or_skip() -> ModuleType:
    """torchvision, or skip the calling test saying why it does not import."""
    return _or_skip(import_torchvision_without_fake_kernels, "torchvision")


def timm_or_skip() -> ModuleType:
    """timm, or skip the calling test saying why it does not import."""
    return _or_skip(import_timm, "timm")
