"""Grad-mode regions (``torch.no_grad()``, ``torch.enable_grad()``, ``torch.set_grad_enabled``,
``torch.inference_mode()``) recorded in a trace.

``torch.fx`` runs a ``with torch.no_grad():`` block of the traced code at trace time and
records nothing of it: the graph then computes the block with gradients on, and a
parameter used only inside it gets a ``.grad`` eager never gives it. While tracing, the
grad-mode context managers therefore also record their effect as graph nodes:

* entering: ``prev = enter_grad_mode(mode)`` (``torch.fx`` keeps it: a side effect), which
  sets the mode and returns the one it replaced, *as it is when the graph runs* (a model
  called under ``torch.no_grad()`` stays without grad after the block);
* leaving: ``exit_grad_mode(prev)``;
* ``torch.inference_mode()`` likewise with :func:`enter_inference_mode` / :func:`exit_inference_mode`.

A call of ``torch.set_grad_enabled(False)`` outside a ``with`` records the entry only, as
eager leaves the mode set. :func:`grad_region_of` numbers the regions of a graph, so that
nothing is fused across a region's border (:mod:`convbn.passes.convert.match`).

Only the traced model's own code is recorded (a context manager entered from torch's or
convbn's own code is not the model's), and only on the thread that traces.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.fx as fx
from torch.autograd import grad_mode
from torch.fx.node import has_side_effect

from ..._compat import InferenceModeContext, set_grad_enabled_now

__all__ = ["enter_grad_mode", "exit_grad_mode", "enter_inference_mode", "exit_inference_mode",
           "recording_grad_modes", "grad_region_of", "GRAD_MODE_FUNCTIONS"]


@has_side_effect
def enter_grad_mode(mode: bool) -> bool:
    """Set grad mode to ``mode``; return the mode it replaced (for :func:`exit_grad_mode`)."""
    prev = torch.is_grad_enabled()
    set_grad_enabled_now(mode)
    return prev


@has_side_effect
def exit_grad_mode(prev: bool) -> None:
    """Put back the grad mode :func:`enter_grad_mode` replaced."""
    set_grad_enabled_now(prev)


@has_side_effect
def enter_inference_mode(mode: bool) -> Any:
    """Enter ``torch.inference_mode(mode)``; return the context for :func:`exit_inference_mode`."""
    ctx = InferenceModeContext(mode)
    ctx.__enter__()
    return ctx


@has_side_effect
def exit_inference_mode(ctx: Any) -> None:
    """Leave the inference mode :func:`enter_inference_mode` entered."""
    ctx.__exit__(None, None, None)


GRAD_MODE_FUNCTIONS = (enter_grad_mode, exit_grad_mode, enter_inference_mode, exit_inference_mode)
_ENTERS = (enter_grad_mode, enter_inference_mode)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CONTEXTLIB = os.path.join(_TORCH_DIR, "utils", "_contextlib.py")
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_ATTR = "_convbn_grad_node"


class _Recording(threading.local):
    tracer: Optional[fx.Tracer] = None


_recording = _Recording()


def _model_code(depth: int) -> bool:
    """Whether the context manager was entered by the traced model's code (a ``@torch.no_grad()``
    decorator's wrapper counts as its caller's)."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename == _CONTEXTLIB:
        frame = frame.f_back
    if frame is None:
        return False
    name = frame.f_code.co_filename
    return not (name.startswith(_TORCH_DIR) or name.startswith(_OWN_DIR))


def _record(ctx: Any, fn: Callable[..., Any], arg: Any) -> None:
    tracer = _recording.tracer
    if tracer is not None and _model_code(3):
        ctx.__dict__[_ATTR] = tracer.create_proxy("call_function", fn, (arg,), {})


def _record_exit(ctx: Any, fn: Callable[..., Any]) -> None:
    node = ctx.__dict__.pop(_ATTR, None)
    tracer = _recording.tracer
    if node is not None and tracer is not None:
        tracer.create_proxy("call_function", fn, (node,), {})


def _patches() -> List[tuple]:
    def entering(cls: type, name: str, mode: Callable[[Any], Any], fn: Callable[..., Any]) -> tuple:
        original = cls.__dict__[name]

        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            _record(self, fn, mode(self))
            return out

        return cls, name, original, patched

    def leaving(cls: type, fn: Callable[..., Any]) -> tuple:
        original = cls.__dict__["__exit__"]

        def patched(self: Any, *args: Any) -> Any:
            out = original(self, *args)
            _record_exit(self, fn)
            return out

        return cls, "__exit__", original, patched

    return [
        entering(grad_mode.no_grad, "__enter__", lambda s: False, enter_grad_mode),
        leaving(grad_mode.no_grad, exit_grad_mode),
        entering(grad_mode.enable_grad, "__enter__", lambda s: True, enter_grad_mode),
        leaving(grad_mode.enable_grad, exit_grad_mode),
        entering(grad_mode.set_grad_enabled, "__init__", lambda s: s.mode, enter_grad_mode),
        leaving(grad_mode.set_grad_enabled, exit_grad_mode),
        entering(grad_mode.inference_mode, "__enter__", lambda s: s.mode, enter_inference_mode),
        leaving(grad_mode.inference_mode, exit_inference_mode),
    ]


_lock = threading.Lock()
_depth = 0
_installed: List[tuple] = []


@contextlib.contextmanager
def recording_grad_modes(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing with ``tracer`` (on this thread), record the grad-mode context managers the
    model's code enters and leaves as graph nodes; the grad mode is put back afterwards (a
    ``torch.set_grad_enabled(False)`` the trace ran leaves it set, as in eager)."""
    global _depth
    outer, _recording.tracer = _recording.tracer, tracer
    enabled = torch.is_grad_enabled()
    with _lock:
        if _depth == 0:
            _installed[:] = _patches()
            for cls, name, _, patched in _installed:
                setattr(cls, name, patched)
        _depth += 1
    try:
        yield
    finally:
        _recording.tracer = outer
        with _lock:
            _depth -= 1
            if _depth == 0:
                for cls, name, original, _ in _installed:
                    setattr(cls, name, original)
        set_grad_enabled_now(enabled)


def grad_region_of(graph: fx.Graph) -> Dict[fx.Node, int]:
    """Each node's grad-mode region: ``0`` outside every recorded region, else the number of
    the innermost region around it (the entry node's); empty where the graph records none.
    Nodes of one fused layer or chain must share a region."""
    if not any(n.op == "call_function" and n.target in GRAD_MODE_FUNCTIONS for n in graph.nodes):
        return {}
    regions: Dict[fx.Node, int] = {}
    stack: List[fx.Node] = []
    index = {n: i + 1 for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _ENTERS:
            stack.append(node)
        elif node.op == "call_function" and node.target in (exit_grad_mode, exit_inference_mode):
            entry = node.args[0]
            if entry in stack:
                del stack[stack.index(entry):]
        regions[node] = index[stack[-1]] if stack else 0
    return regions
