"""Inductor-fused kernels for a chain layer's element-wise work (opt-in), with the ATen path as
reference and fallback.

:func:`fused_layer_forward` / :func:`fused_layer_backward` run
:mod:`convbn.functional.bn_act`'s pure functions compiled by ``torch.compile(dynamic=True)``
(one kernel serves every batch size; inductor's on-disk cache keeps them across processes):
the forward's statistics + normalise + activation, and the backward's rebuild + activation
backward + BN backward reductions + input gradient, in the passes Note: [one layer's
element-wise passes] counts. They return ``None`` where they do not apply, and the caller
runs the ATen path: kernels off, a layer with a tail, a BN normalising with its running
statistics, a process group or a momentum tensor, a dtype other than float32, a device other
than the CPU (on an H100 the fused forward lost to cuDNN's batch norm at most ResNet-50
shapes: BENCHMARKS.md), a tensor traced by a compiler, an active dispatch mode (a memory
timeline), or a failed compilation (then off for the process, with a warning).

Selection: ``with fused_kernels(True):`` (scoped), or the environment variable
``CONVBN_FUSED_KERNELS=1`` as the default.
Off by default: compiling costs seconds per (activation, layout, affine) variant on a cold
cache, and the step-time gain on a whole model is not measured yet (BENCHMARKS.md "Issue 25").
Rounding: the fused kernels accumulate in float32 in a different order; against the ATen
path the results differ by float32 rounding (``bm_elementwise.py`` prints the largest
difference per shape); in float64 both are the same maths (tests/test_chain_kernels.py).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._compat import current_dispatch_mode
from ..functional.activations import Activation
from ..functional.batchnorm import BNSpec
from ..functional.bn_act import bn_act_backward, bn_act_forward
from ..functional.deprecation import warn_renamed

__all__ = ["fused_kernels", "fused_kernels_enabled", "set_fused_kernels", "fused_layer_forward", "fused_layer_backward"]

# "on": None while ``CONVBN_FUSED_KERNELS`` decides (read when asked), else the innermost fused_kernels block's
_STATE: Dict[str, Any] = {"on": None, "failed": False}
_COMPILED: Dict[str, Callable[..., Any]] = {}
# which activations the kernels cover is the table's (Activation.fused_forward_kernel /
# fused_backward_kernel in functional/activations.py)


def _switched_on() -> bool:
    on = _STATE["on"]
    return os.environ.get("CONVBN_FUSED_KERNELS", "0") == "1" if on is None else bool(on)


class fused_kernels(contextlib.ContextDecorator):
    """Use the fused element-wise kernels (``True``) or not (``False``) inside a ``with`` block
    (or a decorated function).

    Outside every block the environment variable ``CONVBN_FUSED_KERNELS=1`` turns them on (read
    when a layer runs); off by default. The switch is read by each layer's forward and again
    by its backward: keep the backward inside the block for both to use the same setting
    (either way the results agree to float32 rounding).

    Thread safety: like ``torch.backends.cudnn.flags()``, the switch is process-wide: while a
    block is open every thread (autograd's backward threads included) sees it. Open and close
    blocks in one thread; nested blocks restore the previous setting in order, on exit and on
    an exception.

    Args:
        on: ``True`` to use them where they apply.

    Example:
        >>> with fused_kernels(False):
        ...     fused_kernels_enabled()
        False
    """

    def __init__(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"fused_kernels expects a bool, but got {on!r}")
        self.on = on
        self._saved: List[Optional[bool]] = []  # one per open block: re-entrant, nestable

    def __enter__(self) -> "fused_kernels":
        self._saved.append(_STATE["on"])
        _STATE["on"] = self.on
        return self

    def __exit__(self, *exc: Any) -> None:
        _STATE["on"] = self._saved.pop()  # None again where the environment decided


def set_fused_kernels(on: bool) -> bool:
    """Deprecated: use ``with convbn.fused_kernels(on):``. Turns the fused element-wise kernels
    on or off for the process (until set again); returns the previous setting.

    Args:
        on: ``True`` to use them where they apply.

    Returns:
        The previous setting.
    """
    warn_renamed("set_fused_kernels(on)", "with convbn.fused_kernels(on): ...")
    if not isinstance(on, bool):
        raise TypeError(f"set_fused_kernels expects a bool, but got {on!r}")
    prev = _switched_on()
    _STATE["on"] = on
    return prev


def fused_kernels_enabled() -> bool:
    """Whether the fused kernels are on (and have not failed to compile in this process)."""
    return _switched_on() and not _STATE["failed"]


def _compiled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


def _applies(y: Tensor, bn: Optional[BNSpec], act: Activation) -> bool:
    # Under a dispatch mode (convbn.memory.timeline, MemTracker) the compiled kernel would not
    # run: Dynamo would run the pure functions op by op, each temporary a tensor the mode
    # counts, and report a peak the kernels never reach. The ATen path runs instead: its peak
    # is the kernels' (tests/test_chain_kernels.py measures both at the allocator).
    return (fused_kernels_enabled() and bn is not None and bn.batch_stats and bn.process_group is None
            and not isinstance(bn.momentum, Tensor) and act.fused_forward_kernel and y.dtype == torch.float32
            and y.device.type == "cpu" and type(y) is Tensor and not torch.compiler.is_compiling()
            and current_dispatch_mode() is None)


def _run(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    # plain tensors: dynamo keeps a Parameter's shape static, which would make the channel
    # count static too and compile one kernel per width
    args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    try:
        return _compiled(name, fn)(*args)
    except Exception as e:  # no compiler, an unsupported case: the ATen path from now on
        _STATE["failed"] = True
        warnings.warn(f"convbn: fused element-wise kernels unavailable ({type(e).__name__}: {e}); using ATen kernels")
        return None


def fused_layer_forward(y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], running_mean: Optional[Tensor],
                        running_var: Optional[Tensor], bn: Optional[BNSpec], act: Activation) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """``(out, mean, invstd)`` of BN with batch statistics then ``act``, running stats updated
    as ``native_batch_norm`` does; ``None`` where the fused kernels do not apply."""
    if not _applies(y, bn, act) or not y.is_contiguous():  # channels_last: ATen's forward measured faster
        return None
    with torch.no_grad():
        res = _run("fwd", bn_act_forward, y, weight, bias, bn.eps, act)  # type: ignore[union-attr]
        if res is None:
            return None
        out, mean, invstd = res
        if running_mean is not None and running_var is not None:
            n = y.numel() // y.shape[1]
            var = (invstd.pow(-2) - bn.eps) * (n / max(n - 1, 1))  # type: ignore[union-attr]
            running_mean.lerp_(mean.to(running_mean.dtype), float(bn.momentum))  # type: ignore[union-attr]
            running_var.lerp_(var.to(running_var.dtype), float(bn.momentum))  # type: ignore[union-attr]
    return out, mean, invstd


def fused_layer_backward(grad_out: Tensor, y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                         invstd: Tensor, bn: Optional[BNSpec], act: Activation) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """``(grad_y, grad_weight, grad_bias)`` of BN + ``act`` from ``y`` and the saved statistics,
    the activation's input rebuilt inside; ``None`` where the fused kernels do not apply."""
    if (not _applies(y, bn, act) or not act.fused_backward_kernel or grad_out.dtype != y.dtype
            or type(grad_out) is not Tensor):
        return None
    with torch.no_grad():
        return _run("bwd", bn_act_backward, grad_out, y, weight, bias, mean, invstd, act)
