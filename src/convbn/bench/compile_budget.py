"""The one door to torch.compile's activation-memory budget and Dynamo's recompile limit.

``torch._functorch.config.activation_memory_budget`` (AOTAutograd's partitioner trades
recompute for memory: 1.0 keeps what the default partitioner keeps, 0.0 recomputes all it
can), ``torch._dynamo.config.recompile_limit`` and ``torch._inductor.config.layout_optimization``
are private torch names: ``convbn._compat`` imports them, and ``bench/`` reaches
them only here.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, List, Optional

import torch
from torch import Tensor

from convbn._compat import dynamo_config, functorch_config, inductor_compile_fx, inductor_config

__all__ = ["activation_memory_budget", "budget_backend", "has_activation_memory_budget", "raise_recompile_limit",
           "inductor_layout_optimization"]


def _functorch_config() -> Any:
    """AOTAutograd's settings where this torch has them, else ``None``."""
    try:
        return functorch_config()
    except ImportError:  # pragma: no cover - every torch this package declares has it
        return None


def has_activation_memory_budget() -> bool:
    """Whether this torch's partitioner takes an activation-memory budget."""
    cfg = _functorch_config()
    return cfg is not None and hasattr(cfg, "activation_memory_budget")


@contextlib.contextmanager
def activation_memory_budget(budget: float) -> Iterator[None]:
    """AOTAutograd's partitioner keeps at most ``budget`` (in (0, 1]) of what it would keep
    by default while the block runs (compiles started in it partition so).

    Raises:
        ValueError: ``budget`` outside (0, 1].
        RuntimeError: this torch has no activation-memory budget.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise ValueError(f"activation_memory_budget must be a fraction in (0, 1], but got {budget!r}")
    if not has_activation_memory_budget():
        raise RuntimeError(f"torch {torch.__version__} has no torch._functorch.config.activation_memory_budget: "
                           "compile with a memory budget needs a newer torch")
    with _functorch_config().patch(activation_memory_budget=float(budget)):
        yield


def budget_backend(budget: float) -> Callable[..., Any]:
    """An inductor backend that partitions with ``activation_memory_budget=budget``.

    A distinct callable per configuration: Dynamo keeps one cache entry per backend (Note:
    [One dynamo cache entry per budget] in :mod:`convbn.bench.training`).
    """
    with activation_memory_budget(budget):  # checks the value and the torch now, not at the first call
        pass

    def backend(gm: torch.fx.GraphModule, example_inputs: List[Tensor]) -> Any:
        with activation_memory_budget(budget):
            return inductor_compile_fx()(gm, example_inputs)

    backend.__name__ = f"inductor_budget_{format(budget, 'g').replace('.', '_')}"
    return backend


def raise_recompile_limit(limit: int) -> ContextManager[None]:
    """Dynamo's per-frame recompile limit raised to at least ``limit`` while the block runs:
    every converted model enters Dynamo through the same frame (the rewritten forward's
    ``__call__``), one cache entry per model and grad mode, so a frontier of a dozen models
    would run the last ones uncompiled under the default limit (8)."""
    try:
        config = dynamo_config()
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if not hasattr(config, name):  # pragma: no cover
        return contextlib.nullcontext()
    return config.patch(**{name: max(int(getattr(config, name)), int(limit))})


def inductor_layout_optimization(enabled: Optional[bool]) -> ContextManager[None]:
    """Inductor's layout optimisation (channels-last convolutions; on the CPU it saves a
    channels-last copy of each conv weight for backward) on or off while the block runs, for
    every graph compiled in it; ``None``: inductor's own setting."""
    if enabled is None:
        return contextlib.nullcontext()
    try:
        config = inductor_config()
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    if not hasattr(config, "layout_optimization"):  # pragma: no cover
        return contextlib.nullcontext()
    return config.patch(layout_optimization=bool(enabled))
