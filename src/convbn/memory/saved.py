"""What a model keeps for backward: saved bytes.

*Saved bytes* (SPEC §3) is the primary, deterministic memory metric: after one forward
pass in training mode, the total size of the distinct storages autograd holds for
backward, found with :func:`torch.autograd.graph.saved_tensors_hooks` and de-duplicated
by storage. A view keeps its whole storage alive, so it counts the whole storage.
Parameters count too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..nn.fused_conv_bn import OBSERVER_ATTR

__all__ = ["SavedBytes", "format_bytes", "saved_bytes", "track_saved"]


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _storage_key(t: Tensor) -> Optional[Tuple[Any, int, int]]:
    try:
        st = t.untyped_storage()
        return (t.device, st.data_ptr(), st.nbytes())
    except (RuntimeError, NotImplementedError):  # sparse, functional, fake or wrapper (DTensor) tensors
        return None


@dataclass
class SavedBytes:
    """What one forward pass saved for backward.

    Attributes:
        total: bytes of distinct storages held for backward.
        per_module: bytes attributed to the innermost module that was running when a
            storage was first saved (``""`` is the root / outside any module).
        count: number of distinct storages.
        shapes: ``(module, shape, dtype, nbytes)`` of each distinct storage, in save order.
        is_param: for each entry of ``shapes``, whether it is one of the model's parameters.
        param_bytes: bytes of those storages that are the model's parameters (known only
            when a model is given). ``total - param_bytes`` is what backward keeps beyond
            the weights the model holds anyway: compare *that* across methods that keep
            parameters differently (eager autograd saves them, convbn holds them by
            reference, ``torch.utils.checkpoint`` and compiled graphs vary).
    """

    total: int = 0
    param_bytes: int = 0
    per_module: Dict[str, int] = field(default_factory=dict)
    count: int = 0
    shapes: List[Tuple[str, Tuple[int, ...], torch.dtype, int]] = field(default_factory=list)
    is_param: List[bool] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        """Saved bytes that are not the model's parameters."""
        return self.total - self.param_bytes


class track_saved:
    """Context manager recording every tensor saved for backward inside it.

    Keeps a strong reference to nothing: only storage keys and sizes are recorded, and
    the saved tensors are handed back to autograd unchanged.

    Args:
        model: optional module: its parameters are recognised (``param_bytes``) and, with
            ``per_module``, its submodules get bytes attributed.
        per_module: attribute bytes to the submodules of ``model`` (adds hooks).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> with track_saved(net) as rec:
        ...     out = net(torch.randn(2, 4, requires_grad=True))
        >>> rec.result.total > 0
        True
    """

    def __init__(self, model: Optional[nn.Module] = None, per_module: bool = True) -> None:
        self.model = model
        self.per_module = per_module
        self._params: set = set()
        self.result = SavedBytes()
        self._seen: set = set()
        self._stack: List[str] = [""]
        self._handles: List[Any] = []
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _pack(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._seen:
            self._seen.add(key)
            nbytes = key[2]
            mod = self._stack[-1]
            self.result.total += nbytes
            self.result.count += 1
            if key in self._params:
                self.result.param_bytes += nbytes
            self.result.per_module[mod] = self.result.per_module.get(mod, 0) + nbytes
            self.result.shapes.append((mod, tuple(t.shape), t.dtype, nbytes))
            self.result.is_param.append(key in self._params)
        # Note: [a saved-tensors hook must not return the tensor itself]
        # Packing ``t`` itself makes the autograd node that saves it hold its own output
        # strongly (output -> grad_fn -> saved output): a reference cycle through C++ that
        # Python's collector cannot see, so the step's activations never die. A detached
        # alias shares the storage (the bytes counted are the same) without the edge.
        return t.detach() if t.grad_fn is not None else t

    @staticmethod
    def _unpack(t: Tensor) -> Tensor:
        return t


    def __enter__(self) -> "track_saved":
        if self.model is not None:
            self._params = {k for k in (_storage_key(p) for p in self.model.parameters()) if k is not None}
        if self.model is not None and self.per_module:
            for name, mod in _with_fused(self.model):
                self._handles.append(mod.register_forward_pre_hook(self._make_pre(name)))
                self._handles.append(mod.register_forward_hook(self._post, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def _make_pre(self, name: str) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            self._stack.append(name)

        setattr(pre, OBSERVER_ATTR, True)  # attribution only: fused modules stay fused
        return pre

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if len(self._stack) > 1:
            self._stack.pop()

    setattr(_post, OBSERVER_ATTR, True)

    def __exit__(self, *exc: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _with_fused(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``model.named_modules()`` plus the unregistered modules a convbn rewrite added (listed by
    the installed forward's ``added``; see Note: [where the fused modules live] in passes/graph/graph_module.py)."""
    for name, mod in model.named_modules():
        yield name, mod
        for target in getattr(vars(mod).get("forward"), "added", ()):
            sub: Any = mod
            for part in target.split("."):
                sub = getattr(sub, part, None)
            if isinstance(sub, nn.Module):
                yield (f"{name}.{target}" if name else target), sub


def saved_bytes(
    model: nn.Module,
    *inputs: Any,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    per_module: bool = False,
) -> SavedBytes:
    """Bytes a training-mode forward pass of ``model(*inputs)`` keeps for backward.

    Runs one forward pass (the model's running statistics are updated, as in any
    training forward) and drops the graph afterwards without running backward.

    Args:
        model: the module to run (its current ``training`` mode is used).
        *inputs: positional inputs for ``model``.
        loss_fn: optional function of the output whose saved tensors count too.
        per_module: attribute bytes to submodules (adds hooks; slightly slower).

    Returns:
        :class:`SavedBytes`.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> saved_bytes(net, torch.randn(2, 3, 8, 8)).total > 0
        True
    """
    with torch.enable_grad(), track_saved(model, per_module=per_module) as rec:
        out = model(*inputs)
        if loss_fn is not None:
            out = loss_fn(out)
    del out
    return rec.result
