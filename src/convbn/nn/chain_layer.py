"""``ChainLayer``: one fused layer of a :class:`~convbn.nn.chain.FusedChain` (``conv -> BN -> tail``).

A record of the model's own modules (read at every call) and of the shapes the layer saw
at its last call, which the planner reads; what the layer keeps is its chain's plan
(``FusedChain.plan``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..autograd.chain import ChainLayerSpec, layer_kind
from ..functional.activations import Activation, activation_from_module
from ..functional.batchnorm import BNSpec
from ..functional.conv import ConvSpec, conv_flops, recompute_cost
from ..functional.strategies import LAYER_MODES, LayerMode
from ..functional.tail import TailOp, is_tail_module, tail_op_from_module
from .computed_weight import ComputedWeight

__all__ = ["ChainLayer", "TailElement", "tail_spec", "NO_BN"]

#: the attributes of a layer its chain's plan owns once the layer is in a chain
_PLANNED = ("mode", "may_drop")

#: stands in for a missing BN in input checks (an end layer normalises nothing)
NO_BN = BNSpec(1e-5, False, 0.0)


#: one element of a layer's tail: an activation record, or the model's own module
#: (an activation module, ``nn.PReLU``, a dropout module), read at every call
TailElement = Union[Activation, nn.Module]


@dataclass
class ChainLayer:
    """One fused layer inside a :class:`FusedChain`: ``conv -> BN -> tail``.

    A layer is an optional convolution, an optional BatchNorm and a *tail*: any sequence
    of element-wise ops after the BN (activations, PReLU, dropout), recomputed in
    backward. Three kinds of layer:

    * an ordinary layer ``conv -> BN -> tail``;
    * a *head* (pre-activation, layer 0 only): no convolution, ``BN -> tail``: its BN input
      is the chain input ``x0`` itself (always kept), and the next conv's input is rebuilt
      element-wise from ``x0`` in backward;
    * an *end* (last layer only): a convolution with no BN, optionally a tail: the chain
      ends at a conv output.

    A PreAct-ResNet body ``BN1 -> ReLU -> conv1 -> BN2 -> ReLU -> conv2`` is one chain
    ``[head(BN1, relu), (conv1, BN2, relu), (conv2, no BN)]``. A head chain may be called
    with several tensors, the *pieces* of its input concatenated along dim 1 (a DenseNet
    layer's earlier feature maps): it keeps the pieces, never their concatenation, and
    rebuilds the concatenation in backward.

    The tail is ``tail`` when given, else ``(act,)``: a single activation is the fast path
    (in-place buffers in backward) and is normalised into ``act`` (give one of the two,
    not both). Modules in the tail are the model's own (``nn.ReLU``, ``nn.PReLU``,
    ``nn.Dropout`` ...): their ``training`` flag, ``p`` and weights are read at every call,
    like the BatchNorm's (a dropout in eval mode or with ``p == 0`` is an identity).

    Attributes:
        conv_owner: module holding the conv weight (and bias) as attributes; ``None`` for a head.
        weight_name, bias_name: attribute names (``bias_name`` ``None`` without bias).
        conv: the convolution's geometry; ``None`` for a head.
        bn: the BatchNorm module (read at every call: mode, momentum, running stats);
            ``None`` for an end layer.
        act: the fused activation when the tail is one activation (identity otherwise).
        mode: ``"recompute_bn"`` or ``"recompute_conv"`` (what an ordinary layer keeps; a head
            keeps nothing beyond ``x0``, an end layer without tail nothing at all): the plan
            a chain built from the layer starts with; after that a record of the chain's
            plan (``FusedChain.plan``, changed only by ``FusedChain.apply_plan``).
        may_drop: whether backward may drop and rebuild this layer's input to lower its chain's
            peak; the ``auto`` planner clears it where the step peaks elsewhere (dropping
            there would add recompute and lower no peak). Like ``mode``, the chain's plan
            after the chain is built.
        names: qualified names for reports: ``(conv, bn, *one per tail element)`` (``""``
            where absent).
        y_shape: conv output (BN input) shape seen at the last call (for the planner).
        y_dtype: its dtype.
        x_shape: the layer's input shape at the last call.
        tail: the element-wise ops after the BN, in order (see above).
        computed: the model's own computation of the conv weight from its parameters / buffers
            (weight standardisation: :mod:`convbn.nn.computed_weight`), run where the layer reads
            its weight; ``None``: the weight is ``conv_owner``'s ``weight_name``.
    """

    conv_owner: Optional[nn.Module] = None
    weight_name: str = "weight"
    bias_name: Optional[str] = None
    conv: Optional[ConvSpec] = None
    bn: Optional[_BatchNorm] = None
    act: Activation = Activation("identity")
    mode: LayerMode = "recompute_bn"
    may_drop: bool = True
    names: Tuple[str, ...] = ("", "", "")
    y_shape: Optional[Tuple[int, ...]] = None
    y_dtype: Optional[torch.dtype] = None
    x_shape: Optional[Tuple[int, ...]] = field(default=None)
    tail: Tuple[TailElement, ...] = ()
    computed: Optional[ComputedWeight] = None

    def __post_init__(self) -> None:
        if (self.conv is None) != (self.conv_owner is None):
            raise ValueError("a ChainLayer has both conv and conv_owner (an ordinary or end layer) or neither (a head)")
        if self.conv is None and self.bn is None:
            raise ValueError("a ChainLayer needs a convolution, a BatchNorm or both, but got neither")
        if self.mode not in LAYER_MODES:
            raise ValueError(f"mode must be one of {LAYER_MODES}, but got mode={self.mode!r}")
        tail = tuple(self.tail)
        if tail and not self.act.is_identity:
            raise ValueError(f"give the layer's activation as act or inside tail, not both (act={self.act}, tail={tail})")
        for e in tail:
            if not isinstance(e, Activation) and not (isinstance(e, nn.Module) and is_tail_module(e)):
                raise TypeError(
                    f"a tail element must be an Activation, an nn activation module, nn.PReLU or a dropout module, "
                    f"but got {type(e).__name__}"
                )
        if len(tail) == 1 and isinstance(tail[0], Activation):
            self.act, tail = tail[0], ()  # the single-activation fast path
        self.tail = tail

    def __setattr__(self, name: str, value: object) -> None:
        if name in _PLANNED and self.__dict__.get("_in_chain", False):
            raise AttributeError(
                f"{name} of a layer inside a FusedChain is the chain's plan: give the chain a new plan with "
                f"FusedChain.apply_plan (convbn.autograd.chain_plan.ChainPlan), not {name}={value!r}")
        object.__setattr__(self, name, value)

    def record_plan(self, mode: str, may_drop: bool) -> None:
        """Record its chain's plan for this layer (``FusedChain.apply_plan`` only); from then on
        ``mode`` and ``may_drop`` change only this way."""
        # object.__setattr__, not self.__dict__.update: Dynamo of torch 2.5 - 2.8 traces only
        # the former when a lazy plan settles on the first compiled call
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "may_drop", may_drop)
        object.__setattr__(self, "_in_chain", True)

    @property
    def is_head(self) -> bool:
        """No convolution: the BN reads the chain input (layer 0 only)."""
        return self.conv is None

    @property
    def is_end(self) -> bool:
        """No BatchNorm: the chain ends at this conv's output (last layer only)."""
        return self.bn is None

    @property
    def elements(self) -> Tuple[TailElement, ...]:
        """The tail as given: ``tail``, or ``(act,)`` (empty for identity)."""
        return self.tail if self.tail else (() if self.act.is_identity else (self.act,))

    @property
    def weight(self) -> Optional[Tensor]:
        if self.conv_owner is None:
            return None
        if self.computed is not None:  # Note: [a computed weight is read once per call]
            return self.computed()
        return getattr(self.conv_owner, self.weight_name)

    @property
    def bias(self) -> Optional[Tensor]:
        return None if self.bias_name is None or self.conv_owner is None else getattr(self.conv_owner, self.bias_name)

    def tail_params(self) -> List[Tensor]:
        """The tail's parameters in order (each ``nn.PReLU``'s weight), read now."""
        return [e.weight for e in self.tail if isinstance(e, nn.PReLU)]

    def y_bytes(self) -> int:
        """Bytes of the conv output (BN input) at the last call (0 before any call)."""
        return _nbytes(self.y_shape, self.y_dtype)

    def x_bytes(self) -> int:
        """Bytes of the layer's input at the last call, in the dtype the chain computes in
        (0 before any call)."""
        return _nbytes(self.x_shape, self.y_dtype)

    def keep_bytes(self) -> int:
        """Bytes this layer keeps for backward in ``recompute_bn`` mode beyond the floor: its
        conv output, except for a head (its BN input is ``x0``, always kept) and an end layer
        without tail (its backward needs no conv output)."""
        if self.is_head or (self.is_end and not self.elements):
            return 0
        return self.y_bytes()

    def tail_kind(self) -> str:
        """The tail's kind, as the planner's memory replay of the chain's backward classifies it, now."""
        act, tail = tail_spec(self)
        return layer_kind(ChainLayerSpec(self.conv, None if self.bn is None else NO_BN, act, True, tail))

    def parameters(self) -> List[Tensor]:
        """The layer's parameters as the chain reads them now: conv weight and bias, BN weight
        and bias, the tail's (``None`` entries left out)."""
        ts = [self.weight, self.bias, *(() if self.bn is None else (self.bn.weight, self.bn.bias)), *self.tail_params()]
        return [t for t in ts if t is not None]

    def flops(self) -> int:
        """Multiply-accumulates of the conv at the last call (0 for a head)."""
        w = self.weight
        if self.y_shape is None or w is None:
            return 0
        return conv_flops(self.y_shape, w.shape, self.conv, self.x_shape)  # type: ignore[arg-type]

    def recompute_cost(self) -> int:
        """What running the conv again costs, in MAC equivalents (its multiply-accumulates plus
        a cost per byte it reads and writes and per call): the planner's measure; 0 for a head."""
        return recompute_cost(self.flops(), self.x_bytes(), self.y_bytes())


def tail_spec(l: ChainLayer, static: bool = False) -> Tuple[Activation, Tuple[TailOp, ...]]:
    """The layer's tail for this call as ``(act, tail)``: a lone activation takes the fast path
    (``act``), anything else is a general tail; identities (eval / ``p == 0`` dropouts) drop out.
    ``static``: the structure registered for the compiled path (every dropout left out)."""
    ops: List[TailOp] = []
    for e in l.elements:
        if static and isinstance(e, nn.Module) and not isinstance(e, nn.PReLU) and activation_from_module(e) is None:
            continue  # a dropout: the compiled path only runs chains whose dropouts are identities
        op = tail_op_from_module(e)
        if op is not None:
            ops.append(op)
    if not ops:
        return Activation("identity"), ()
    if len(ops) == 1 and isinstance(ops[0], Activation):
        return ops[0], ()
    return Activation("identity"), tuple(ops)


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for s in xs:
        n *= s
    return n


def _nbytes(shape: Optional[Sequence[int]], dtype: Optional[torch.dtype]) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype`` (0 while either is unknown)."""
    if shape is None or dtype is None:
        return 0
    return _prod(shape) * torch.empty((), dtype=dtype).element_size()
