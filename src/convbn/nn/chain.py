"""``FusedChain``: the module that runs a chain of fused layers found by :func:`convbn.convert`.

The chain does not own its convolutions and BatchNorms: it holds *unregistered*
references to the model's own modules, which stay registered where they were, so the
converted model's ``state_dict()`` keys, parameter objects and ``train()/eval()`` all
behave as before conversion.
"""
from __future__ import annotations

import operator

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from ..autograd.chain import ChainFunction, ChainLayerSpec, chain_forward_no_grad, layer_kind
from ..autograd.chain_compiled import chain_inductor_apply, compile_chains_mode, fusible_by_inductor, quiet_own_advisory
from ..autograd.chain_input import concat_shape
from ..functional.activations import Activation, activation_from_module
from ..functional.batchnorm import BNSpec
from ..functional.conv import ConvSpec, conv_flops, conv_forward, conv_output_shape, conv_spec_from_module, recompute_cost
from ..functional.strategies import LAYER_MODES, LayerMode
from ..functional.conv_bn_call import autocast_dtype, check_inputs
from ..functional.tail import DropoutOp, TailOp, is_tail_module, tail_op_from_module
from .standard_bn import has_standard_bn_forward, standard_batch_norm
from .fused_conv_bn import bn_running_stats, bn_spec_from_module, module_hooked

__all__ = ["ChainLayer", "FusedChain", "LAYER_MODES", "TailElement"]



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
            keeps nothing beyond ``x0``, an end layer without tail nothing at all).
        may_drop: whether backward may drop and rebuild this layer's input to lower its chain's
            peak; the ``auto`` planner clears it where the step peaks elsewhere (dropping
            there would add recompute and lower no peak).
        names: qualified names for reports: ``(conv, bn, *one per tail element)`` (``""``
            where absent).
        y_shape: conv output (BN input) shape seen at the last call (for the planner).
        y_dtype: its dtype.
        x_shape: the layer's input shape at the last call.
        tail: the element-wise ops after the BN, in order (see above).
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
        return None if self.conv_owner is None else getattr(self.conv_owner, self.weight_name)

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
        act, tail = _tail_spec(self)
        return layer_kind(ChainLayerSpec(self.conv, None if self.bn is None else _NO_BN, act, True, tail))

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


class FusedChain(nn.Module):
    """Runs ``layers`` as one autograd Function that keeps only what each layer's plan says for backward.

    Args:
        layers: the chain's layers, input to output.

    Example:
        Built by :func:`convbn.convert`; ``print(model)`` shows each chain's layers and modes.
    """

    def __init__(self, layers: Sequence[ChainLayer]) -> None:
        super().__init__()
        if not layers:
            raise ValueError("a FusedChain needs at least one layer")
        quiet_own_advisory()  # torch's note on the checkpoint region this chain compiles to
        for i, l in enumerate(layers):
            if l.is_head and i != 0:
                raise ValueError(f"only a chain's first layer may have no convolution (a head), but layer {i} has none")
            if l.is_end and i != len(layers) - 1:
                raise ValueError(f"only a chain's last layer may have no BatchNorm (an end), but layer {i} has none")
        # Unregistered on purpose (see module docstring).
        object.__setattr__(self, "layers", list(layers))
        #: called once, on the first training call, with the layers (their shapes then known);
        #: returns one keep flag per layer (``True``: ``recompute_bn``). ``convbn.convert``
        #: attaches its planner here for ``strategy="auto"`` without ``example_inputs``.
        self.plan_on_first_call: Optional[Callable[[Sequence[ChainLayer]], Sequence[bool]]] = None
        #: called once, right after that plan, with the call's input: a reason to run as eager
        #: modules from then on (its fused step peaks above eager's), or ``""``
        self.guard_on_first_call: Optional[Callable[["FusedChain", Sequence[Tensor]], str]] = None
        #: run as eager modules (``convert`` measured the fused step above eager's peak:
        #: Note: [never above eager] in passes/plan/auto_plan.py)
        self.eager = False
        #: why ``eager`` was set (the report says it)
        self.eager_reason = ""
        from ..autograd.chain_op import register_chain

        static = []
        for l in self.layers:
            act, tail = _tail_spec(l, static=True)
            static.append((l.conv, act, None if l.bn is None else float(l.bn.eps), tail))
        #: the structure the compiled path's custom op reads (plain records, no modules): it
        #: travels with the chain (Note: [the chain's structure travels with it])
        self.op_static = tuple(static)
        self.op_key = register_chain(self.op_static)
        # per layer, the model's modules whose own calls this chain replaces (see ``watch``)
        object.__setattr__(self, "watched", [[m for m in (l.bn, *l.tail) if isinstance(m, nn.Module)]
                                             for l in self.layers])

    layers: List[ChainLayer]
    watched: List[List[nn.Module]]

    def __setstate__(self, state: dict) -> None:
        """Unpickling (``torch.load`` of a whole model, ``pickle``, ``copy.deepcopy``): registers
        the chain's structure in this process.

        Note: [the chain's structure travels with it]
        Under ``torch.compile`` the chain runs as a custom op whose static structure (conv
        geometry, activations, eps, tails) is looked up by the string key ``op_key`` in a
        table of this process (Note: [why a custom op under torch.compile]). Unpickling
        skips ``__init__``, so a chain saved in one process and loaded in another would find
        no entry (``KeyError`` at its first compiled call). The structure itself is kept on
        the chain (``op_static``: plain records, no modules, so it unpickles before and
        independently of the model's modules) and registered again here; equal structures
        get equal keys in every process, so the key saved with the chain stays valid.
        """
        super().__setstate__(state)
        from ..autograd.chain_op import register_chain

        static = self.__dict__.get("op_static")
        if static is not None:
            self.op_key = register_chain(static)

    def watch(self, modules: Sequence[Sequence[nn.Module]]) -> None:
        """Per layer, the modules (conv, BatchNorm, activation, tail modules) whose hooks must be honoured.

        A fused chain computes conv, BN and tail without calling those modules, so
        their hooks would be skipped. ``convert`` leaves hooked modules unfused; hooks
        registered *after* conversion are seen here at call time: the chain then runs its
        layers unfused, as eager modules (``_forward_eager``). Global module hooks (tracking
        tools such as ``MemTracker``) see the chain's own call and keep it fused.
        """
        if len(modules) != len(self.layers):
            raise ValueError(f"watch expects one module list per layer ({len(self.layers)}), but got {len(modules)}")
        object.__setattr__(self, "watched", [list(m) for m in modules])

    def _hooked(self) -> bool:
        return module_hooked(*(m for ms in self.watched for m in ms))

    def _forward_eager(self, x: Tensor) -> Tensor:
        """The chain as eager modules: conv modules, BatchNorms and tail modules are *called*
        (hooks run, eager's own checks and bookkeeping apply, dropouts draw from the global
        RNG), activation records applied as eager does."""
        for l, mods in zip(self.layers, self.watched):
            conv = next((m for m in mods if isinstance(m, (_ConvNd, nn.Linear)) and m is l.conv_owner), None)
            if l.conv is None:
                y = x
            elif conv is not None and l.weight_name == "weight" and conv_spec_from_module(conv) == l.conv:
                y = conv(x)
            elif conv is not None and (conv._forward_pre_hooks or conv._forward_hooks or conv._backward_hooks):
                raise RuntimeError(
                    f"{l.names[0]} has hooks but its padding was merged into the fused chain, so they cannot "
                    "run as in eager; register the hooks before convbn.convert (it then leaves the layer unfused)"
                )
            else:
                w, b, dt = l.weight, l.bias, autocast_dtype(x)
                if dt is not None:  # as autocast casts a conv module's operands
                    x, w, b = x.to(dt), w.to(dt), (None if b is None else b.to(dt))  # type: ignore[union-attr]
                y = conv_forward(l.conv.pad_input(x), w, b, l.conv)  # type: ignore[arg-type]
            # a norm-act module's own forward would apply its tail again: its batch norm only
            z = y if l.bn is None else l.bn(y) if has_standard_bn_forward(l.bn) else standard_batch_norm(l.bn, y)
            if l.tail:
                for e in l.tail:
                    z = e(z)
                x = z
                continue
            in_tail = (l.bn, conv)
            act = next((m for m in mods if all(m is not t for t in in_tail)), None)
            x = act(z) if act is not None else l.act(z)
        return x

    def _linear_on_other_shape(self, input: Tensor) -> bool:
        """Whether a linear layer of the chain gets an input other than ``(N, C)``.

        ``nn.Linear`` maps the last dimension of any input, but a BatchNorm1d after it
        normalises those features only on ``(N, C)``: on ``(N, L, C)`` it would normalise
        over ``L``, another computation, which the chain then runs as eager does.
        """
        convs = [l.conv for l in self.layers if l.conv is not None]
        return any(c.is_linear for c in convs) and any(c.dims + 2 != input.dim() for c in convs)

    def forward(self, *inputs: Tensor) -> Tensor:
        """Run the chain on its input: one tensor, or (a head chain) the pieces of its input,
        concatenated along dim 1 as ``torch.cat(inputs, 1)`` would (the chain keeps the pieces,
        not the concatenation)."""
        pieces = _check_pieces(inputs, self.layers[0])
        input = pieces[0] if len(pieces) == 1 else _stand_in(pieces)
        if input.numel() == 0 or self.eager or self._hooked() or self._linear_on_other_shape(input):
            return self._forward_eager(_concat(pieces))
        # The chain reads a layer's weight several times (checks, planning, the Function);
        # eager's conv reads it once. Under ``parametrize.cached()`` a parametrization (e.g.
        # spectral_norm's power iteration, which updates its buffers) runs once per call too.
        with parametrize.cached():
            return self._forward_fused(pieces, input)

    def _forward_fused(self, pieces: Sequence[Tensor], input: Tensor) -> Tensor:
        """``input``: the one piece, or a stand-in with the concatenation's shape for the checks."""
        layers = self.layers
        first = layers[0]
        tails = [_tail_spec(l) for l in layers]
        dropout = any(isinstance(op, DropoutOp) for _, t in tails for op in t)
        dt = autocast_dtype(input)  # autocast: every conv's operands cast as eager autocast would
        if (dt is not None and first.is_head) or (dropout and torch.compiler.is_compiling()):
            # A head's BN runs on the un-cast input under autocast; a dropout's RNG replay is
            # not reproduced by a compiled graph (Note: [why a custom op under torch.compile]).
            return self._forward_eager(_concat(pieces))
        stats = [bn_running_stats(l.bn) if l.bn is not None else (None, None) for l in layers]
        specs0 = [bn_spec_from_module(l.bn) if l.bn is not None else None for l in layers]
        # Check every layer before any running statistic moves (a failing call changes nothing).
        compute_dtype = dt or input.dtype  # what the conv outputs will be
        shape: Sequence[int] = input.shape
        if first.is_head:
            _check_head_input(input, first, stats[0])
            if len(layers) > 1 and layers[1].conv is not None:
                second = layers[1]
                check_inputs(input, second.weight, second.conv, specs0[1] or _NO_BN,  # type: ignore[arg-type]
                             (second.bias, *second.tail_params(), *_bn_tensors(second)))
        else:
            check_inputs(input, first.weight, first.conv, specs0[0] or _NO_BN,  # type: ignore[arg-type]
                         (first.bias, *first.tail_params(), *_bn_tensors(first)))
        for l, spec in zip(layers, specs0):
            l.x_shape = tuple(shape)
            if l.conv is not None:
                shape = conv_output_shape(shape, l.weight.shape, l.conv)  # type: ignore[union-attr]
                if any(s <= 0 for s in shape[2:]):
                    raise RuntimeError(f"input of shape {tuple(input.shape)} is too small for {l.names[0]}: output {tuple(shape)}")
            if spec is not None and spec.batch_stats and spec.process_group is None and shape[0] * _prod(shape[2:]) == 1:
                raise ValueError(
                    f"Expected more than 1 value per channel when training, got input size {torch.Size(shape)} at {l.names[1]}"
                )
            l.y_shape, l.y_dtype = tuple(shape), compute_dtype if l.conv is not None else input.dtype
        if self.plan_on_first_call is not None and torch.is_grad_enabled():
            # Note: [planning on concrete sizes]
            # Under torch.compile with dynamic shapes (Dynamo marks sizes dynamic once any
            # compiled chain saw two shapes) the sizes are SymInts, and the planner's sorting
            # and knapsack cannot run on them. The plan is for this call's sizes anyway:
            # reading them as ints specialises only the graph that plans (the first call).
            # ``operator.index`` specialises under Dynamo; ``int()`` stays symbolic there.
            for l in layers:
                l.x_shape = tuple(operator.index(s) for s in l.x_shape)
                l.y_shape = tuple(operator.index(s) for s in l.y_shape)
            keeps = list(self.plan_on_first_call(layers))
            if len(keeps) != len(layers):
                raise ValueError(f"plan_on_first_call returned {len(keeps)} flags for {len(layers)} layers")
            for l, k in zip(layers, keeps):
                l.mode = "recompute_bn" if k else "recompute_conv"
            self.plan_on_first_call = None
            guard, self.guard_on_first_call = getattr(self, "guard_on_first_call", None), None
            if guard is not None and dt is None and not torch.compiler.is_compiling():
                why = guard(self, pieces)
                if why:  # Note: [never above eager, without example inputs] in passes/plan/first_call_peak.py
                    self.eager, self.eager_reason = True, why
                    return self._forward_eager(_concat(pieces))
        bn_specs = [bn_spec_from_module(l.bn, advance=True) if l.bn is not None else None for l in layers]
        x = pieces[0] if dt is None else pieces[0].to(dt)  # one piece unless a head (never cast)
        params: List[Optional[Tensor]] = []
        for l in layers:
            if l.conv is not None:
                w, b = l.weight, l.bias
                if dt is not None:
                    w, b = w.to(dt), (None if b is None else b.to(dt))  # type: ignore[union-attr]
                params += [w, b]
            if l.bn is not None:
                params += [l.bn.weight, l.bn.bias]
            # autocast runs prelu in the lower precision too: its weight is cast like a conv's
            params += l.tail_params() if dt is None else [t.to(dt) for t in l.tail_params()]
        dev = input.device.type
        specs = tuple(
            ChainLayerSpec(l.conv, bs, act, l.mode != "recompute_conv", tail, l.may_drop)
            for l, bs, (act, tail) in zip(layers, bn_specs, tails)
        )
        with torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else nullcontext():
            if first.conv is not None:
                x = first.conv.pad_input(x)
            xs = [x] if len(pieces) == 1 else list(pieces)
            if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*xs, *params))):
                return chain_forward_no_grad(_concat(xs), params, specs, stats)
            if torch.compiler.is_compiling() and not any(s.bn is not None and s.bn.process_group is not None
                                                         for s in specs):
                if len(xs) == 1 and compile_chains_mode() == "inductor" and fusible_by_inductor(specs):
                    return chain_inductor_apply(x, params, specs, stats)  # Note: [a chain inductor can see into]
                from ..autograd.chain_op import chain_op_apply  # Note: [why a custom op under torch.compile]

                return chain_op_apply(self.op_key, xs if len(xs) > 1 else x, params, specs, stats)
            if len(xs) > 1:
                return ChainFunction.apply(*xs, *params, specs, tuple(stats), len(xs))
            return ChainFunction.apply(x, *params, specs, tuple(stats))

    def extra_repr(self) -> str:
        rows = []
        for i, l in enumerate(self.layers):
            tail = " -> ".join(str(e) if isinstance(e, Activation) else type(e).__name__ for e in l.tail) or str(l.act)
            parts = [p for p in (l.names[0], l.names[1] if l.bn is not None else "", tail) if p]
            kind = " (head)" if l.is_head else " (end)" if l.is_end else ""
            rows.append(f"({i}) {' -> '.join(parts)}: {l.mode}{kind}")
        return "\n".join(rows)


def _check_pieces(inputs: Sequence[Tensor], first: ChainLayer) -> List[Tensor]:
    """The chain's input as a list of pieces; several only for a head chain."""
    if not inputs:
        raise TypeError("FusedChain.forward() needs an input tensor (or, for a head chain, its pieces)")
    for t in inputs:
        if not isinstance(t, Tensor):
            raise TypeError(f"input must be a Tensor, but got {type(t).__name__}")
    if len(inputs) > 1:
        if not first.is_head:
            raise ValueError(
                f"only a chain that starts with a BatchNorm (a head) takes its input as pieces, but got "
                f"{len(inputs)} tensors for a chain that starts with {first.names[0] or 'a convolution'}"
            )
        concat_shape(inputs)  # raises for pieces torch.cat would reject
        dtypes = {t.dtype for t in inputs}
        devices = {t.device for t in inputs}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"the pieces of a chain input must share one dtype and device, but got dtypes "
                             f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}")
    return list(inputs)


def _stand_in(pieces: Sequence[Tensor]) -> Tensor:
    """A zero-stride tensor with the concatenation's shape, dtype and device, for the input checks."""
    first = pieces[0]
    return torch.empty((), dtype=first.dtype, device=first.device).expand(concat_shape(pieces))


def _concat(pieces: Sequence[Tensor]) -> Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces), 1)


#: stands in for a missing BN in input checks (an end layer normalises nothing)
_NO_BN = BNSpec(1e-5, False, 0.0)


def _bn_tensors(l: ChainLayer) -> List[Optional[Tensor]]:
    if l.bn is None:
        return []
    return [l.bn.weight, l.bn.bias, *bn_running_stats(l.bn)]


def _check_head_input(x: Tensor, head: ChainLayer, stats: Tuple[Optional[Tensor], Optional[Tensor]]) -> None:
    """The checks eager's BatchNorm makes on a head's input (it is the chain input)."""
    bn = head.bn
    assert bn is not None  # a head has a BN (ChainLayer checks it)
    if not isinstance(x, Tensor):
        raise TypeError(f"input must be a Tensor, but got {type(x).__name__}")
    bn._check_input_dim(x)  # type: ignore[operator]  # eager's own rank check and message
    if x.shape[1] != bn.num_features:
        raise RuntimeError(
            f"expected input of shape {tuple(x.shape)} to have {bn.num_features} channels for {head.names[1] or 'the BatchNorm'}, "
            f"but got {x.shape[1]} channels instead"
        )
    for t in (bn.weight, bn.bias, *stats, *head.tail_params()):
        if t is not None and t.device != x.device:
            raise RuntimeError(
                f"input is on {x.device} but a weight/buffer is on {t.device}; move the module with "
                f".to({x.device}) or the input with .to({t.device})"
            )


def _tail_spec(l: ChainLayer, static: bool = False) -> Tuple[Activation, Tuple[TailOp, ...]]:
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
