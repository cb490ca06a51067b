"""Trace hazards caught while tracing: ``torch.fx`` proxies answer ``isinstance(x, torch.Tensor)``
and ``torch.jit.isinstance(x, torch.Tensor)`` with ``False``, so code branching on them silently
records the other branch. :class:`_WatchedProxy` (the proxy the partial tracer hands out) and
:func:`_patched_jit_isinstance` (``torch.jit.isinstance`` while tracing) answer as eager where the
answer reads only types of values that surely are tensors (Note: [torch.jit.isinstance answered
from types]) and raise :class:`TraceHazard` where the model's own code asks otherwise; :func:`_trusted` tells the model's code
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
from torch import nn

from ..._compat import pytree
from ..graph.shape_capture import VALUE
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


# Note: [torch.jit.isinstance answered from types]
# ``torch.jit.isinstance(obj, T)`` refines a type (``torch.Tensor``, ``Optional[Tensor]``,
# ``List[Tensor]``, ``Dict[str, Tensor]``, ``Tuple[Tensor, ...]``): its answer reads the types of
# ``obj`` and of what it holds, never a shape. ``torch.fx`` would ask it of proxies, which are not
# tensors, and record the other branch (MONAI's ``UpCat`` drops its skip connection). Where every
# proxy in ``obj`` surely stands for a tensor (a value the graph computed, or an input of a trace
# with the real inputs, held to tensors by that trace's shape guard: :func:`_surely_a_tensor`), the
# question is put to torch's own ``torch.jit.isinstance`` with each such proxy replaced by an empty
# stand-in tensor: eager's answer, decided by types alone, so the graph stays as shape-generic as
# the rest of the trace. A proxy that may stand for something else (an input of a symbolic trace,
# a shape, a tuple of pieces, what an opaque module returned: :func:`_returns_a_tensor`) is a
# hazard, unless the answer is the same for a tensor and a proxy.


def _returns_a_tensor(proxy: fx.Proxy) -> bool:
    """Whether ``proxy`` surely stands for a tensor, a leaf module's output included only where
    the module returns one: not a module left opaque or kept for its hooks (its forward may return
    anything), not a recurrent layer or attention (tuples), not a pooling asked for its indices."""
    node = proxy.node
    if not _surely_a_tensor(node):
        return False
    if node.op != "call_module" or isinstance(node.meta.get(VALUE), torch.Tensor):
        return True
    tracer, name = proxy.tracer, str(node.target)
    if name in getattr(tracer, "opaque", {}) or name in getattr(tracer, "hooked", {}):
        return False
    module = tracer.root.get_submodule(name)  # type: ignore[attr-defined]
    return not (isinstance(module, (nn.RNNBase, nn.MultiheadAttention)) or getattr(module, "return_indices", False))


def _stand_ins(obj: Any) -> Any:
    """``obj`` with every proxy replaced by an empty tensor, or ``None`` where a proxy in it may
    stand for a non-tensor (Note: [torch.jit.isinstance answered from types])."""
    leaves = pytree.tree_leaves(obj)
    if not all(_returns_a_tensor(p) for p in leaves if isinstance(p, fx.Proxy)):
        return None
    return pytree.tree_map(lambda a: torch.empty(0) if isinstance(a, fx.Proxy) else a, obj)


def _patched_jit_isinstance(original: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def jit_isinstance(obj: Any, target_type: Any) -> bool:
        if not any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves(obj)):
            return original(obj, target_type)
        real = _stand_ins(obj)
        if real is not None:
            return original(real, target_type)  # Note: [torch.jit.isinstance answered from types]
        if (isinstance(obj, fx.Proxy) and isinstance(target_type, type) and _tensor_valued(obj.node)
                and issubclass(torch.Tensor, target_type) == issubclass(type(obj), target_type)):
            return original(obj, target_type)
        frame = sys._getframe(1)
        while frame.f_back is not None and _trusted(frame.f_code.co_filename):
            frame = frame.f_back  # the model's line, not the tracing patch's wrapper
        raise TraceHazard(
            f"torch.jit.isinstance() on a traced value at {os.path.basename(frame.f_code.co_filename)}:"
            f"{frame.f_lineno} (torch.fx would record the non-tensor branch)"
        )

    return jit_isinstance
