"""Accumulating a chain's weight gradients into ``.grad`` as soon as each is computed.

# Note: [weight gradients as eager releases them]
# A Function returns every input's gradient at once, so a chain's backward would hold
# the weight gradients of all its layers until it returns; eager's engine runs each
# parameter's ``AccumulateGrad`` right after that layer's own backward, so at most one
# layer's weight gradient is in flight. Where weights dominate memory (small inputs,
# big heads, gradient accumulation into existing ``.grad``) the held gradients made a
# converted step peak above eager (ResNet-18 at 4x3x32x32 accumulating: 1.80x).
#
# The chain therefore does the parameter's accumulation itself, the way
# ``AccumulateGrad`` would (a fresh gradient is stolen when its layout obeys the
# parameter's, else copied to the parameter's strides; an existing ``.grad`` is added to
# in place), and returns a zero-byte stand-in, ``zeros(()).expand(shape)``, in its slot:
# the engine still runs the ``AccumulateGrad`` node (adding zero in place, a no-op on the
# values), so post hooks on it (DDP's reducer) and post-accumulate-grad hooks still fire
# with ``.grad`` final. Only where nothing else could observe the difference:
#
# * the input's next node is the parameter's ``AccumulateGrad`` and the engine will run it
#   (``torch._C._will_engine_execute_node``: false under ``torch.autograd.grad`` and
#   ``backward(inputs=...)`` that leave the parameter out);
# * the parameter has no tensor hooks (they would see the stand-in, not the gradient);
# * the backward is first order (no ``create_graph``), not traced by a compiler, and
#   the parameter is a dense strided leaf.
#
# Otherwise the gradient is returned as before.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._compat import will_engine_execute_node

__all__ = ["GradSink", "Recording", "param_sink", "stand_ins"]

#: ``sink(index, grad)``: the value to return in that gradient slot
GradSink = Callable[[int, Optional[Tensor]], Optional[Tensor]]


def _accumulate(param: Tensor, grad: Tensor) -> None:
    """``param.grad`` as ``AccumulateGrad`` leaves it after receiving ``grad`` (grad mode off)."""
    if param.grad is None:
        if grad._base is None and grad.stride() == param.stride() and grad.storage_offset() == 0:
            param.grad = grad.detach()
        else:
            out = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device)
            param.grad = out.copy_(grad)
    else:
        param.grad += grad


_ZEROS: Dict[Tuple[torch.dtype, torch.device], Tensor] = {}


def _zero(like: Tensor) -> Tensor:
    """A zero scalar of ``like``'s dtype and device, made once (read only): the stand-ins
    expand it, so returning one allocates nothing."""
    key = (like.dtype, like.device)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros((), dtype=like.dtype, device=like.device)
    return z


def stand_ins() -> Tuple[Tensor, ...]:
    """The zero scalars the stand-ins expand (alive for the process: a memory meter counts
    them as live before a step, see :class:`convbn.memory.tensor_peak`)."""
    return tuple(_ZEROS.values())


def _will_run(fn: Any) -> bool:
    """Whether the running backward executes ``fn``; ``False`` under ``torch.autograd.grad``,
    which never accumulates into ``.grad`` (and refuses the question for a leaf's node)."""
    try:
        return will_engine_execute_node(fn)
    except RuntimeError:
        return False


def param_sink(node: Any, first: int, tensors: Sequence[Optional[Tensor]]) -> Optional[GradSink]:
    """A :data:`GradSink` for a custom Function's backward whose gradient slot ``first + j``
    belongs to ``tensors[j]``, an input of the node (Note: [weight gradients as eager
    releases them]); ``None`` when no slot may be accumulated here (compiling, grad mode on).

    Args:
        node: the backward's ``ctx`` (the autograd node; its ``next_functions`` are read).
        first: the gradient slot of ``tensors[0]``.
        tensors: the node's inputs for those slots, in order (``None`` for an absent one).
            Every tensor input of a Function has one edge in ``next_functions``, non-tensor
            inputs none, so the edges of ``tensors`` are the last ``len(present)``
            edges before any inputs that follow them; callers pass the trailing tensor
            inputs of the call.

    Returns:
        ``sink(i, grad)``: accumulates ``grad`` into its parameter and returns the
        zero-byte stand-in, or returns ``grad`` unchanged.
    """
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return None
    for t in tensors:  # made before any step is measured (convert's validation runs a backward)
        if t is not None:
            _zero(t)
            break
    try:
        edges = node.next_functions
    except (AttributeError, RuntimeError):  # pragma: no cover - not an autograd node
        return None
    present = [t for t in tensors if t is not None]
    if len(present) > len(edges):
        return None
    start = len(edges) - len(present)
    edge_of: Dict[int, Tuple[Any, Tensor]] = {}
    k = start
    for j, t in enumerate(tensors):
        if t is not None:
            edge_of[first + j] = (edges[k][0], t)
            k += 1

    def sink(i: int, grad: Optional[Tensor]) -> Optional[Tensor]:
        if grad is None or i not in edge_of:
            return grad
        fn, expected = edge_of[i]
        param = getattr(fn, "variable", None)
        if (param is None or param is not expected or type(param) not in (Tensor, torch.nn.Parameter)
                or param._backward_hooks or param.layout != torch.strided
                or grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device
                or not _will_run(fn)):
            return grad
        _accumulate(param, grad)
        return _zero(grad).expand(param.shape)

    return sink


class Recording:
    """A :data:`GradSink` that remembers whether it accumulated a gradient into a ``.grad``.

    # Note: [a backward that stops part way]
    # A chain is one autograd node for what eager runs as several, and its backward does
    # what eager's later nodes would have done by then: frees kept tensors (Note: [freeing
    # kept tensors early] in autograd/release.py) and accumulates weight gradients into
    # ``.grad`` (Note: [weight gradients as eager releases them]). When the backward raises part way (a failed
    # allocation, an exception in a hook or a later op, Ctrl-C) the engine does not release
    # the node (nor where a hook on the node raises after it returned), so a retried
    # ``backward`` would run it again: on freed storage (a crash) and adding the gradients
    # already accumulated a second time. Eager raises there: the nodes that had run were
    # released. So, in a backward that does not retain the graph, a chain that freed or
    # accumulated anything marks its node (``ctx.spent``), and every later backward
    # through it raises eager's error, before unpacking anything; ``.grad`` keeps what was
    # accumulated before the fault, as eager's does. A chain that raised before either
    # (nothing observable done) runs again in full, as eager's nodes would. With
    # ``retain_graph=True`` nothing is freed and a retry recomputes and accumulates again,
    # as eager's retained nodes do.
    """

    def __init__(self, sink: Optional[GradSink]) -> None:
        self.sink = sink
        self.accumulated = False

    def __call__(self, j: int, grad: Optional[Tensor]) -> Optional[Tensor]:
        if self.sink is None:
            return grad
        out = self.sink(j, grad)
        if out is not grad:
            self.accumulated = True
        return out
