"""``FusedChain``: the module that runs a chain of fused layers found by :func:`convbn.convert`.

The chain does not own its convolutions and BatchNorms: it holds *unregistered*
references to the model's own modules, which stay registered where they were, so the
converted model's ``state_dict()`` keys, parameter objects and ``train()/eval()`` all
behave as before conversion.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from ..autograd.chain import ChainFunction, ChainLayerSpec, chain_forward_no_grad
from ..functional.activations import Activation
from ..functional.conv import ConvSpec, conv_flops, conv_forward, conv_output_shape, conv_spec_from_module
from ..functional.fused import autocast_dtype, check_inputs
from .bn_call import has_standard_bn_forward, standard_batch_norm
from .fused import bn_running_stats, bn_spec_from_module, module_hooked

__all__ = ["ChainLayer", "FusedChain", "LAYER_MODES"]

#: What a layer of a chain keeps: its conv output (``recompute_bn``) or nothing (``recompute_conv``).
LAYER_MODES = ("recompute_bn", "recompute_conv")


@dataclass
class ChainLayer:
    """One fused Conv -> BN -> act inside a :class:`FusedChain`.

    Attributes:
        conv_owner: module holding the conv weight (and bias) as attributes.
        weight_name, bias_name: attribute names (``bias_name`` ``None`` without bias).
        conv: the convolution's geometry.
        bn: the BatchNorm module (read at every call: mode, momentum, running stats).
        act: the fused activation.
        mode: ``"recompute_bn"`` or ``"recompute_conv"``.
        names: ``(conv, bn, activation)`` qualified names, for reports.
        y_shape: conv output shape seen at the last call (for the planner).
        y_dtype: its dtype.
    """

    conv_owner: nn.Module
    weight_name: str
    bias_name: Optional[str]
    conv: ConvSpec
    bn: _BatchNorm
    act: Activation
    mode: str = "recompute_bn"
    names: Tuple[str, str, str] = ("", "", "")
    y_shape: Optional[Tuple[int, ...]] = None
    y_dtype: Optional[torch.dtype] = None
    x_shape: Optional[Tuple[int, ...]] = field(default=None)

    @property
    def weight(self) -> Tensor:
        return getattr(self.conv_owner, self.weight_name)

    @property
    def bias(self) -> Optional[Tensor]:
        return None if self.bias_name is None else getattr(self.conv_owner, self.bias_name)

    def y_bytes(self) -> int:
        """Bytes of the conv output at the last call (0 before any call)."""
        if self.y_shape is None or self.y_dtype is None:
            return 0
        n = 1
        for s in self.y_shape:
            n *= s
        return n * torch.empty((), dtype=self.y_dtype).element_size()

    def flops(self) -> int:
        """Multiply-accumulates of the conv at the last call."""
        if self.y_shape is None:
            return 0
        return conv_flops(self.y_shape, self.weight.shape, self.conv, self.x_shape)


class FusedChain(nn.Module):
    """Runs ``layers`` as one :class:`convbn.autograd.chain.ChainFunction`.

    Args:
        layers: the chain's layers, input to output.

    Example:
        Built by :func:`convbn.convert`; ``print(model)`` shows each chain's layers and modes.
    """

    def __init__(self, layers: Sequence[ChainLayer]) -> None:
        super().__init__()
        if not layers:
            raise ValueError("a FusedChain needs at least one layer")
        # Unregistered on purpose (see module docstring).
        object.__setattr__(self, "layers", list(layers))
        #: called once, on the first training call, with the layers (their shapes then known);
        #: returns one keep flag per layer (``True``: ``recompute_bn``). ``convbn.convert``
        #: attaches its planner here for ``strategy="auto"`` without ``example_inputs``.
        self.plan_on_first_call: Optional[Callable[[Sequence[ChainLayer]], Sequence[bool]]] = None
        from ..autograd.chain_op import register_chain

        self.op_key = register_chain([(l.conv, l.act, float(l.bn.eps)) for l in self.layers])
        # per layer, the model's modules whose own calls this chain replaces (see ``watch``)
        object.__setattr__(self, "watched", [[l.bn] for l in self.layers])

    layers: List[ChainLayer]
    watched: List[List[nn.Module]]

    def watch(self, modules: Sequence[Sequence[nn.Module]]) -> None:
        """Per layer, the modules (conv, BatchNorm, activation) whose hooks must be honoured.

        Note: [hooks on fused modules]
        A fused chain computes conv, BN and activation without calling those modules, so
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
        """The chain as eager modules: conv modules and BatchNorms are *called* (hooks run,
        eager's own checks and bookkeeping apply), activations applied as eager does."""
        for l, mods in zip(self.layers, self.watched):
            conv = next((m for m in mods if isinstance(m, (_ConvNd, nn.Linear)) and m is l.conv_owner), None)
            if conv is not None and l.weight_name == "weight" and conv_spec_from_module(conv) == l.conv:
                y = conv(x)
            elif conv is not None and (conv._forward_pre_hooks or conv._forward_hooks or conv._backward_hooks):
                raise RuntimeError(
                    f"{l.names[0]} has hooks but its padding was merged into the fused chain, so they cannot "
                    "run as in eager; register the hooks before convbn.convert (it then leaves the layer unfused)"
                )
            else:
                y = conv_forward(l.conv.pad_input(x), l.weight, l.bias, l.conv)
            # a norm-act module's own forward would apply its tail again: its batch norm only
            z = l.bn(y) if has_standard_bn_forward(l.bn) else standard_batch_norm(l.bn, y)
            act = next((m for m in mods if m is not l.bn and m is not conv), None)
            x = act(z) if act is not None else l.act(z)
        return x

    def _linear_on_other_shape(self, input: Tensor) -> bool:
        """Whether a linear layer of the chain gets an input other than ``(N, C)``.

        ``nn.Linear`` maps the last dimension of any input, but a BatchNorm1d after it
        normalises those features only on ``(N, C)``: on ``(N, L, C)`` it would normalise
        over ``L``, another computation, which the chain then runs as eager does.
        """
        return any(l.conv.is_linear for l in self.layers) and any(l.conv.dims + 2 != input.dim() for l in self.layers)

    def forward(self, input: Tensor) -> Tensor:
        if input.numel() == 0 or self._hooked() or self._linear_on_other_shape(input):
            return self._forward_eager(input)
        # The chain reads a layer's weight several times (checks, planning, the Function);
        # eager's conv reads it once. Under ``parametrize.cached()`` a parametrization (e.g.
        # spectral_norm's power iteration, which updates its buffers) runs once per call too.
        with parametrize.cached():
            return self._forward_fused(input)

    def _forward_fused(self, input: Tensor) -> Tensor:
        layers = self.layers
        first = layers[0]
        stats = [bn_running_stats(l.bn) for l in layers]
        specs0 = [bn_spec_from_module(l.bn) for l in layers]
        # Check every layer before any running statistic moves (a failing call changes nothing).
        compute_dtype = autocast_dtype(input) or input.dtype  # what the conv outputs will be
        shape: Sequence[int] = input.shape
        check_inputs(input, first.weight, first.conv, specs0[0], (first.bias, first.bn.weight, first.bn.bias, *stats[0]))
        for l, spec in zip(layers, specs0):
            l.x_shape = tuple(shape)
            shape = conv_output_shape(shape, l.weight.shape, l.conv)
            if any(s <= 0 for s in shape[2:]):
                raise RuntimeError(f"input of shape {tuple(input.shape)} is too small for {l.names[0]}: output {tuple(shape)}")
            if spec.batch_stats and spec.process_group is None and shape[0] * _prod(shape[2:]) == 1:
                raise ValueError(
                    f"Expected more than 1 value per channel when training, got input size {torch.Size(shape)} at {l.names[1]}"
                )
            l.y_shape, l.y_dtype = tuple(shape), compute_dtype
        if self.plan_on_first_call is not None and torch.is_grad_enabled():
            keeps = list(self.plan_on_first_call(layers))
            if len(keeps) != len(layers):
                raise ValueError(f"plan_on_first_call returned {len(keeps)} flags for {len(layers)} layers")
            for l, k in zip(layers, keeps):
                l.mode = "recompute_bn" if k else "recompute_conv"
            self.plan_on_first_call = None
        bn_specs = [bn_spec_from_module(l.bn, advance=True) for l in layers]
        # autocast: every conv's operands cast as eager autocast would (no-op when it is off)
        dt = autocast_dtype(input)
        x = input if dt is None else input.to(dt)
        params: List[Optional[Tensor]] = []
        for l in layers:
            w, b = l.weight, l.bias
            if dt is not None:
                w, b = w.to(dt), (None if b is None else b.to(dt))
            params += [w, b, l.bn.weight, l.bn.bias]
        dev = input.device.type
        specs = tuple(
            ChainLayerSpec(l.conv, bs, l.act, l.mode != "recompute_conv") for l, bs in zip(layers, bn_specs)
        )
        with torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else nullcontext():
            x = first.conv.pad_input(x)
            if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params))):
                return chain_forward_no_grad(x, params, specs, stats)
            if torch.compiler.is_compiling() and not any(s.bn.process_group is not None for s in specs):
                from ..autograd.chain_op import chain_op_apply  # Note: [why a custom op under torch.compile]

                return chain_op_apply(self.op_key, x, params, specs, stats)
            return ChainFunction.apply(x, *params, specs, tuple(stats))

    def extra_repr(self) -> str:
        rows = [f"({i}) {l.names[0]} -> {l.names[1]} -> {l.act}: {l.mode}" for i, l in enumerate(self.layers)]
        return "\n".join(rows)


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for s in xs:
        n *= s
    return n
