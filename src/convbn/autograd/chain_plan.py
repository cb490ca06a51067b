"""A chain's plan as a value: what each layer keeps for backward, decided once.

A :class:`ChainPlan` is frozen: per layer whether its conv output is kept (``recompute_bn``)
or recomputed (``recompute_conv``) and whether backward may drop and rebuild its input
(``may_drop``), and for the whole chain whether it runs as eager modules (and why). The
planner (``convbn.passes.plan``) makes one per chain and the chain takes it whole
(``FusedChain.apply_plan``); every execution path (the autograd Function, the custom op
under ``torch.compile``, the inductor region) reads it through the layer specs
:meth:`ChainPlan.specs` builds, so no path can keep a flag of its own.

A :class:`LazyPlan` is the plan of a chain converted without ``example_inputs``: it is
resolved into a :class:`ChainPlan` on the chain's first training call, when the layers
know their shapes (Note: [planning on concrete sizes] in nn/chain.py).

# Note: [a chain's plan is a value]
# The plan used to be flags written into the layers from several places (the planner's
# glue, the chain's first call, the eager fallback), and each execution path rebuilt the
# layer specs from them: the custom op once rebuilt them without ``may_drop``, so under
# ``torch.compile`` a planned ``may_drop=False`` silently reverted to ``True``. Now a plan
# is made whole, in one place (``passes/plan/chain_plans.py::chain_plan``), taken whole
# (``FusedChain.apply_plan``), and read whole: :meth:`ChainPlan.specs` is the only place a
# call's layer specs get ``keep_y`` and ``may_drop``, and every path runs those specs. The
# layers' ``mode`` / ``may_drop`` attributes are the plan's record for reports.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from ..functional.activations import Activation
from ..functional.batchnorm import BNSpec
from ..functional.conv import ConvSpec
from ..functional.strategies import LAYER_MODES
from ..functional.tail import TailOp
from .chain_spec import ChainLayerSpec

__all__ = ["ChainPlan", "LazyPlan", "KEEP", "RECOMPUTE"]

#: the mode of a layer that keeps its conv output (element-wise recompute only)
KEEP = "recompute_bn"
#: the mode of a layer that keeps nothing and recomputes its convolution in backward
RECOMPUTE = "recompute_conv"


@dataclass(frozen=True)
class ChainPlan:
    """What one chain keeps, layer by layer, and whether it runs fused at all.

    Attributes:
        keep: per layer, ``True`` where the conv output is kept (``recompute_bn``),
            ``False`` where it is recomputed (``recompute_conv``).
        may_drop: per layer, whether backward may drop this layer's rebuilt input to lower
            its chain's own peak (the ``auto`` planner clears it where the step peaks
            elsewhere: Note: [drops only where the step peaks] in passes/plan/peak_model.py).
        eager_reason: non-empty where the chain runs as eager modules (Note: [never above
            eager] in passes/plan/auto_plan.py): the reason the report shows.

    Example:
        >>> ChainPlan.of_modes(["recompute_bn", "recompute_conv"]).keep
        (True, False)
    """

    keep: Tuple[bool, ...]
    may_drop: Tuple[bool, ...]
    eager_reason: str = ""

    def __post_init__(self) -> None:
        if len(self.keep) != len(self.may_drop):
            raise ValueError(f"a ChainPlan has one may_drop flag per layer ({len(self.keep)}), "
                             f"but got {len(self.may_drop)}")

    @classmethod
    def of_modes(cls, modes: Sequence[str], may_drop: Sequence[bool] = ()) -> "ChainPlan":
        """The plan of layers given as modes (``"recompute_bn"`` / ``"recompute_conv"``);
        ``may_drop`` per layer, every layer by default."""
        for m in modes:
            if m not in LAYER_MODES:
                raise ValueError(f"mode must be one of {LAYER_MODES}, but got mode={m!r}")
        drops = tuple(bool(d) for d in may_drop) if may_drop else (True,) * len(modes)
        return cls(tuple(m == KEEP for m in modes), drops)

    @property
    def eager(self) -> bool:
        """Whether the chain runs as eager modules."""
        return bool(self.eager_reason)

    @property
    def modes(self) -> Tuple[str, ...]:
        """Per layer, ``"recompute_bn"`` (kept) or ``"recompute_conv"`` (recomputed)."""
        return tuple(KEEP if k else RECOMPUTE for k in self.keep)

    def running_eager(self, reason: str) -> "ChainPlan":
        """This plan with the chain running as eager modules for ``reason``."""
        return dataclasses.replace(self, eager_reason=reason)

    def specs(self, convs: Sequence[Optional[ConvSpec]], bns: Sequence[Optional[BNSpec]],
              tails: Sequence[Tuple[Activation, Tuple[TailOp, ...]]]) -> Tuple[ChainLayerSpec, ...]:
        """The layer specs of one call: this plan's ``keep`` and ``may_drop`` with the call's
        convolutions, BatchNorm specs and tails (one of each per layer)."""
        if not len(convs) == len(bns) == len(tails) == len(self.keep):
            raise ValueError(f"ChainPlan.specs expects one conv, BatchNorm and tail per layer ({len(self.keep)}), "
                             f"but got {len(convs)}, {len(bns)} and {len(tails)}")
        return tuple(ChainLayerSpec(c, b, act, k, tail, d)
                     for c, b, (act, tail), k, d in zip(convs, bns, tails, self.keep, self.may_drop))


@dataclass(frozen=True)
class LazyPlan:
    """A plan decided on the chain's first training call (``convert`` without ``example_inputs``).

    Attributes:
        until: the plan that runs until then (calls without gradients, ``torch.no_grad``).
        decide: called once with the chain's layers (their shapes recorded by that call);
            returns the chain's :class:`ChainPlan`.
        guard: called once right after, with the chain and the call's input pieces: a reason
            to run as eager modules from then on (its fused step peaks above eager's), or
            ``""``; ``None``: no guard.
    """

    until: ChainPlan
    decide: Callable[[Sequence[Any]], ChainPlan]
    guard: Optional[Callable[[Any, Sequence[Any]], str]] = None

    @property
    def eager(self) -> bool:
        """A lazy plan runs fused until it is resolved."""
        return False

    @property
    def eager_reason(self) -> str:
        return ""

    @property
    def keep(self) -> Tuple[bool, ...]:
        return self.until.keep

    @property
    def may_drop(self) -> Tuple[bool, ...]:
        return self.until.may_drop

    @property
    def modes(self) -> Tuple[str, ...]:
        return self.until.modes

    def running_eager(self, reason: str) -> ChainPlan:
        """The chain running as eager modules for ``reason``, never planned."""
        return self.until.running_eager(reason)

    def specs(self, convs: Sequence[Optional[ConvSpec]], bns: Sequence[Optional[BNSpec]],
              tails: Sequence[Tuple[Activation, Tuple[TailOp, ...]]]) -> Tuple[ChainLayerSpec, ...]:
        """:meth:`ChainPlan.specs` of the plan that runs until the lazy one is resolved."""
        return self.until.specs(convs, bns, tails)
