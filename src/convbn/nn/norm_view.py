"""``NormView``: which tensors of which of the model's modules a per-sample norm reads, and its call.

A fused chain layer normalising per sample (a row of :data:`convbn.functional.norms.NORMS`)
holds one: the module that owns the norm's tensors (an ``nn.GroupNorm`` / ``nn.InstanceNorm*d``
called as a module, or the module whose forward called ``F.group_norm`` / ``F.layer_norm`` ...
on its own parameters), the attribute names of those tensors, and how to read the call's static
arguments at each call (a module's ``training`` flag decides an InstanceNorm's statistics).
Like the BatchNorm a chain reads, nothing is copied: every call reads the module's tensors now.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

from torch import Tensor, nn

from ..functional.norms import NormCall, norm_forward, norm_row

__all__ = ["NormView"]


class NormView:
    """A per-sample norm as a chain layer reads it (see the module docstring).

    Args:
        owner: the module holding the tensors.
        row: the :data:`~convbn.functional.norms.NORMS` row name.
        call: the call's static arguments, or a function of ``owner`` giving them at each call
            (a module call: its ``training`` flag may change).
        channels: the channel count the norm normalises.
        weight, bias, running_mean, running_var: attribute names on ``owner`` (``None``: absent).
        module_call: whether the graph called ``owner`` itself (torch's forward: the eager
            fallback calls it, so its hooks run); else the tensors are read by a functional call.

    Example:
        >>> gn = nn.GroupNorm(2, 4)
        >>> v = NormView.of_module(gn)
        >>> v.call().groups, v.channels
        (2, 4)
    """

    def __init__(self, owner: nn.Module, row: str, call: Union[NormCall, Callable[[nn.Module], object]],
                 channels: int, weight: Optional[str] = "weight", bias: Optional[str] = "bias",
                 running_mean: Optional[str] = None, running_var: Optional[str] = None,
                 module_call: bool = False) -> None:
        self.owner, self.row, self._call, self.channels = owner, row, call, int(channels)
        self.names = (weight, bias, running_mean, running_var)
        self.module_call = module_call

    @classmethod
    def of_module(cls, module: nn.Module) -> "NormView":
        """The view of a norm module called with torch's forward (its row by ``isinstance``)."""
        from ..functional.norms import row_of_module

        row = row_of_module(module)
        if row is None:
            raise TypeError(f"{type(module).__name__} is no per-sample norm of convbn.functional.norms.NORMS")
        stats = getattr(module, "running_mean", None) is not None
        weight = getattr(module, "weight", None)
        channels = (getattr(module, "num_channels", None) or getattr(module, "num_features", None)
                    or (weight.numel() if isinstance(weight, Tensor) else 0))
        return cls(module, row.name, row.call_of_module, channels,
                   "weight" if hasattr(module, "weight") else None, "bias" if hasattr(module, "bias") else None,
                   "running_mean" if stats else None, "running_var" if stats else None, module_call=True)

    def _get(self, i: int) -> Optional[Tensor]:
        name = self.names[i]
        return None if name is None else getattr(self.owner, name)

    @property
    def weight(self) -> Optional[Tensor]:
        return self._get(0)

    @property
    def bias(self) -> Optional[Tensor]:
        return self._get(1)

    @property
    def running_mean(self) -> Optional[Tensor]:
        return self._get(2)

    @property
    def running_var(self) -> Optional[Tensor]:
        return self._get(3)

    def call(self) -> NormCall:
        """The call's static arguments now."""
        got = self._call if isinstance(self._call, NormCall) else self._call(self.owner)
        if not isinstance(got, NormCall):
            raise RuntimeError(f"{type(self.owner).__name__} no longer computes a fusable {self.row}: {got}")
        return got

    @property
    def eps(self) -> float:
        return self.call().eps

    def stats(self) -> tuple:
        """``(running_mean, running_var)`` this call updates or reads, ``(None, None)`` where none."""
        return self.running_mean, self.running_var

    def eager(self, y: Tensor) -> Tensor:
        """The norm as eager runs it: the module's own call (hooks run), or the row's computation."""
        if self.module_call:
            return self.owner(y)
        return norm_forward(y, self.call(), self.weight, self.bias, *self.stats())

    def __repr__(self) -> str:
        return f"NormView({norm_row(self.row).name}, {type(self.owner).__name__})"
