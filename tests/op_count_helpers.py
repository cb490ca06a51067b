"""Counting the ATen operators a training step dispatches (issue 39: a converted step's extra
kernels and casts, exact and device independent).

Every operator that reaches the dispatcher below autograd and autocast is seen by a
``TorchDispatchMode`` (autocast's own casts included: they dispatch ``aten::_to_copy``). Each
is sorted into one of three kinds:

* ``free``: metadata only, no kernel and no allocation (views, ``detach``, ``set_``, profiler marks);
* ``casts``: copies and casts (``_to_copy``, ``copy_``, ``clone``) and allocations (``empty*``,
  ``new_empty*``): memory traffic or allocator calls on an accelerator;
* ``kernels``: everything else (each a kernel launch on an accelerator).

``benchmarks/bm_norm_host.py`` prints these counts for the per-sample-norm nets;
``tests/test_norm_chain_ops.py`` bounds a converted step's by eager's plus the recompute's.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor, nn

from convbn._compat import TorchDispatchMode

__all__ = ["FREE", "ALLOCS", "CASTS", "OpCounter", "kind_of", "step_ops", "ops_of"]

#: operators that launch no kernel and allocate nothing
FREE = frozenset({
    "detach", "view", "_unsafe_view", "permute", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice",
    "select", "as_strided", "alias", "set_", "split", "split_with_sizes", "unbind", "_reshape_alias",
    "_record_function_enter_new", "_record_function_exit", "lift_fresh", "_version", "is_same_size", "empty(0)",
})
#: allocations (an empty one is free)
ALLOCS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
#: copies, casts and allocations
CASTS = frozenset({"_to_copy", "copy_", "clone", "_copy_from", "_copy_from_and_resize", *ALLOCS})


def kind_of(name: str) -> str:
    """``"free"``, ``"casts"`` or ``"kernels"`` for an ATen operator's name (its overload packet's)."""
    return "free" if name in FREE else "casts" if name in CASTS else "kernels"


class OpCounter(TorchDispatchMode):
    """Counts each operator dispatched while active, by name (``counts``; an in-place variant under
    its out-of-place name) and by kind (:meth:`of_kind`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ALLOCS and isinstance(out, Tensor) and out.numel() == 0:
            name = "empty(0)"  # an empty tensor (a handle for ``set_``): no allocator call
        elif name.endswith("_") and not name.startswith("_") and kind_of(name) == "kernels":
            name = name[:-1]  # an in-place variant is the same kernel as its out-of-place one
        self.counts[name] += 1
        return out

    def of_kind(self, kind: str) -> Counter:
        """The counts of the operators of one kind."""
        return Counter({k: v for k, v in self.counts.items() if kind_of(k) == kind})


def ops_of(fn: Callable[[], Any]) -> OpCounter:
    """The operators ``fn()`` dispatches."""
    with OpCounter() as c:
        fn()
    return c


def step_ops(model: nn.Module, x: Tensor, amp: Optional[torch.dtype] = None) -> OpCounter:
    """The operators of one standard training step of ``model`` on ``x`` (zero_grad(set_to_none=True),
    forward under ``torch.autocast(x's device, amp)`` where ``amp`` is given, mean loss in float32,
    backward; the optimizer's step is eager's in both and is left out), after one uncounted step
    (first-call work: lazy plans, checks)."""
    def step() -> None:
        for p in model.parameters():
            p.grad = None
        with torch.autocast(x.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            out = model(x)
        out.float().mean().backward()

    step()
    return ops_of(step)
