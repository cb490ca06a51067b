"""Returning memory during backward that autograd would hold until a Function returns.

Used by the chain (:mod:`convbn.autograd.chain`, which also runs the single-layer
recompute strategies); see Note: [freeing kept tensors early]. Whether an incoming
gradient is the backward's alone, so that it may be freed too, is
:mod:`convbn.autograd.refcounts`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._compat import graph_task_keeps_graph

__all__ = ["BACKWARD_TWICE", "free_storage", "freed", "keeping_graph"]


#: what eager autograd raises for a backward through a graph whose saved values are freed
BACKWARD_TWICE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or "
    "if you need to access saved tensors after calling backward. (An earlier backward through this fused "
    "chain ran, in full or part way, and freed what it saved.)"
)


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
    #
    # Note: [a freed tensor is never handed out again]
    # A backward that stops part way (an exception in a later layer, a failed allocation,
    # Ctrl-C) leaves its node unreleased: autograd would hand the saved tensor out again
    # (a retried ``backward``, ``grad_fn.saved_tensors``), sizes intact, storage gone, and
    # reading it crashes the process. So a freed tensor's version is advanced as well:
    # every later unpack of its saved slot raises autograd's "modified by an inplace
    # operation" error instead (the chain itself raises eager's "backward through the
    # graph a second time" before unpacking: Note: [a backward that stops part way] in
    # autograd/grad_sink.py).
    """
    if type(t) is not Tensor or torch.compiler.is_compiling():  # fake / traced tensors: nothing to free
        return
    st = t.untyped_storage()
    if st.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0:
        st.resize_(0)
        if not t.is_inference():  # inference tensors have no version (and are never saved)
            torch.autograd.graph.increment_version(t)


def freed(t: Optional[Tensor]) -> bool:
    """Whether :func:`free_storage` gave ``t``'s memory back (it has elements but no storage)."""
    return (type(t) is Tensor and not torch.compiler.is_compiling() and t.numel() > 0
            and t.untyped_storage().nbytes() == 0)


def keeping_graph() -> bool:
    """Whether the running backward retains the graph (``retain_graph=True``); ``True`` when
    unknown or while compiling."""
    if torch.compiler.is_compiling():
        return True
    return graph_task_keeps_graph()
