"""Returning memory during backward that autograd would hold until a Function returns.

Shared by the fused Functions (:mod:`convbn.autograd.fused`) and the chain
(:mod:`convbn.autograd.chain`); see Notes: [freeing kept tensors early] and [freeing the
incoming gradient].
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["free_storage", "keeping_graph", "sole_owner", "incoming_refs"]


def free_storage(t: Tensor) -> None:
    """Give ``t``'s memory back now, although autograd's saved-variable slot still refers
    to it.

    # Note: [freeing kept tensors early]
    # A tensor saved with ``save_for_backward`` lives until the node's backward returns,
    # so a chain's kept conv outputs would all stay alive to the end of the chain's
    # backward. Each is dead once its layer's BN backward is done; when the graph is not
    # being retained (``retain_graph=False``: no later backward will unpack it) its storage
    # is resized to zero, as FSDP frees parameter shards. A tensor whose storage is larger
    # than itself (a view) is left alone.
    """
    if type(t) is not Tensor or torch.compiler.is_compiling():  # fake / traced tensors: nothing to free
        return
    st = t.untyped_storage()
    if st.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0:
        st.resize_(0)


def keeping_graph() -> bool:
    """Whether the running backward retains the graph (``retain_graph=True``); ``True`` when
    unknown or while compiling."""
    if torch.compiler.is_compiling():
        return True
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):  # pragma: no cover - private API moved / no graph task
        return True


def incoming_refs(grad: Tensor) -> int:
    """Python references to ``grad``; call it on the first line of a Function's backward
    and pass the result to :func:`sole_owner` (``-1`` while compiling: never freed)."""
    if torch.compiler.is_compiling():
        return -1
    return sys.getrefcount(grad)


_BASELINE: Optional[int] = None
_LOCK = threading.Lock()


class _Probe(torch.autograd.Function):
    """Measures :func:`incoming_refs` of a fresh, unshared incoming gradient."""

    seen: Optional[int] = None

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        refs = incoming_refs(grad)
        _Probe.seen = refs
        return grad * 1


def _baseline() -> int:
    global _BASELINE
    with _LOCK:
        if _BASELINE is None:
            with torch.enable_grad():
                x = torch.zeros(2, requires_grad=True)
                (_Probe.apply(x) * 2).sum().backward()  # MulBackward hands over a fresh gradient
            _BASELINE = _Probe.seen if _Probe.seen is not None else -1
    return _BASELINE


def sole_owner(t: Tensor, refs: int) -> bool:
    """Whether ``t``, a Function's incoming gradient with ``refs`` Python references at the
    start of backward (:func:`incoming_refs`), is referred to by nothing but this call: no
    other tensor, view, autograd buffer or Python object holds it or shares its storage,
    which it covers exactly.

    # Note: [freeing the incoming gradient]
    # The engine keeps a Function's incoming gradient alive until backward returns, but
    # a fused layer or chain is done with it as soon as the (last) layer's activation
    # backward has read it: an activation-sized buffer held for nothing. When the
    # gradient is ours alone its storage is freed right there, as AccumulateGrad steals a
    # gradient it alone holds. "Ours alone" is checked on both sides: the C++ use count
    # (1: not shared with another branch's input buffer, nor copied by the engine for the
    # node's post-hooks, nor held by a caller of ``backward(gradient)``), and the Python
    # reference count at the start of backward, equal to that of a fresh gradient measured
    # once the same way (a tensor hook or module backward hook that keeps the gradient
    # adds a reference). Anything else keeps the gradient.
    """
    if type(t) is not Tensor or torch.compiler.is_compiling():  # traced: the compiler plans memory
        return False
    if t.requires_grad or t.dim() == 0 or t._use_count() != 1 or refs != _baseline():
        return False
    try:
        st = t.untyped_storage()
        # one reference from t's TensorImpl, one from ``st`` itself
        shared = torch._C._storage_Use_Count(st._cdata) != 2
    except (AttributeError, RuntimeError, NotImplementedError):  # pragma: no cover - private API moved
        return False
    return not shared and st.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
