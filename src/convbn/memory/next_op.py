"""The bytes an operator is about to make, known before it runs.

# Note: [stopping before the operator that would cross]
# A step measured against a limit (``timeline(stop_above=...)``) must not go over the limit to
# learn that it does not fit. Before each operator runs, :func:`new_output_bytes` runs it on
# the meta device (shapes, strides and dtypes only: nothing is allocated, no kernel runs) and
# sums the storages of the outputs the schema says are new (a view's, an in-place or ``out=``
# result's storage is an input's). Live bytes after an operator are live bytes before it plus
# those storages (the step's frees happen between operators), so a step whose next operator
# would take it over the limit is stopped before that operator allocates: the tensors a
# stopped step holds never exceed the limit. Where meta cannot stand in (an operator without a
# meta kernel, a data-dependent shape, a sparse or subclass tensor) the prediction is ``None``
# and the operator is checked after it runs, as before.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .._compat import dispatch_modes_disabled, pytree

__all__ = ["new_output_bytes"]

_META = torch.device("meta")


def _as_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        if type(value) is not Tensor and not isinstance(value, torch.nn.Parameter) or value.layout != torch.strided:
            raise _CannotTell
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=_META)
    if isinstance(value, torch.device):
        return _META
    return value


class _CannotTell(Exception):
    pass


def new_output_bytes(func: Any, args: Any = (), kwargs: Any = None) -> Optional[int]:
    """Bytes of the new storages ``func(*args, **kwargs)`` would return (outputs aliasing an
    input, views and in-place results, are not new), computed on the meta device before the
    operator runs (Note: [stopping before the operator that would cross]); ``None`` where
    meta cannot tell (the operator is then measured after it runs).

    Example:
        >>> new_output_bytes(torch.ops.aten.add.Tensor, (torch.ones(4), torch.ones(4)))
        16
        >>> new_output_bytes(torch.ops.aten.add_.Tensor, (torch.ones(4), torch.ones(4)))
        0
    """
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    kwargs = dict(kwargs or {})
    try:
        margs, mkwargs = pytree.tree_map(_as_meta, (tuple(args), kwargs))
    except _CannotTell:
        return None
    if not any(isinstance(t, Tensor) for t in pytree.tree_leaves((margs, mkwargs))):
        if "device" not in {a.name for a in schema.arguments}:
            return None  # a factory without a device argument would allocate where it runs
        mkwargs.setdefault("device", _META)  # a factory: made on meta, never on the real device
    try:
        with dispatch_modes_disabled():  # no meter (and no mode) sees the meta run
            out = func(*margs, **mkwargs)
    except Exception:  # no meta kernel, a data-dependent shape, a device-specific argument
        return None
    outs = out if isinstance(out, (tuple, list)) and len(schema.returns) != 1 else (out,)
    total = 0
    for ret, value in zip(schema.returns, outs):
        if ret.alias_info is not None:
            continue
        for t in pytree.tree_leaves(value):
            if isinstance(t, Tensor):
                total += t.untyped_storage().nbytes()
    return total
