"""Returning memory during backward that autograd would hold until a Function returns.

Shared by the fused Functions (:mod:`convbn.autograd.fused`) and the chain
(:mod:`convbn.autograd.chain`); see Notes: [freeing kept tensors early] and [freeing the
incoming gradient].
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["free_storage", "keeping_graph", "sole_owner"]


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
    st = t.untyped_storage()
    if st.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0:
        st.resize_(0)


def keeping_graph() -> bool:
    """Whether the running backward retains the graph (``retain_graph=True``); ``True`` when unknown."""
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):  # pragma: no cover - private API moved / no graph task
        return True


def sole_owner(t: Tensor) -> bool:
    """Whether ``t`` (an incoming gradient) is referred to by nothing but the engine's
    slot for this call: no other tensor, view or autograd buffer shares its storage, which
    it covers exactly.

    # Note: [freeing the incoming gradient]
    # The engine keeps a Function's incoming gradient alive until backward returns, but
    # a fused layer or chain is done with it as soon as the (last) layer's activation
    # backward has read it: an activation-sized buffer held through the whole chain for nothing. When the
    # gradient is ours alone (use count 1: not shared with another branch's input buffer,
    # not held by a hook or by the caller of ``backward(gradient)``; its storage not
    # shared with a view) its storage is freed right there, as AccumulateGrad steals a
    # gradient it alone holds. Whoever may still read it holds a reference, which makes
    # it shared: module backward hooks keep their own, and the engine copies a node's
    # inputs when the node has post-hooks (``grad_fn.register_hook``), exactly so that
    # stealing checks like this one see them.
    """
    if t.requires_grad or t.dim() == 0 or t._use_count() != 1:
        return False
    try:
        st = t.untyped_storage()
        # one reference from t's TensorImpl, one from ``st`` itself
        shared = torch._C._storage_Use_Count(st._cdata) != 2
    except (AttributeError, RuntimeError, NotImplementedError):  # pragma: no cover - private API moved
        return False
    return not shared and st.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
