"""The arguments of :func:`convbn.convert`, checked before any work."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Tuple

import torch
from torch import Tensor, nn

from ..._compat import pytree
from ...functional.strategies import CONVERT_STRATEGIES, check_strategy
from ...memory.budget import parse_memory
from ..graph.meta import meta_tensor
from ..graph.scripted import reject_torchscript
from .recapture import refuse_flat_parameters

__all__ = ["check_args", "example_inputs_named"]


def check_args(model: Any, strategy: str, memory_budget: Optional[float], example_inputs: Any,
               peak_budget: Optional[float] = None, memory_limit: Any = None,
               time_budget: Optional[float] = None) -> None:
    """Every argument of :func:`convert` checked before any work: ``TypeError`` / ``ValueError`` naming it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects an nn.Module, but got {type(model).__name__}")
    reject_torchscript(model, "convert")
    refuse_flat_parameters(model)
    check_strategy(strategy, CONVERT_STRATEGIES)
    _check_time_budget(time_budget, strategy, example_inputs, peak_budget, memory_limit)
    on_meta = meta_tensor(model)
    if example_inputs is not None and on_meta is not None:
        raise ValueError(
            f"convert(example_inputs=...) runs the model on them, but {on_meta!r} is on the meta device (shapes "
            f"without values). Either convert without example_inputs (the model is converted on its first call "
            f"once materialised: model.to_empty(device=...) and its weights loaded), or materialise it first.")
    if memory_limit is not None:
        parse_memory(memory_limit)  # TypeError / ValueError naming the value
        if strategy != "auto":
            raise ValueError(f"memory_limit is used by strategy='auto' only, but got strategy={strategy!r}")
        if peak_budget is not None:
            raise ValueError("give memory_limit (bytes for the whole step) or peak_budget (a fraction of eager's "
                             "peak), not both")
        if example_inputs is None:
            raise ValueError("memory_limit needs example_inputs: the plan is made for their batch")
    if peak_budget is not None:
        if strategy != "auto":
            raise ValueError(f"peak_budget is used by strategy='auto' only, but got strategy={strategy!r}")
        if isinstance(peak_budget, bool) or not isinstance(peak_budget, (int, float)) or not 0 < peak_budget <= 1:
            raise ValueError(f"peak_budget must be a fraction of the eager step's peak memory in (0, 1], "
                             f"but got {peak_budget!r}")
        if example_inputs is None:
            raise ValueError("peak_budget needs example_inputs: the planner measures the eager step's peak on them")
    if memory_budget is not None:
        if strategy != "auto":
            raise ValueError(f"memory_budget is used by strategy='auto' only, but got strategy={strategy!r}")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not 0 < memory_budget <= 1:
            raise ValueError(
                f"memory_budget must be a fraction of eager saved activation bytes in (0, 1], but got {memory_budget!r}"
            )
        if example_inputs is None:
            raise ValueError("memory_budget needs example_inputs: the planner measures eager saved bytes on them")


def _check_time_budget(time_budget: Optional[float], strategy: str, example_inputs: Any,
                       peak_budget: Optional[float], memory_limit: Any) -> None:
    """``time_budget``: a positive ratio of the unconverted step's time, with ``"auto"`` and
    ``example_inputs``, and not with a peak asked for (both would choose the plan)."""
    if time_budget is None:
        return
    if strategy != "auto":
        raise ValueError(f"time_budget is used by strategy='auto' only, but got strategy={strategy!r}")
    if isinstance(time_budget, bool) or not isinstance(time_budget, (int, float)) or not 0 < time_budget < float("inf"):
        raise ValueError(f"time_budget must be a positive ratio of the unconverted model's step time (e.g. 1.05), "
                         f"but got {time_budget!r}")
    for name, value in (("peak_budget", peak_budget), ("memory_limit", memory_limit)):
        if value is not None:
            raise ValueError(f"give time_budget (the lowest peak within a step time) or {name} (the least recompute "
                             f"within a peak), not both")
    if example_inputs is None:
        raise ValueError("time_budget needs example_inputs: the step costs are measured on them")
def _mismatch(model: nn.Module, inputs: Tuple[Any, ...]) -> Optional[str]:
    """Where a floating tensor of ``inputs`` has another dtype or device than ``model``'s first
    floating parameter or buffer: ``"tensor 0 is torch.float64 on cpu, the model's parameters
    torch.float32 on cpu"``; ``None`` where they agree (or there is nothing to compare)."""
    ref = next((t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()), None)
    if ref is None:
        return None
    for i, t in enumerate(x for x in pytree.tree_leaves(inputs) if isinstance(x, Tensor)):
        if t.is_floating_point() and (t.dtype != ref.dtype or t.device != ref.device):
            return (f"tensor {i} is {t.dtype} on {t.device}, the model's parameters {ref.dtype} on {ref.device}")
    return None


@contextlib.contextmanager
def example_inputs_named(model: nn.Module, inputs: Tuple[Any, ...]) -> Iterator[None]:
    """Run the block (which runs ``model`` on ``inputs``); where it raises and a floating input's
    dtype or device differs from the model's, raise one ``ValueError`` naming ``example_inputs``
    and the difference instead of torch's own message (kept as the cause). A model that casts its
    inputs itself runs as before: the difference is named only where the model fails."""
    try:
        yield
    except (RuntimeError, TypeError) as exc:
        why = _mismatch(model, inputs)
        if why is None:
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"example_inputs do not match the model: {why} (the model raised: {first}); pass "
                         f"example_inputs as the model takes them, e.g. x.to(dtype, device)") from exc
