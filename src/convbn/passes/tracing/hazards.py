"""Trace hazards caught while tracing: ``torch.fx`` proxies answer ``isinstance(x, torch.Tensor)``
and ``torch.jit.isinstance(x, torch.Tensor)`` with ``False``, so code branching on them silently
records the other branch. :class:`_WatchedProxy` (the proxy the partial tracer hands out) and
:func:`_patched_jit_isinstance` (``torch.jit.isinstance`` while tracing) raise
:class:`TraceHazard` where the model's own code asks; :func:`_trusted` tells the model's code
from torch's and convbn's. What could differ is :mod:`convbn.passes.graph.trace_hazards`; the
tracer that turns a hazard into a leaf is :mod:`convbn.passes.tracing.trace`, which re-exports
:class:`TraceHazard`.
"""
from __future__ import annotations

import linecache
import os
import sys
from typing import Any, Callable

import torch
import torch.fx as fx

from ..graph.trace_hazards import _answer_could_differ, _asks_tensor_only, _surely_a_tensor, _tensor_valued

__all__ = ["TraceHazard"]


class TraceHazard(RuntimeError):
    """Raised while tracing where ``torch.fx`` would record a different computation than eager runs."""


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# torch's own code inspects proxies on purpose (FX itself, pytree, dispatch, Parameter's
# metaclass); ``torch.is_tensor`` (torch/__init__.py) is the model's question, not torch's.
_IS_TENSOR_FILE = _TORCH_DIR + "__init__.py"


def _trusted(filename: str) -> bool:
    return (filename.startswith(_TORCH_DIR) and filename != _IS_TENSOR_FILE) or filename.startswith(_OWN_DIR)


def _asks_type(filename: str, lineno: int) -> bool:
    line = linecache.getline(filename, lineno)
    return "isinstance" in line or "is_tensor" in line or "issubclass" in line


class _WatchedProxy(fx.Proxy):
    """A proxy that notices ``isinstance`` checks made on it by the model's own code.

    ``isinstance(p, C)`` for a class ``C`` that ``type(p)`` is not a subclass of reads
    ``p.__class__``; eager code would have seen a Tensor there. The check is a hazard
    unless it comes from FX or torch internals.
    """

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D401
        frame = sys._getframe(1)
        filename = frame.f_code.co_filename
        # C code (a torch op's argument parser) also reads ``__class__``; only an
        # ``isinstance`` / ``is_tensor`` written on the calling line is the model's question.
        if not _trusted(filename) and _asks_type(filename, frame.f_lineno) and _answer_could_differ(self, frame):
            if _surely_a_tensor(self.node) and _asks_tensor_only(frame):
                return torch.Tensor  # Note: [is_tensor on a traced tensor is True]
            raise TraceHazard(
                f"isinstance() on a traced value at {os.path.basename(filename)}:{frame.f_lineno} "
                "(torch.fx would record the non-tensor branch)"
            )
        return type(self)


def _patched_jit_isinstance(original: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def jit_isinstance(obj: Any, target_type: Any) -> bool:
        if type(obj) is _WatchedProxy or isinstance(obj, fx.Proxy):
            frame = sys._getframe(1)
            if (isinstance(target_type, type) and _tensor_valued(obj.node)
                    and issubclass(torch.Tensor, target_type) == issubclass(type(obj), target_type)):
                return original(obj, target_type)
            raise TraceHazard(
                f"torch.jit.isinstance() on a traced value at {os.path.basename(frame.f_code.co_filename)}:"
                f"{frame.f_lineno} (torch.fx would record the non-tensor branch)"
            )
        return original(obj, target_type)

    return jit_isinstance
