"""Memory a training run needs in all: what stays resident, and limits given as text.

A training step needs ``resident + peak`` bytes: the parameters, buffers and optimizer
state alive between steps (:func:`resident_bytes`), plus the step's peak above them
(:func:`convbn.memory.timeline`, Note: [a step's peak]; weight gradients included). A
limit such as ``"16GiB"`` is read by :func:`parse_memory`. On CUDA the caching allocator
needs more than it hands out (Note: [CUDA headroom]).
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional, Set

import torch
from torch import Tensor, nn

__all__ = ["parse_memory", "resident_bytes", "usable_bytes", "CUDA_FRAGMENTATION_MARGIN"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

#: Share of a CUDA memory limit kept free for the caching allocator (Note: [CUDA headroom]).
CUDA_FRAGMENTATION_MARGIN = 0.1


def parse_memory(value: Any) -> int:
    """Bytes from ``16GiB``, ``"512 MiB"``, ``"2.5GB"`` or a number of bytes.

    Args:
        value: an ``int`` / ``float`` number of bytes, or a string: a number and a unit
            among B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024).

    Returns:
        The number of bytes (rounded down), positive.

    Raises:
        ValueError: below one byte, not finite (NaN, infinity), or a string that is not a
            number and a unit.
        TypeError: neither a number nor a string.

    Example:
        >>> parse_memory("16GiB"), parse_memory("1.5 kB"), parse_memory(4096)
        (17179869184, 1500, 4096)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"memory must be a number of bytes or a string such as '16GiB', but got {type(value).__name__}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise ValueError(f"memory must be a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
                             f"such as '16GiB', but got {value!r}")
        out = int(float(m.group(1)) * _UNITS[unit])
    else:
        if not math.isfinite(value):
            raise ValueError(f"memory must be a finite number of bytes, but got {value!r}")
        out = int(value)
    if out <= 0:
        raise ValueError(f"memory must be positive (at least one byte), but got {value!r}")
    return out


def resident_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
    """Bytes alive between training steps: ``model``'s parameters and buffers and the
    optimizer's state tensors, each storage counted once (gradients are not: the standard
    loop sets them to None, and the step's peak counts them).

    Example:
        >>> resident_bytes(nn.Linear(4, 4))  # 16 weights + 4 biases, float32
        80
    """
    seen: Set[Any] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device) if st.data_ptr() else id(st)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()

    for t in (*model.parameters(), *model.buffers()):
        add(t)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                add(v)
    return total


def usable_bytes(memory: int, device: torch.device) -> int:
    """Of a memory limit, the bytes a step's tensors may occupy on ``device``.

    # Note: [CUDA headroom]
    # On CPU the limit is for live tensor bytes, measured exactly. On CUDA the caching
    # allocator reserves whole blocks and splits them, so ``memory_reserved`` runs above
    # ``memory_allocated`` (fragmentation); :data:`CUDA_FRAGMENTATION_MARGIN` of the limit
    # is kept for it. cuDNN's workspaces are allocated through the caching allocator, so
    # the step's measured peak (``max_memory_allocated``) includes them; the CUDA context
    # and cuBLAS/cuDNN handles are not in the allocator and not in the limit (the limit is
    # what ``torch.cuda.set_per_process_memory_fraction`` would set). Not verified on a GPU
    # yet: no GPU was available when this was written.
    """
    if device.type == "cuda":
        return int(memory * (1 - CUDA_FRAGMENTATION_MARGIN))
    return memory
