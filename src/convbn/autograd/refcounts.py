"""Whether a Function's incoming gradient is its backward's alone (:func:`sole_owner`), so
that its memory may be returned once consumed (Note: [freeing the incoming gradient]):
judged by its Python reference count and C++ use count against a fresh gradient's, measured
once per process by a probe Function (:func:`calibrate`, Note: [calibrated once, in a clean
state]). The freeing itself is :func:`convbn.autograd.release.free_storage`.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from .._compat import current_autograd_node, storage_use_count

__all__ = ["sole_owner", "incoming_refs", "cpp_uses", "frees_incoming_gradients", "calibrate"]


def incoming_refs(grad: Tensor) -> int:
    """Python references to ``grad``; call it on the first line of a Function's backward
    and pass the result to :func:`sole_owner` (``-1`` while compiling: never freed)."""
    if torch.compiler.is_compiling():
        return -1
    return sys.getrefcount(grad)


def cpp_uses(t: Tensor) -> int:
    """C++ references to ``t``'s TensorImpl (autograd buffers, engine copies, the Python object)."""
    return t._use_count()


class _Probe(torch.autograd.Function):
    """Reads :func:`incoming_refs` and :func:`cpp_uses` of its incoming gradient the way the
    fused Functions do (first line of a plain ``backward``)."""

    seen: Optional[Tuple[int, int]] = None

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        refs = incoming_refs(grad)
        _Probe.seen = (refs, cpp_uses(grad))
        return grad * 1


def _probe(hold: str = "") -> Optional[Tuple[int, int]]:
    """``(python refs, C++ uses)`` of a fresh incoming gradient, or of one that ``hold``
    keeps: ``"python"`` (a tensor hook stores it in a list) or ``"engine"`` (a post-hook
    on the node makes the engine keep a copy of the node's inputs)."""
    _Probe.seen = None
    kept: List[Tensor] = []
    with torch.enable_grad():
        x = torch.zeros(2, requires_grad=True)
        y = _Probe.apply(x)
        if hold == "python":
            y.register_hook(lambda g: kept.append(g))
        elif hold == "engine":
            y.grad_fn.register_hook(lambda grad_in, grad_out: None)
        (y * 2).sum().backward()  # MulBackward hands over a fresh gradient
    return _Probe.seen


#: ``(python refs, C++ uses)`` of a fresh, unshared incoming gradient; ``None`` where the
#: counts cannot tell a held gradient from a fresh one (then nothing is freed). Written once
#: per process (Note: [calibrated once, in a clean state]), never changed afterwards.
_FRESH: Optional[Tuple[int, int]] = None
_CALIBRATED = False
_LOCK = threading.Lock()


def _traced() -> bool:
    """Whether a Python trace or profile function is set for this thread (Note: [calibrated
    once, in a clean state])."""
    return sys.gettrace() is not None or sys.getprofile() is not None


def _fresh_counts() -> Optional[Tuple[int, int]]:
    """The calibrated counts (Note: [freeing the incoming gradient]); ``None`` where they
    cannot prove anything, and while not yet calibrated.

    # Note: [calibrated once, in a clean state]
    # The counts are only meaningful for the call path a real backward takes, with nothing
    # else holding references. One thing that adds references from outside is known and
    # measured: a Python trace function (``sys.settrace``: debuggers, coverage's Python
    # tracer, Hypothesis' explain phase) that reads ``frame.f_locals`` materialises the
    # locals of every frame it sees, a dict holding the gradient once more (a fresh
    # gradient then counts 8 references instead of 6 on CPython 3.11). A process that
    # calibrated in such a state, or calibrated cleanly and later ran under a tracer, had
    # counts that matched nothing -- or, the other way round, matched a *shared*
    # gradient -- which is the drift (6, then 7) seen once in a full test run. So the probe
    # runs once per process, outside any backward and with no trace or profile function
    # set (elsewhere it reports ``None`` and tries again at the next fused forward), and
    # its result is never rewritten: nothing a later step, thread or loaded model does can
    # make it stale. A backward that runs while a trace or profile function is set frees
    # no incoming gradient (:func:`sole_owner`): the counts mean nothing there.
    """
    global _FRESH, _CALIBRATED
    if _CALIBRATED:
        return _FRESH
    with _LOCK:
        if not _CALIBRATED:
            if current_autograd_node() is not None or torch.compiler.is_compiling() or _traced():
                return None
            fresh, by_python, by_engine = _probe(), _probe("python"), _probe("engine")
            sees_holders = (fresh is not None and by_python is not None and by_engine is not None
                            and by_python[0] > fresh[0] and by_engine[1] > fresh[1])
            _FRESH = fresh if sees_holders else None
            _CALIBRATED = True
    return _FRESH


def calibrate() -> None:
    """Measure the fresh-gradient counts if this process has not yet (Note: [calibrated once,
    in a clean state]); a no-op inside a backward, while compiling and under a tracer."""
    if not _CALIBRATED:
        _fresh_counts()


def frees_incoming_gradients() -> bool:
    """Whether this interpreter and torch let :func:`sole_owner` prove a gradient unshared
    (Note: [freeing the incoming gradient]); where not, incoming gradients are never freed."""
    if torch.compiler.is_compiling():
        return False
    return _fresh_counts() is not None


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
    # gradient it alone holds. "Ours alone" is judged against a fresh gradient handed to a
    # probe Function through the same call path, measured once per process: its Python
    # reference count and its C++ use count. The absolute numbers differ between versions
    # (CPython 3.11 and 3.12 count the args tuple, the frame and the call; 3.14 borrows
    # references for locals; torch releases the engine's own C++ reference before calling
    # backward in some versions and holds it to the end in others), so nothing is
    # hard-coded: a gradient is freed when both counts equal the fresh gradient's. Anything
    # else holding it adds a reference: a tensor hook or module backward hook keeping it
    # (Python), another branch's input buffer, ``retain_grad``, a caller of
    # ``backward(gradient)`` or the engine's copy for the node's post-hooks (C++). The
    # calibration also checks that both counts *see* such holders (a hook keeping the
    # probe's gradient must raise the Python count, a post-hook the C++ count); where they
    # do not (an interpreter whose counts omit them), nothing is freed. CPython's immortal
    # objects (3.12, PEP 683) do not concern tensors, which are never immortal.
    """
    if type(t) is not Tensor or torch.compiler.is_compiling():  # traced: the compiler plans memory
        return False
    if t.requires_grad or t.dim() == 0:
        return False
    fresh = _FRESH if _CALIBRATED and not _traced() else None  # Note: [calibrated once, in a clean state]
    if fresh is None or refs != fresh[0] or cpp_uses(t) != fresh[1]:
        return False
    try:
        st = t.untyped_storage()
        # one reference from t's TensorImpl, one from ``st`` itself
        shared = storage_use_count(st) != 2
    except (AttributeError, RuntimeError, NotImplementedError):  # pragma: no cover - private API moved
        return False
    return not shared and st.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
