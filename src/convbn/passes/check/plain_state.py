"""The state a model keeps outside its tensors' values: plain Python attributes of its modules
(a cache's length, a step counter, a flag) and which tensor each buffer name is bound to.

# Note: [a check's run leaves the model's plain state as it was]
# ``convert`` and ``fold`` run the user's model for their checks and measurements inside
# :class:`~convbn.passes.check.validate.StateSnapshot`, which puts every buffer's *values*
# back. A module may keep state beside its buffers that says what the buffers hold:
# ``rotary_embedding_torch``'s ``RotaryEmbedding`` fills the non-persistent buffer
# ``cached_freqs`` on its first call and sets the plain int ``cached_freqs_seq_len``; with the
# buffer put back to zeros and the length left at 4, every later call read a zero cache
# (video-diffusion-pytorch's ``Unet3D`` after ``convert``: output off by 0.11, nothing fused).
# So the snapshot also keeps each module's plain attributes (``None``, numbers, strings, tuples
# of those) and its buffer bindings, and puts both back: values that changed are set again,
# plain attributes that appeared are removed (a lazily created counter starts again on the
# user's first call, as it would have), and a buffer name bound to a new tensor in the block
# is bound to its tensor from before. convbn's own attributes (``forward``, ``convbn_*``,
# private names) are objects or private and are not touched.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from torch import nn

__all__ = ["PlainState", "is_plain"]

_MISSING = object()


def is_plain(value: Any) -> bool:
    """``None``, a bool, number, string or bytes, or a tuple of those: a value a module's
    attribute holds that is state, not an object convbn or torch installed."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    return isinstance(value, tuple) and all(is_plain(v) for v in value)


def _public(name: str) -> bool:
    return not name.startswith("_") and not name.startswith("convbn")


class PlainState:
    """Plain attributes and buffer bindings of every module of ``model``, taken now;
    :meth:`restore` puts them back (Note: [a check's run leaves the model's plain state as it was])."""

    def __init__(self, model: nn.Module) -> None:
        self.attrs: List[Tuple[nn.Module, Dict[str, Any]]] = []
        self.buffers: List[Tuple[nn.Module, Dict[str, Any]]] = []
        for m in model.modules():
            self.attrs.append((m, {k: v for k, v in m.__dict__.items() if _public(k) and is_plain(v)}))
            self.buffers.append((m, dict(m._buffers)))

    def restore(self) -> None:
        for m, saved in self.attrs:
            now = m.__dict__
            for k, v in saved.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
            for k in [k for k, v in now.items() if k not in saved and _public(k) and is_plain(v)]:
                del now[k]
        for m, bound in self.buffers:
            for k, t in bound.items():
                if k in m._buffers and m._buffers[k] is not t:
                    m._buffers[k] = t
