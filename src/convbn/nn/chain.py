"""``FusedChain``: the module that runs a chain of fused layers found by :func:`convbn.convert`.

Its layers are :class:`~convbn.nn.chain_layer.ChainLayer` records (re-exported here); its plan
is one value (:mod:`convbn.autograd.chain_plan`); a call is checked here and run by
:func:`convbn.autograd.chain_run.run_chain`.

The chain does not own its convolutions and BatchNorms: it holds *unregistered*
references to the model's own modules, which stay registered where they were, so the
converted model's ``state_dict()`` keys, parameter objects and ``train()/eval()`` all
behave as before conversion.
"""
from __future__ import annotations

import math
import operator
from contextlib import nullcontext
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.modules.conv import _ConvNd

from ..autograd.chain_compiled import quiet_own_advisory
from ..autograd.chain_plan import ChainPlan, LazyPlan
from ..autograd.chain_run import run_chain
from ..autograd.chain_structure import ChainStructure, register_chain
from ..autograd.chain_input import concat_shape
from ..functional.activations import Activation
from ..functional.conv import conv_forward, conv_output_shape, conv_spec_from_module
from ..functional.strategies import LAYER_MODES
from ..functional.conv_bn_call import autocast_dtype, check_inputs
from ..functional.tail import DropoutOp
from .standard_bn import has_standard_bn_forward, standard_batch_norm
from .chain_layer import NO_BN, ChainLayer, TailElement, tail_spec
from .computed_weight import computed_weights_cached
from .fused_conv_bn import bn_running_stats, bn_spec_from_module, module_hooked

__all__ = ["ChainLayer", "FusedChain", "LAYER_MODES", "TailElement"]



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
            if l.is_end and i != len(layers) - 1 and not (self._ends_inside and l.elements):
                raise ValueError(f"only a chain's last layer may have no BatchNorm (an end), but layer {i} has none")
        # Unregistered on purpose (see module docstring).
        object.__setattr__(self, "layers", list(layers))
        #: the chain's plan, a frozen value (Note: [a chain's plan is a value] in
        #: autograd/chain_plan.py): as its layers were built until :meth:`apply_plan` replaces it
        self.plan: Union[ChainPlan, LazyPlan] = ChainPlan.of_modes([l.mode for l in layers],
                                                                   [l.may_drop for l in layers])
        for l in self.layers:
            l.record_plan(l.mode, l.may_drop)
        #: the structure the compiled path's custom op reads (plain records, no modules), owned
        #: here: it travels with the chain (Note: [the chain's structure travels with it])
        static = []
        for l in self.layers:
            act, tail = tail_spec(l, static=True)
            # an eps of None: F.rms_norm's own (the input dtype's), a per-sample norm's call carries it
            static.append((l.conv, act, None if l.bn is None or l.bn.eps is None else float(l.bn.eps), tail))
        self.op_structure = register_chain(static)
        # per layer, the model's modules whose own calls this chain replaces (see ``watch``)
        object.__setattr__(self, "watched", [[m for m in (l.bn, *l.tail) if isinstance(m, nn.Module)]
                                             for l in self.layers])

    #: whether a layer with no norm but a tail may sit inside the chain (per-sample norm chains:
    #: Note: [conv -> act layers inside a per-sample chain] in passes/convert/match.py)
    _ends_inside = False
    layers: List[ChainLayer]
    watched: List[List[nn.Module]]
    op_structure: ChainStructure

    @property
    def op_key(self) -> str:
        """The key the custom op finds this chain's structure by."""
        return self.op_structure.key

    @property
    def eager(self) -> bool:
        """Whether the chain runs as eager modules: its plan says so (``convert`` measured its fused
        step above eager's peak)."""
        return self.plan.eager

    @property
    def eager_reason(self) -> str:
        """Why the chain runs as eager modules (the report says it), or ``""``."""
        return self.plan.eager_reason

    @property
    def plan_on_first_call(self) -> Optional[Callable[[Sequence[ChainLayer]], ChainPlan]]:
        """What decides the plan on the first training call (a :class:`LazyPlan`), or ``None``."""
        return self.plan.decide if isinstance(self.plan, LazyPlan) else None

    def apply_plan(self, plan: Union[ChainPlan, LazyPlan]) -> None:
        """Take ``plan`` whole: every call reads it (the layer specs, whether to run eager). The
        layers' ``mode`` / ``may_drop`` records follow it, for reports.

        Args:
            plan: one entry per layer.
        """
        if len(plan.keep) != len(self.layers):
            raise ValueError(f"a plan for {len(plan.keep)} layers cannot apply to a chain of {len(self.layers)}")
        self.plan = plan
        for l, mode, drop in zip(self.layers, plan.modes, plan.may_drop):
            l.record_plan(mode, drop)

    def __setstate__(self, state: dict) -> None:
        """Unpickling (``torch.load`` of a whole model, ``pickle``, ``copy.deepcopy``): registers
        the chain's structure in this process.

        Note: [the chain's structure travels with it]
        Under ``torch.compile`` the chain runs as a custom op whose static structure (conv
        geometry, activations, eps, tails) is found by the string key ``op_key``
        (Note: [why a custom op under torch.compile]) in a table holding each structure
        only while a chain owns it (autograd/chain_structure.py). Unpickling skips
        ``__init__``, so a chain saved in one process and loaded in another would find
        no entry (``KeyError`` at its first compiled call). The structure itself is kept on
        the chain (``op_structure``: plain records, no modules, so it unpickles before and
        independently of the model's modules) and registered again here; equal structures
        get equal keys in every process, so the key saved with the chain stays valid.
        """
        super().__setstate__(state)
        structure = self.__dict__.get("op_structure")
        static = structure.layers if structure is not None else self.__dict__.pop("op_static", None)
        if static is not None:
            self.op_structure = register_chain(static)
        if "plan" not in self.__dict__:  # saved before chains held their plan as a value
            plan = ChainPlan.of_modes([l.mode for l in self.layers], [l.may_drop for l in self.layers])
            eager, why = self.__dict__.pop("eager", False), self.__dict__.pop("eager_reason", "")
            self.plan = plan.running_eager(why or "its layers run as eager modules") if eager else plan
            for old in ("op_key", "plan_on_first_call", "guard_on_first_call"):
                self.__dict__.pop(old, None)

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

    def compile_caveat(self) -> str:
        """Why, under ``torch.compile``, this chain runs its layers as eager modules although it
        runs fused outside it, or ``""``; the report prints it beside the layer."""
        return ""

    def _forward_eager(self, x: Tensor) -> Tensor:
        """The chain as eager modules: conv modules, BatchNorms and tail modules are *called*
        (hooks run, eager's own checks and bookkeeping apply, dropouts draw from the global
        RNG), activation records applied as eager does."""
        for l, mods in zip(self.layers, self.watched):
            conv = next((m for m in mods if isinstance(m, (_ConvNd, nn.Linear)) and m is l.conv_owner), None)
            if l.conv is None:
                y = x
            elif (conv is not None and l.computed is None and l.weight_name == "weight"
                  and conv_spec_from_module(conv) == l.conv):
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
            z = y if l.bn is None else self._normalise(l, y)
            if l.tail:
                for e in l.tail:
                    z = e(z)
                x = z
                continue
            in_tail = (*self._norm_modules(l), conv)
            act = next((m for m in mods if all(m is not t for t in in_tail)), None)
            x = act(z) if act is not None else l.act(z)
        return x

    def _normalise(self, l: ChainLayer, y: Tensor) -> Tensor:
        """Layer ``l``'s norm as eager runs it (``_forward_eager``): a norm-act module's own
        forward would apply its tail again, so its batch norm only."""
        return l.bn(y) if has_standard_bn_forward(l.bn) else standard_batch_norm(l.bn, y)  # type: ignore[arg-type]

    def _norm_modules(self, l: ChainLayer) -> Tuple[object, ...]:
        """What stands for layer ``l``'s norm among its watched modules (not its activation)."""
        return (l.bn,)

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
        # spectral_norm's power iteration, which updates its buffers) runs once per call too, and
        # so does a weight computed from the model's parameters (Note: [a computed weight is
        # read once per call] in nn/computed_weight.py).
        with parametrize.cached(), computed_weights_cached():
            return self._forward_fused(pieces, input)

    def _forward_fused(self, pieces: Sequence[Tensor], input: Tensor) -> Tensor:
        """``input``: the one piece, or a stand-in with the concatenation's shape for the checks."""
        layers = self.layers
        tails = [tail_spec(l) for l in layers]
        dropout = any(isinstance(op, DropoutOp) for _, t in tails for op in t)
        dt = autocast_dtype(input)  # autocast: every conv's operands cast as eager autocast would
        if (dt is not None and layers[0].is_head) or (dropout and torch.compiler.is_compiling()):
            # A head's BN runs on the un-cast input under autocast; a dropout's RNG replay is
            # not reproduced by a compiled graph (Note: [why a custom op under torch.compile]).
            return self._forward_eager(_concat(pieces))
        stats = [bn_running_stats(l.bn) if l.bn is not None else (None, None) for l in layers]
        _check_call(layers, input, stats, dt or input.dtype)  # before any running statistic moves
        if isinstance(self.plan, LazyPlan) and torch.is_grad_enabled() and self._resolve_plan(pieces, dt):
            return self._forward_eager(_concat(pieces))
        bn_specs = [bn_spec_from_module(l.bn, advance=True) if l.bn is not None else None for l in layers]
        x = pieces[0] if dt is None else pieces[0].to(dt)  # one piece unless a head (never cast)
        params = _flat_params(layers, dt)
        dev = input.device.type
        specs = self.plan.specs([l.conv for l in layers], bn_specs, tails)
        with torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else nullcontext():
            if layers[0].conv is not None:
                x = layers[0].conv.pad_input(x)
            return run_chain(self.op_key, [x] if len(pieces) == 1 else list(pieces), params, specs, stats)

    def _resolve_plan(self, pieces: Sequence[Tensor], dt: Optional[torch.dtype]) -> bool:
        """Resolve the lazy plan on this first training call (the layers hold its shapes); whether
        the chain runs as eager modules from now on (its guard measured the fused step above eager's).

        Note: [planning on concrete sizes]
        Under torch.compile with dynamic shapes (Dynamo marks sizes dynamic once any
        compiled chain saw two shapes) the sizes are SymInts, and the planner's sorting
        and knapsack cannot run on them. The plan is for this call's sizes anyway:
        reading them as ints specialises only the graph that plans (the first call).
        ``operator.index`` specialises under Dynamo; ``int()`` stays symbolic there.
        """
        lazy = self.plan
        assert isinstance(lazy, LazyPlan)  # the caller checked it
        for l in self.layers:
            l.x_shape = tuple(operator.index(s) for s in l.x_shape)  # type: ignore[union-attr]
            l.y_shape = tuple(operator.index(s) for s in l.y_shape)  # type: ignore[union-attr]
        self.apply_plan(lazy.decide(self.layers))
        if lazy.guard is None or dt is not None or torch.compiler.is_compiling():
            return False
        why = lazy.guard(self, pieces)
        if why:  # Note: [never above eager, without example inputs] in passes/plan/first_call_peak.py
            self.apply_plan(self.plan.running_eager(why))  # type: ignore[union-attr]
        return bool(why)

    def extra_repr(self) -> str:
        rows = []
        for i, l in enumerate(self.layers):
            tail = " -> ".join(str(e) if isinstance(e, Activation) else type(e).__name__ for e in l.tail) or str(l.act)
            parts = [p for p in (l.names[0], l.names[1] if l.bn is not None else "", tail) if p]
            kind = " (head)" if l.is_head else " (end)" if l.is_end else ""
            rows.append(f"({i}) {' -> '.join(parts)}: {l.mode}{kind}")
        return "\n".join(rows)


def _check_call(layers: Sequence[ChainLayer], input: Tensor, stats: Sequence[Tuple[Optional[Tensor], Optional[Tensor]]],
                compute_dtype: torch.dtype) -> None:
    """The checks eager's modules make on this call, every layer's before any running statistic
    moves (a failing call changes nothing); records each layer's shapes for the planner."""
    first = layers[0]
    specs0 = [bn_spec_from_module(l.bn) if l.bn is not None else None for l in layers]
    if first.is_head:
        _check_head_input(input, first, stats[0])
        if len(layers) > 1 and layers[1].conv is not None:
            second = layers[1]
            check_inputs(input, second.weight, second.conv, specs0[1] or NO_BN,  # type: ignore[arg-type]
                         (second.bias, *second.tail_params(), *_bn_tensors(second)))
    else:
        check_inputs(input, first.weight, first.conv, specs0[0] or NO_BN,  # type: ignore[arg-type]
                     (first.bias, *first.tail_params(), *_bn_tensors(first)))
    shape: Sequence[int] = input.shape
    for l, spec in zip(layers, specs0):
        l.x_shape = tuple(shape)
        if l.conv is not None:
            shape = conv_output_shape(shape, l.weight.shape, l.conv)  # type: ignore[union-attr]
            if any(s <= 0 for s in shape[2:]):
                raise RuntimeError(f"input of shape {tuple(input.shape)} is too small for {l.names[0]}: output {tuple(shape)}")
        if spec is not None and spec.batch_stats and spec.process_group is None and shape[0] * math.prod(shape[2:]) == 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {torch.Size(shape)} at {l.names[1]}"
            )
        l.y_shape, l.y_dtype = tuple(shape), compute_dtype if l.conv is not None else input.dtype


def _flat_params(layers: Sequence[ChainLayer], dt: Optional[torch.dtype]) -> List[Optional[Tensor]]:
    """The chain's flat parameter list (autograd/chain_spec.py), cast to autocast's ``dt`` where given."""
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
    return params


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
