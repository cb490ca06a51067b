"""One ``autograd.Function`` for a chain of fused Conv -> BN -> act layers.

A chain is a run of fused layers where each layer's output feeds only the next
layer's convolution. Inside a chain nothing is kept for a layer's *input*: it is
recomputed element-wise from the previous layer's BN input ``y`` (or, where that
was not kept either, by recomputing the previous convolution from further back).
Per layer the plan says whether ``y`` is kept:

* ``keep_y=True``  (``recompute_bn``): keep ``y``; backward recomputes BN + act only;
* ``keep_y=False`` (``recompute_conv``): keep nothing; backward recomputes the conv
  from the layer input, which is itself rebuilt from the nearest kept tensor.

The chain input ``x0`` is always kept (the first convolution's weight gradient needs
it). Saved bytes are therefore ``x0 + sum(y_i for kept i)`` plus parameters and
per-channel statistics, whatever the chain length.

# Note: [chain backward order]
# Backward walks the layers last to first. Layer i needs its conv output y_i for its
# BN backward, then its input x_i for its conv backward. ``_Rebuilder`` produces them
# lazily: a kept y is returned as is; an unkept y is recomputed from a rebuilt x_i.
# x_i is act(BN(y_{i-1})): for the ReLU family it is computed in place and cached, and
# once layer i is done with it as its conv input, layer i-1 overwrites it with its grad_z
# (the derivative needs only the output). Smooth activations recompute z when needed.
# A rebuilt x_i is held until layer i's conv backward, or -- where ``choose_drops``
# (autograd/chain_memory.py, a replay of this order on sizes) finds it lowers the peak --
# dropped right after recomputing y_i and rebuilt element-wise after the BN backward has
# released y_i, so y_i and x_i are never alive together. Every activation backward writes
# into a buffer it consumes; the incoming gradient, each kept y and each layer's grad_x
# are freed as soon as they are consumed (Notes: [freeing the incoming gradient],
# [freeing kept tensors early] in autograd/release.py). At most one segment of unkept
# layers is materialised at a time, as with activation checkpointing.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd import Function

from ..functional.activations import Activation
from ..functional.batchnorm import BNSpec, bn_apply, bn_backward, bn_forward
from ..functional.conv import ConvSpec, conv_backward, conv_forward, conv_output_shape
from ..functional.fused import conv_bn_act_no_grad as _forward_no_grad
from ..functional.reference import conv_bn_act_reference
from .chain_memory import choose_drops
from .fused import differentiable_backward
from .release import free_storage as _free_storage
from .release import incoming_refs
from .release import keeping_graph as _keeping_graph
from .release import sole_owner as _sole_owner
from .saving import load_tensors, save_tensors

__all__ = ["ChainLayerSpec", "ChainFunction", "chain_forward", "chain_backward", "chain_forward_no_grad"]

# differentiable tensors per layer in ChainFunction.apply: conv weight, conv bias, bn weight, bn bias
PER_LAYER = 4


@dataclass(frozen=True)
class ChainLayerSpec:
    """Static description of one layer of a chain for one forward call."""

    conv: ConvSpec
    bn: BNSpec
    act: Activation
    keep_y: bool


class _Rebuilder:
    """Lazily rebuilds layer inputs / conv outputs in backward (Note: [chain backward order])."""

    def __init__(self, x0: Tensor, params: Sequence[Optional[Tensor]], specs: Sequence[ChainLayerSpec],
                 kept: Dict[int, Tensor], means: Sequence[Tensor], invstds: Sequence[Tensor],
                 drop: Optional[Sequence[bool]] = None) -> None:
        self.x0 = x0
        self.params = params
        self.specs = specs
        self.y: Dict[int, Tensor] = dict(kept)
        self.kept_idx = set(kept)
        self.outs: Dict[int, Tensor] = {}
        self.xs: Dict[int, Tensor] = {}
        self.means = means
        self.invstds = invstds
        self.drop = [False] * len(specs) if drop is None else list(drop)

    def layer_params(self, i: int) -> Sequence[Optional[Tensor]]:
        return self.params[PER_LAYER * i: PER_LAYER * (i + 1)]

    def x(self, i: int) -> Tensor:
        """Layer i's conv input, rebuilt element-wise from ``y_{i-1}`` (kept or cached)."""
        if i == 0:
            return self.x0
        if i in self.xs:
            return self.xs.pop(i)
        y = self.get_y(i - 1)
        _, _, g, b = self.layer_params(i - 1)
        z = bn_apply(y, self.means[i - 1], self.invstds[i - 1], g, b)
        act = self.specs[i - 1].act
        if act.output_derivable:
            # ReLU family: the output alone gives layer i-1's activation derivative, so
            # one buffer serves as layer i's input and, later, as layer i-1's grad_z.
            x = act(z, inplace=True)
            if not act.is_identity:
                self.outs[i - 1] = x
        else:
            x = act(z)
            del z  # smooth activation: z is recomputed when layer i-1 needs it
        return self.specs[i].conv.pad_input(x)

    def get_y(self, i: int) -> Tensor:
        """Layer i's conv output: kept, or recomputed from a rebuilt ``x_i`` that is held for
        the conv backward or, where ``drop[i]``, dropped at once and rebuilt after BN
        backward (Note: [chain backward order])."""
        y = self.y.get(i)
        if y is None:
            w, b, _, _ = self.layer_params(i)
            x = self.x(i)
            y = conv_forward(x, w, b, self.specs[i].conv)  # type: ignore[arg-type]
            if self.drop[i]:
                self.outs.pop(i - 1, None)
            elif i > 0:
                self.xs[i] = x
            del x
            self.y[i] = y
        return y

    def grad_z(self, i: int, grad_out: Tensor) -> Tensor:
        """Layer i's activation backward, written into a buffer it no longer needs: the
        cached output (ReLU family) or a recomputed ``z``."""
        act = self.specs[i].act
        if act.is_identity:
            return grad_out
        out = self.outs.pop(i, None)
        if out is not None:
            return act.backward_from_output_(grad_out, out)
        _, _, g, b = self.layer_params(i)
        z = bn_apply(self.get_y(i), self.means[i], self.invstds[i], g, b)
        return act.backward_(grad_out, z)

    def release(self, i: int, free_kept: bool) -> None:
        """Drop layer i's conv output after its BN backward; a *kept* one is freed too when
        ``free_kept`` (Note: [freeing kept tensors early])."""
        y = self.y.pop(i, None)
        if free_kept and i in self.kept_idx and y is not None:
            _free_storage(y)


def chain_forward(
    x0: Tensor,
    params: Sequence[Optional[Tensor]],
    specs: Sequence[ChainLayerSpec],
    stats: Sequence[Tuple[Optional[Tensor], Optional[Tensor]]],
) -> Tuple[Tensor, List[int], List[Tensor], List[Tensor], List[Tensor]]:
    """Run the chain (no autograd); returns ``(out, kept_idx, kept_y, means, invstds)``."""
    x = x0
    kept: List[Tensor] = []
    kept_idx: List[int] = []
    means: List[Tensor] = []
    invstds: List[Tensor] = []
    for i, spec in enumerate(specs):
        w, b, g, beta = params[PER_LAYER * i: PER_LAYER * (i + 1)]
        rm, rv = stats[i]
        if i > 0:
            x = spec.conv.pad_input(x)  # constant pre-pad only (see FusedChain)
        y = conv_forward(x, w, b, spec.conv)  # type: ignore[arg-type]
        z, mean, invstd = bn_forward(y, g, beta, rm, rv, spec.bn)
        if spec.keep_y:
            kept.append(y)
            kept_idx.append(i)
        del y
        means.append(mean)
        invstds.append(invstd)
        x = spec.act(z, inplace=True)
    return x, kept_idx, kept, means, invstds


def chain_backward(
    grad_out: Tensor,
    x0: Tensor,
    params: Sequence[Optional[Tensor]],
    specs: Sequence[ChainLayerSpec],
    kept: Dict[int, Tensor],
    means: Sequence[Tensor],
    invstds: Sequence[Tensor],
    needs: Sequence[bool],
    free_grad_out: bool = False,
    free_kept: bool = False,
) -> List[Optional[Tensor]]:
    """First-order backward of :func:`chain_forward` (Note: [chain backward order]).

    ``needs`` has one flag for ``x0`` then one per entry of ``params``; the result
    has the same layout. ``free_grad_out`` says the incoming gradient is the caller's
    alone (``autograd.release.sole_owner``): its memory is then returned once consumed
    (Note: [freeing the incoming gradient]); a caller whose contract forbids touching its
    inputs (a custom op) leaves it ``False``.
    With ``free_kept`` each kept conv output's memory is returned right after its
    last use (Note: [freeing kept tensors early]); only for a graph that is not retained.
    """
    grads: List[Optional[Tensor]] = [None] * len(needs)
    ys, xs = _layer_sizes(x0, params, specs)
    drop = choose_drops(ys, xs, [s.keep_y for s in specs], [_act_kind(s.act) for s in specs])
    rb = _Rebuilder(x0, params, specs, kept, means, invstds, drop)
    g: Optional[Tensor] = grad_out
    # Note: [freeing the incoming gradient]: the engine holds grad_out until backward returns
    engine_grad: Optional[Tensor] = grad_out if free_grad_out else None
    del grad_out
    for i in reversed(range(len(specs))):
        spec = specs[i]
        w, b, gamma, beta = rb.layer_params(i)
        base = 1 + PER_LAYER * i
        nw, nb, ng, nbeta = needs[base: base + PER_LAYER]
        nx = needs[0] if i == 0 else True
        y = rb.get_y(i)
        grad_z = rb.grad_z(i, g)  # type: ignore[arg-type]
        g = None  # consumed: only grad_z lives on
        if engine_grad is not None and grad_z is not engine_grad:
            _free_storage(engine_grad)
            engine_grad = None
        grad_y, grads[base + 2], grads[base + 3] = bn_backward(
            grad_z, y, gamma, means[i], invstds[i], spec.bn, (nx or nw or nb, ng, nbeta)
        )
        del grad_z, y
        if engine_grad is not None:  # identity activation: grad_z was the incoming gradient
            _free_storage(engine_grad)
            engine_grad = None
        rb.release(i, free_kept)
        x = rb.x(i)  # rebuilt now that y_i and grad_z are gone (Note: [chain backward order])
        gx, grads[base], grads[base + 1] = conv_backward(grad_y, x, w, spec.conv, (nx, nw, nb))  # type: ignore[arg-type]
        del grad_y, x
        if i > 0 and spec.conv.pre_pad:
            gx = _unpad(gx, spec.conv.pre_pad)  # type: ignore[arg-type]
        g = gx
        del gx  # only g refers to it: dropped as soon as the next layer has consumed it
    grads[0] = g if needs[0] else None
    return grads


class ChainFunction(Function):
    """Forward/backward of ``act_k(BN_k(conv_k(... act_1(BN_1(conv_1(x0))) ...)))``.

    ``apply(x0, *params, specs, stats)`` with ``params`` the flat list
    ``[W_1, b_1, gamma_1, beta_1, W_2, ...]`` (``None`` where absent), ``specs`` a tuple of
    :class:`ChainLayerSpec` and ``stats`` a tuple of ``(running_mean, running_var)``
    per layer (updated in place once, in forward, for layers normalising with batch
    statistics).
    """

    @staticmethod
    def forward(ctx: Any, x0: Tensor, *args: Any) -> Tensor:  # type: ignore[override]
        *params, specs, stats = args
        out, kept_idx, kept, means, invstds = chain_forward(x0, params, specs, stats)
        save_tensors(ctx, (x0, *params, *kept, *means, *invstds))
        ctx.specs = tuple(specs)
        ctx.kept_idx = tuple(kept_idx)
        ctx.n_params = len(params)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        refs = incoming_refs(grad_out)  # first: Note: [freeing the incoming gradient]
        saved = load_tensors(ctx)
        specs: Tuple[ChainLayerSpec, ...] = ctx.specs
        n, k = ctx.n_params, len(specs)
        x0, params = saved[0], saved[1: 1 + n]
        rest = saved[1 + n:]
        n_kept = len(ctx.kept_idx)
        kept = dict(zip(ctx.kept_idx, rest[:n_kept]))
        means, invstds = rest[n_kept: n_kept + k], rest[n_kept + k:]
        if torch.is_grad_enabled():  # Note: [double backward] in autograd/fused.py
            return differentiable_backward(ctx, grad_out, (x0, *params), _rebuild(specs, means, invstds))
        needs = ctx.needs_input_grad
        grads = chain_backward(grad_out, x0, params, specs, kept, means, invstds, needs[: 1 + n],  # type: ignore[arg-type]
                               free_grad_out=_sole_owner(grad_out, refs), free_kept=not _keeping_graph())
        return tuple(grads) + (None,) * (len(needs) - len(grads))


def _rebuild(specs: Sequence[ChainLayerSpec], means: Sequence[Tensor], invstds: Sequence[Tensor]) -> Any:
    def rebuild(x0: Tensor, *params: Optional[Tensor]) -> Tensor:
        x = x0
        for i, spec in enumerate(specs):
            w, b, g, beta = params[PER_LAYER * i: PER_LAYER * (i + 1)]
            if spec.bn.batch_stats:
                rm = rv = None
                bn = BNSpec(spec.bn.eps, True, 0.0)
            else:
                rm, rv = means[i], invstds[i].pow(-2) - spec.bn.eps
                bn = spec.bn
            if i > 0:
                x = spec.conv.pad_input(x)
            x = conv_bn_act_reference(x, w, b, g, beta, rm, rv, spec.conv, bn, spec.act)  # type: ignore[arg-type]
        return x

    return rebuild


def _act_kind(act: Activation) -> str:
    """The activation's kind in :data:`convbn.autograd.chain_memory.ACT_KINDS`."""
    return "identity" if act.is_identity else "output" if act.output_derivable else "smooth"


def _layer_sizes(x0: Tensor, params: Sequence[Optional[Tensor]],
                 specs: Sequence[ChainLayerSpec]) -> Tuple[List[int], List[int]]:
    """Element counts of each layer's conv output and (unpadded) input; ``x0`` arrives padded."""
    shape: Sequence[int] = x0.shape
    ys: List[int] = []
    xs: List[int] = []
    for i, spec in enumerate(specs):
        conv = spec.conv if i > 0 else dataclasses.replace(spec.conv, pre_pad=())
        out = conv_output_shape(shape, params[PER_LAYER * i].shape, conv)  # type: ignore[union-attr]
        xs.append(math.prod(shape))
        ys.append(math.prod(out))
        shape = out
    return ys, xs


def _unpad(t: Tensor, pads: Sequence[int]) -> Tensor:
    """Gradient of a constant ``F.pad``: crop the padded borders (``pads`` last dim first)."""
    for j in range(len(pads) // 2):
        dim = t.dim() - 1 - j
        left, right = pads[2 * j], pads[2 * j + 1]
        t = t.narrow(dim, left, t.shape[dim] - left - right)
    return t


def chain_forward_no_grad(
    x: Tensor,
    params: Sequence[Optional[Tensor]],
    specs: Sequence[ChainLayerSpec],
    stats: Sequence[Tuple[Optional[Tensor], Optional[Tensor]]],
) -> Tensor:
    """The chain's forward when nothing needs gradients (running stats still update)."""
    with torch.no_grad():
        for i, spec in enumerate(specs):
            w, b, g, beta = params[PER_LAYER * i: PER_LAYER * (i + 1)]
            rm, rv = stats[i]
            if i > 0:
                x = spec.conv.pad_input(x)
            x = _forward_no_grad(x, w, b, g, beta, rm, rv, spec.conv, spec.bn, spec.act)  # type: ignore[arg-type]
    return x
