"""``FusedNormChain``: a :class:`~convbn.nn.chain.FusedChain` whose layers normalise per sample.

Built by :func:`convbn.convert` for Conv -> GroupNorm / InstanceNorm / channel LayerNorm ->
tail chains (and their pre-activation heads); each layer's norm is a
:class:`~convbn.nn.norm_view.NormView` on the model's own module, read at every call. Everything
a chain is to the rest of convbn -- its plan (``apply_plan``, the lazy first-call plan), its
layers' shapes for the planner, its hook watch and eager fallback, its report lines -- is the
``FusedChain``'s; a call runs :func:`convbn.autograd.norm_chain.norm_chain_apply` (Note: [a
per-sample norm layer's backward]).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..autograd.chain_plan import LazyPlan
from ..autograd.norm_chain import NormLayerSpec, norm_chain_apply
from ..autograd.norm_chain_compiled import compilable_norm_chain, norm_chain_compiled_apply
from ..functional.conv import conv_output_shape
from ..functional.conv_bn_call import autocast_dtype, check_inputs
from ..functional.tail import DropoutOp
from .chain import FusedChain, _concat
from .chain_layer import NO_BN, ChainLayer, tail_spec
from .norm_view import NormView

__all__ = ["FusedNormChain", "is_norm_layer"]


def is_norm_layer(l: ChainLayer) -> bool:
    """Whether ``l`` normalises per sample (its norm is a :class:`NormView`)."""
    return isinstance(l.bn, NormView)


class FusedNormChain(FusedChain):
    """A fused chain of ``[conv] -> per-sample norm -> tail`` layers (see the module docstring).

    Args:
        layers: the chain's layers, input to output; each has a :class:`NormView` as its
            norm (``bn``), or none (an end layer).

    Example:
        Built by :func:`convbn.convert`; ``print(model)`` shows each chain's layers and modes.
    """

    _ends_inside = True

    def __init__(self, layers: Sequence[ChainLayer]) -> None:
        for i, l in enumerate(layers):
            if l.bn is not None and not isinstance(l.bn, NormView):
                raise TypeError(f"a FusedNormChain's layers normalise with a NormView, but layer {i} has "
                                f"{type(l.bn).__name__}")
        super().__init__(layers)
        object.__setattr__(self, "watched", [[m for m in (*self._norm_modules(l), *l.tail) if isinstance(m, nn.Module)]
                                             for l in self.layers])

    def _norm_modules(self, l: ChainLayer) -> Tuple[object, ...]:
        view = l.bn
        return (view.owner,) if isinstance(view, NormView) and view.module_call else ()

    def _normalise(self, l: ChainLayer, y: Tensor) -> Tensor:
        return l.bn.eager(y)  # type: ignore[union-attr]

    def _specs(self, tails: Sequence[Tuple[Any, Any]], keep: Optional[Sequence[bool]] = None,
               may_drop: Optional[Sequence[bool]] = None) -> List[NormLayerSpec]:
        """The layers' :class:`NormLayerSpec` with their tails (``tail_spec``); ``keep`` /
        ``may_drop``: the plan's flags, else the spec's defaults."""
        n = len(self.layers)
        return [NormLayerSpec(l.conv, None if l.bn is None else l.bn.call(), act, tail, k, d)  # type: ignore[union-attr]
                for l, (act, tail), k, d in zip(self.layers, tails, keep or [True] * n, may_drop or [True] * n)]

    def compile_caveat(self) -> str:
        """Why, under ``torch.compile``, this chain runs its layers as eager modules although it
        runs fused outside it, or ``""``: a training dropout in a tail, or a linear layer on rows
        (``compilable_norm_chain``); the report prints it beside the layer."""
        specs = self._specs([tail_spec(l) for l in self.layers])
        if compilable_norm_chain(specs):
            return ""
        if any(isinstance(op, DropoutOp) for s in specs for op in s.tail):
            return "under torch.compile its layers run as eager modules (a training dropout in its tail)"
        return "under torch.compile its layers run as eager modules (a linear layer on rows)"

    def _forward_fused(self, pieces: Sequence[Tensor], input: Tensor) -> Tensor:
        layers = self.layers
        tails = [tail_spec(l) for l in layers]
        x = _concat(pieces)
        dt = autocast_dtype(input)  # autocast: the convs' weights cast as autocast casts a conv module's
        _check_norm_call(layers, x, dt)
        if isinstance(self.plan, LazyPlan) and torch.is_grad_enabled() and self._resolve_plan(pieces, dt):
            return self._forward_eager(x)
        specs = self._specs(tails, self.plan.keep, self.plan.may_drop)
        stats = [l.bn.stats() if l.bn is not None else (None, None) for l in layers]  # type: ignore[union-attr]
        if layers[0].conv is not None:
            x = layers[0].conv.pad_input(x)
        params = _flat_params(layers, dt)
        if torch.compiler.is_compiling():
            if not compilable_norm_chain(specs):
                return self._forward_eager(_concat(pieces))
            return norm_chain_compiled_apply(x, params, specs, stats)  # Note: [a norm chain under torch.compile]
        return norm_chain_apply(x, params, specs, stats)


def _flat_params(layers: Sequence[ChainLayer], dt: Optional[torch.dtype]) -> List[Optional[Tensor]]:
    """Per layer ``W, b`` (with a conv; cast to autocast's ``dt`` where given, differentiably, as
    autocast casts a conv module's), the norm's ``weight, bias`` (with a norm), PReLU weights."""
    params: List[Optional[Tensor]] = []
    for l in layers:
        if l.conv is not None:
            w, b = l.weight, l.bias
            params += [w, b] if dt is None else [w.to(dt), None if b is None else b.to(dt)]  # type: ignore[union-attr]
        if l.bn is not None:
            params += [l.bn.weight, l.bn.bias]
        params += l.tail_params()
    return params


def _check_norm_call(layers: Sequence[ChainLayer], x: Tensor, dt: Optional[torch.dtype]) -> None:
    """The checks eager's modules make before any running statistic moves; records each
    layer's shapes for the planner (as ``FusedChain`` does)."""
    first = layers[0]
    if first.conv is not None:
        check_inputs(x, first.weight, first.conv, NO_BN, (first.bias, *first.tail_params()))  # type: ignore[arg-type]
    elif x.dim() < 2 or x.shape[1] != first.bn.channels:  # type: ignore[union-attr]
        raise RuntimeError(f"expected input of shape {tuple(x.shape)} to have {first.bn.channels} channels for "  # type: ignore[union-attr]
                           f"{first.names[1] or 'the norm'}, but got {x.shape[1] if x.dim() > 1 else None}")
    for l in layers:
        for t in (l.bn.weight, l.bn.bias, *l.bn.stats()) if l.bn is not None else ():  # type: ignore[union-attr]
            if t is not None and t.device != x.device:
                raise RuntimeError(f"input is on {x.device} but a weight/buffer of {l.names[1]} is on {t.device}; move "
                                   f"the module with .to({x.device}) or the input with .to({t.device})")
    shape: Sequence[int] = x.shape
    for l in layers:
        l.x_shape = tuple(shape)
        if l.conv is not None:
            shape = conv_output_shape(shape, l.weight.shape, l.conv)  # type: ignore[union-attr]
            if any(s <= 0 for s in shape[2:]):
                raise RuntimeError(f"input of shape {tuple(x.shape)} is too small for {l.names[0]}: output {tuple(shape)}")
        l.y_shape, l.y_dtype = tuple(shape), dt if dt is not None and l.conv is not None else x.dtype
