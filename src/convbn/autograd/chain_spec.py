"""The static description of one layer of a chain and the chain's flat parameter layout.

A :class:`ChainLayerSpec` says, for one forward call, what a layer is: an optional
convolution (none for a pre-activation *head*), an optional BatchNorm (none for an *end*
layer), a single activation (the fast path) or a general tail of element-wise ops, and
whether its conv output is kept (the layer kinds: :class:`convbn.nn.chain_layer.ChainLayer`).

Flat parameter layout of ``ChainFunction.apply(x0, *params, specs, stats)``: per layer,
in order, ``W, b`` (when it has a conv), ``gamma, beta`` (when it has a BN), then one
weight per PReLU of its tail (``None`` for an absent bias or affine parameter).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from torch import Tensor

from ..functional.activations import Activation
from ..functional.batchnorm import BNSpec
from ..functional.conv import ConvSpec
from ..functional.tail import TailOp
from . import chain_memory
from .chain_input import ChainInput
from .chain_tail import n_tail_params

__all__ = ["ChainLayerSpec", "ChainX0", "LayerParams", "param_offsets", "split_params", "layer_kind", "head_input"]

LayerParams = Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor], List[Tensor]]


@dataclass(frozen=True)
class ChainLayerSpec:
    """Static description of one layer of a chain for one forward call."""

    conv: Optional[ConvSpec]
    bn: Optional[BNSpec]
    act: Activation
    keep_y: bool
    tail: Tuple[TailOp, ...] = ()
    #: whether backward may drop this layer's rebuilt input to lower the chain's own peak
    #: (``choose_drops``); the planner clears it where the step peaks elsewhere
    may_drop: bool = True

    def __post_init__(self) -> None:
        if self.conv is None and self.bn is None:
            raise ValueError("a chain layer needs a convolution, a BatchNorm or both")
        if self.tail and not self.act.is_identity:
            raise ValueError(f"a chain layer's tail is act or tail, not both (act={self.act}, tail={self.tail})")

    # (cached: read on every layer of every call; a frozen dataclass keeps them in __dict__)
    @property
    def n_params(self) -> int:
        """Entries this layer takes in the flat parameter list."""
        return 2 * (self.conv is not None) + 2 * (self.bn is not None) + n_tail_params(self.tail)

    @property
    def has_tail(self) -> bool:
        return bool(self.tail) or not self.act.is_identity

    @property
    def needs_y(self) -> bool:
        """Whether backward needs this layer's conv output: not for a head (its BN input is
        ``x0``) nor for an end layer without tail (grad_y is the incoming gradient)."""
        return self.conv is not None and (self.bn is not None or self.has_tail)

    @property
    def saves_y(self) -> bool:
        """Whether forward keeps the conv output (the plan's ``keep_y`` where it is needed)."""
        return self.keep_y and self.needs_y


def param_offsets(specs: Sequence[ChainLayerSpec]) -> List[int]:
    """Index of each layer's first entry in the flat parameter list (and the total, last)."""
    out = [0]
    for s in specs:
        out.append(out[-1] + s.n_params)
    return out


def split_params(spec: ChainLayerSpec, ps: Sequence[Optional[Tensor]]) -> LayerParams:
    """``(W, b, gamma, beta, tail weights)`` of one layer (``None`` where absent)."""
    if len(ps) == 4 and spec.conv is not None and spec.bn is not None:  # an ordinary layer
        return ps[0], ps[1], ps[2], ps[3], []
    it = iter(ps)
    w, b = (next(it), next(it)) if spec.conv is not None else (None, None)
    g, beta = (next(it), next(it)) if spec.bn is not None else (None, None)
    return w, b, g, beta, [t for t in it]  # type: ignore[misc]


def layer_kind(spec: ChainLayerSpec) -> str:
    """The layer's tail kind in :data:`convbn.autograd.chain_memory.ACT_KINDS`."""
    return chain_memory.layer_kind(spec.act, spec.tail)


#: what a chain takes as its input: one tensor, or a head's pieces (Note: [a head over a
#: concatenation] in autograd/chain.py)
ChainX0 = Union[Tensor, ChainInput]


def head_input(x0: ChainX0) -> Tensor:
    """A head's BN input from the chain input ``x0``: ``x0`` itself, or its pieces
    concatenated into a new buffer (Note: [a head over a concatenation] in
    autograd/chain.py). The one place forward and backward build it."""
    return x0.build() if isinstance(x0, ChainInput) else x0
