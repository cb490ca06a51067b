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

Layers are general (the three kinds are described in ``nn/chain_layer.py``, ``ChainLayer``): a *head* (layer 0) has no
convolution and normalises ``x0`` itself, so it keeps nothing beyond ``x0`` and its
output (the next conv's input) is rebuilt element-wise from ``x0``; an *end* (last
layer) has no BatchNorm, and without a tail its backward needs no conv output at all;
a layer's *tail* is a single activation (the fast path below) or any sequence of
element-wise ops run by :mod:`convbn.autograd.chain_tail`.

A head's input may be *pieces* concatenated along channels (a DenseNet layer normalising
every earlier feature map): ``x0`` is then a :class:`~convbn.autograd.chain_input.ChainInput`,
turned into one transient buffer where the head needs it (forward, and backward: Note:
[a head over a concatenation]); the pieces are kept instead of the concatenation.

Flat parameter layout of ``ChainFunction.apply(x0, *params, specs, stats)``: per layer,
in order, ``W, b`` (when it has a conv), ``gamma, beta`` (when it has a BN), then one
weight per PReLU of its tail (``None`` for an absent bias or affine parameter). An
ordinary layer therefore takes ``[W, b, gamma, beta]``, as before tails existed.

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
# released y_i, so y_i and x_i are never alive together (not in a chain whose layers the
# planner marked ``may_drop=False``: its backward is not where the step peaks). Every activation backward writes
# into a buffer it consumes; the incoming gradient, each kept y and each layer's grad_x
# are freed as soon as they are consumed (Notes: [freeing the incoming gradient],
# [freeing kept tensors early] in autograd/release.py). At most one segment of unkept
# layers is materialised at a time, as with activation checkpointing.

# Note: [a head over a concatenation]
# With pieces, ``head_input`` is the one place x0 exists: forward concatenates the pieces
# into one buffer, normalises it and lets it go; backward keeps only the pieces (earlier
# outputs the model keeps alive anyway) and concatenates them again each time the head
# needs its BN input -- to rebuild layer 1's conv input, then for the head's own BN
# backward -- each copy dropped after use, so no concatenation outlives its use. The
# chain input's gradient is split back into the pieces' (narrow views of one buffer) by
# ``chain_input.split_grad``. Double backward differentiates w.r.t. the concatenation
# (rebuilt with ``torch.cat``, differentiable) and splits: w.r.t. the pieces, a piece
# computed from another (a DenseNet's later features from earlier ones) would add its own
# path into the other's gradient, a total instead of a partial derivative.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function

from ..functional.batchnorm import BNSpec, bn_apply, bn_backward
from ..functional.conv import conv_backward, conv_forward, conv_output_shape
from ..functional.conv_bn_call import ConvBNTensors
from ..functional.reference import conv_bn_act_reference
from ..functional.tail import RNGState
from .chain_forward import chain_forward, chain_forward_no_grad
from .chain_memory import choose_drops
from .chain_input import ChainInput, split_grad
from .chain_kernels import fused_layer_backward
from .chain_spec import ChainLayerSpec, ChainX0, LayerParams, head_input, layer_kind, param_offsets, split_params
from .chain_tail import tail_backward, tail_forward, tail_reference
from .double_backward import differentiable_backward
from .grad_sink import GradSink, Recording, param_sink
from .release import free_storage as _free_storage
from .refcounts import calibrate, incoming_refs
from .release import BACKWARD_TWICE
from .release import freed as _freed
from .release import keeping_graph as _keeping_graph
from .refcounts import sole_owner as _sole_owner
from .saving import load_tensors, save_tensors

__all__ = ["ChainLayerSpec", "ChainFunction", "chain_forward", "chain_backward", "chain_forward_no_grad",
           "param_offsets", "layer_kind", "head_input"]


class _Rebuilder:
    """Lazily rebuilds layer inputs / conv outputs in backward (Note: [chain backward order])."""

    def __init__(self, x0: ChainX0, params: Sequence[Optional[Tensor]], specs: Sequence[ChainLayerSpec],
                 kept: Dict[int, Tensor], means: Dict[int, Tensor], invstds: Dict[int, Tensor],
                 drop: Optional[Sequence[bool]] = None, rngs: Optional[Sequence[Tuple[RNGState, ...]]] = None,
                 needs_params: Sequence[bool] = ()) -> None:
        self.x0 = x0
        self.params = params
        self.specs = specs
        self.offsets = param_offsets(specs)
        self.y: Dict[int, Tensor] = dict(kept)
        self.kept_idx = set(kept)
        self.outs: Dict[int, Tensor] = {}
        self.xs: Dict[int, Tensor] = {}
        self.means = means
        self.invstds = invstds
        self.drop = [False] * len(specs) if drop is None else list(drop)
        self.rngs: Sequence[Tuple[RNGState, ...]] = rngs if rngs is not None else [()] * len(specs)
        self.needs_params = needs_params  # one flag per entry of ``params`` (the tails' weights read theirs)
        self._params = [split_params(s, params[self.offsets[i]: self.offsets[i + 1]]) for i, s in enumerate(specs)]

    def layer_params(self, i: int) -> LayerParams:
        return self._params[i]

    def head_input(self) -> Tensor:
        """A head's BN input, rebuilt from the chain input (:func:`head_input`)."""
        return head_input(self.x0)

    def x(self, i: int) -> Tensor:
        """Layer i's conv input, rebuilt element-wise from ``y_{i-1}`` (kept or cached)."""
        if i == 0:
            return self.x0
        if i in self.xs:
            return self.xs.pop(i)
        y = self.get_y(i - 1)
        _, _, g, b, tws = self.layer_params(i - 1)
        prev = self.specs[i - 1]
        if prev.tail:
            box = [bn_apply(y, self.means[i - 1], self.invstds[i - 1], g, b)]
            del y
            x = tail_forward(box, prev.tail, tws, owned=True, replay=self.rngs[i - 1])
            return self.specs[i].conv.pad_input(x)  # type: ignore[union-attr]
        z = bn_apply(y, self.means[i - 1], self.invstds[i - 1], g, b)
        if prev.act.output_derivable:
            # ReLU family: the output alone gives layer i-1's activation derivative, so
            # one buffer serves as layer i's input and, later, as layer i-1's grad_z.
            x = prev.act(z, inplace=True)
            if not prev.act.is_identity:
                self.outs[i - 1] = x
        else:
            x = prev.act(z)
            del z  # smooth activation: z is recomputed when layer i-1 needs it
        return self.specs[i].conv.pad_input(x)  # type: ignore[union-attr]

    def get_y(self, i: int) -> Tensor:
        """Layer i's conv output (a head's: ``x0``): kept, or recomputed from a rebuilt ``x_i``
        that is held for the conv backward or, where ``drop[i]``, dropped at once and rebuilt
        after BN backward (Note: [chain backward order])."""
        if self.specs[i].conv is None:
            return self.head_input()
        y = self.y.get(i)
        if y is None:
            w, b, _, _, _ = self.layer_params(i)
            x = self.x(i)
            y = conv_forward(x, w, b, self.specs[i].conv)  # type: ignore[arg-type]
            if self.drop[i]:
                self.outs.pop(i - 1, None)
            elif i > 0:
                self.xs[i] = x
            del x
            self.y[i] = y
        return y

    def grad_z(self, i: int, grad_out: Tensor) -> Tuple[Tensor, List[Optional[Tensor]]]:
        """Layer i's tail backward: ``(grad_z, PReLU weight grads)``. A single activation writes
        into a buffer it no longer needs: the cached output (ReLU family) or a recomputed ``z``."""
        spec = self.specs[i]
        _, _, g, b, tws = self.layer_params(i)
        if spec.tail:
            y = self.get_y(i)
            owned = spec.bn is not None
            box = [bn_apply(y, self.means[i], self.invstds[i], g, b) if owned else y]
            del y
            n = self.offsets[i + 1] - len(tws)
            needs_w = [bool(f) for f in self.needs_params[n: n + len(tws)]] or [True] * len(tws)
            return tail_backward(grad_out, box, spec.tail, tws, self.rngs[i], needs_w, owned)
        act = spec.act
        if act.is_identity:
            return grad_out, []
        out = self.outs.pop(i, None)
        if out is not None:
            return act.backward_from_output_(grad_out, out), []
        if spec.bn is None:  # an end layer's activation reads its conv output, kept or not
            return act.backward(grad_out, self.get_y(i)), []
        z = bn_apply(self.get_y(i), self.means[i], self.invstds[i], g, b)
        return act.backward_(grad_out, z), []

    def release(self, i: int, free_kept: bool) -> None:
        """Drop layer i's conv output after its BN backward; a *kept* one is freed too when
        ``free_kept`` (Note: [freeing kept tensors early])."""
        y = self.y.pop(i, None)
        if free_kept and i in self.kept_idx and y is not None:
            _free_storage(y)


def _stat_maps(specs: Sequence[ChainLayerSpec], means: Sequence[Tensor],
               invstds: Sequence[Tensor]) -> Tuple[Dict[int, Tensor], Dict[int, Tensor]]:
    idx = [i for i, s in enumerate(specs) if s.bn is not None]
    return dict(zip(idx, means)), dict(zip(idx, invstds))


class _BackwardWalk:
    """One :func:`chain_backward`, last layer to first: the gradient flowing back (``g``), the
    incoming gradient while the engine still holds it, and the result slots ``grads``.

    Each method drops a tensor where the single loop it was written as dropped it (``del``,
    or ``None`` in an attribute), so the exact peaks stay what they were; ``tail_grads`` and
    ``last_tail_grad`` keep the tail weights' gradients referenced from one layer to the
    next as that loop's variables did."""

    def __init__(self, rb: _Rebuilder, specs: Sequence[ChainLayerSpec], needs: Sequence[bool], sink: GradSink,
                 free_kept: bool, mean_of: Dict[int, Tensor], invstd_of: Dict[int, Tensor]) -> None:
        self.rb, self.specs, self.needs, self.sink, self.free_kept = rb, specs, needs, sink, free_kept
        self.mean_of, self.invstd_of = mean_of, invstd_of
        self.grads: List[Optional[Tensor]] = [None] * len(needs)
        self.g: Optional[Tensor] = None
        self.engine_grad: Optional[Tensor] = None
        self.tail_grads: Any = ()
        self.last_tail_grad: Any = None

    def _free_engine_grad(self, unless: Optional[Tensor] = None) -> None:
        """Return the incoming gradient's memory (Note: [freeing the incoming gradient]),
        unless it is ``unless`` (still in use)."""
        if self.engine_grad is not None and self.engine_grad is not unless:
            _free_storage(self.engine_grad)
            self.engine_grad = None

    def layer(self, i: int) -> None:
        """Layer ``i``'s backward: tail and BatchNorm (fused kernels or not), then its conv."""
        spec, rb, off = self.specs[i], self.rb, self.rb.offsets
        w, b, gamma, beta, tws = rb.layer_params(i)
        base = 1 + off[i]
        flags = list(self.needs[base: 1 + off[i + 1]])
        nw, nb = (flags.pop(0), flags.pop(0)) if spec.conv is not None else (False, False)
        ng, nbeta = (flags.pop(0), flags.pop(0)) if spec.bn is not None else (False, False)
        nx = self.needs[0] if i == 0 else True
        fused = None
        if (spec.needs_y or spec.conv is None) and not spec.tail:  # the opt-in fused kernels
            y = rb.get_y(i)
            fused = fused_layer_backward(self.g, y, gamma, beta, self.mean_of.get(i), self.invstd_of.get(i),  # type: ignore[arg-type]
                                         spec.bn, spec.act)
            del y
        if fused is not None:
            grad_y = self._fused(i, fused, base, ng, nbeta)
        elif spec.needs_y or spec.conv is None:
            grad_y = self._tail_bn(i, base, gamma, len(tws), (nx or nw or nb, ng, nbeta))
        else:
            grad_y, self.g = self.g, None  # an end layer without tail: the incoming gradient is grad_y
        if spec.conv is None:  # a head: grad_y is the chain input's gradient
            self.g = grad_y
            return
        x = rb.x(i)  # rebuilt now that y_i and grad_z are gone (Note: [chain backward order])
        gx, gw, gb = conv_backward(grad_y, x, w, spec.conv, (nx, nw, nb))  # type: ignore[arg-type]
        del grad_y, x
        self.grads[base], self.grads[base + 1] = self.sink(base, gw), self.sink(base + 1, gb)
        del gw, gb
        self._free_engine_grad()  # an end layer without tail consumed the incoming gradient
        if i > 0 and spec.conv.pre_pad:
            gx = _unpad(gx, spec.conv.pre_pad)  # type: ignore[arg-type]
        self.g = gx
        del gx  # only g refers to it: dropped as soon as the next layer has consumed it

    def _fused(self, i: int, fused: Tuple[Tensor, Tensor, Tensor], base: int, ng: bool, nbeta: bool) -> Tensor:
        """Layer ``i``'s BatchNorm + activation gradients from the fused kernels; returns ``grad_y``."""
        spec = self.specs[i]
        self.rb.outs.pop(i, None)  # a cached activation output (ReLU family) is not needed
        grad_y, gg, gbeta = fused
        self.g = None
        self.grads[base + 2 * (spec.conv is not None)] = gg if ng else None
        self.grads[base + 2 * (spec.conv is not None) + 1] = gbeta if nbeta else None
        del gg, gbeta
        self._free_engine_grad()
        self.rb.release(i, self.free_kept)
        return grad_y

    def _tail_bn(self, i: int, base: int, gamma: Optional[Tensor], n_tail_weights: int,
                 needs: Tuple[bool, bool, bool]) -> Tensor:
        """Layer ``i``'s tail, then BatchNorm, backward from its rebuilt conv output; returns ``grad_y``."""
        spec, rb, sink, grads = self.specs[i], self.rb, self.sink, self.grads
        y = rb.get_y(i)
        grad_z, self.tail_grads = rb.grad_z(i, self.g)  # type: ignore[arg-type]
        self.g = None  # consumed: only grad_z lives on
        first = 1 + rb.offsets[i + 1] - n_tail_weights
        for j, gt in enumerate(self.tail_grads):
            self.last_tail_grad = gt
            grads[first + j] = sink(first + j, gt)
        self._free_engine_grad(unless=grad_z)
        if spec.bn is not None:
            grad_y, gg, gbeta = bn_backward(grad_z, y, gamma, self.mean_of[i], self.invstd_of[i], spec.bn, needs)
            slot = base + 2 * (spec.conv is not None)
            grads[slot] = sink(slot, gg)
            grads[slot + 1] = sink(slot + 1, gbeta)
            del gg, gbeta
        else:
            grad_y = grad_z  # an end layer: its tail's gradient is its conv output's
        del grad_z, y
        self._free_engine_grad(unless=grad_y)  # identity activation: grad_z was it
        rb.release(i, self.free_kept)
        if self.free_kept and spec.bn is not None:  # dead now, as eager frees a BN node's saved statistics
            _free_storage(self.mean_of[i])
            _free_storage(self.invstd_of[i])
        return grad_y


def chain_backward(  # 12 parameters: the values ChainFunction and the custom op saved, passed as they are
    grad_out: Tensor,
    x0: ChainX0,
    params: Sequence[Optional[Tensor]],
    specs: Sequence[ChainLayerSpec],
    kept: Dict[int, Tensor],
    means: Sequence[Tensor],
    invstds: Sequence[Tensor],
    needs: Sequence[bool],
    free_grad_out: bool = False,
    free_kept: bool = False,
    rngs: Optional[Sequence[Tuple[RNGState, ...]]] = None,
    sink: Optional[GradSink] = None,
) -> List[Optional[Tensor]]:
    """First-order backward of :func:`chain_forward` (Note: [chain backward order]).

    ``needs`` has one flag for ``x0`` then one per entry of ``params``; the result
    has the same layout. ``means``/``invstds`` as :func:`chain_forward` returns them,
    ``rngs`` its RNG states (for tails with dropout). ``free_grad_out`` says the incoming
    gradient is the caller's alone (``autograd.refcounts.sole_owner``): its memory is then
    returned once consumed (Note: [freeing the incoming gradient]); a caller whose
    contract forbids touching its inputs (a custom op) leaves it ``False``.
    With ``free_kept`` each kept conv output's memory is returned right after its
    last use (Note: [freeing kept tensors early]); only for a graph that is not retained.
    ``sink(j, grad)`` (:func:`~convbn.autograd.grad_sink.param_sink`) receives each
    parameter gradient (slot ``j`` of the result) as soon as it is computed and gives what
    the slot returns (Note: [weight gradients as eager releases them]).
    """
    k = len(specs)
    drop: Optional[List[bool]] = None  # one layer (a single fused layer): its input is x0, never rebuilt
    if k > 1:
        ys, xs = _layer_sizes(x0, params, specs)
        drop = choose_drops(ys, xs, [s.saves_y for s in specs], [layer_kind(s) for s in specs],
                            head=specs[0].conv is None, end=specs[-1].bn is None,
                            allowed=[s.may_drop for s in specs])
    mean_of, invstd_of = _stat_maps(specs, means, invstds)
    rb = _Rebuilder(x0, params, specs, kept, mean_of, invstd_of, drop, rngs, needs[1:])
    walk = _BackwardWalk(rb, specs, needs, _keep if sink is None else sink, free_kept, mean_of, invstd_of)
    walk.g = grad_out
    # Note: [freeing the incoming gradient]: the engine holds grad_out until backward returns
    walk.engine_grad = grad_out if free_grad_out else None
    del grad_out
    for i in reversed(range(k)):
        walk.layer(i)
    grads = walk.grads
    grads[0] = walk.g if needs[0] else None
    return grads


class ChainFunction(Function):
    """Forward/backward of ``tail_k(BN_k(conv_k(... tail_1(BN_1(conv_1(x0))) ...)))``.

    ``apply(x0, *params, specs, stats)`` with ``params`` the flat list described in the
    module docstring (``[W_1, b_1, gamma_1, beta_1, W_2, ...]`` for ordinary layers,
    ``None`` where absent), ``specs`` a tuple of :class:`ChainLayerSpec` and ``stats`` a
    tuple of ``(running_mean, running_var)`` per layer (updated in place once, in forward,
    for layers normalising with batch statistics; ``(None, None)`` for an end layer).

    A head chain may take its input as ``m`` pieces concatenated along dim 1:
    ``apply(p_1, ..., p_m, *params, specs, stats, m)`` (Note: [a head over a concatenation]);
    each piece gets its own gradient.
    """

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Tensor:  # type: ignore[override]
        calibrate()  # Note: [calibrated once, in a clean state] (autograd/refcounts.py)
        n_pieces = args[-1] if isinstance(args[-1], int) else 1
        if isinstance(args[-1], int):
            args = args[:-1]
        pieces, (*params, specs, stats) = args[:n_pieces], args[n_pieces:]
        if n_pieces > 1 and specs[0].conv is not None:
            raise ValueError(f"only a head chain (BN first) takes its input as pieces, but got {n_pieces} pieces "
                             "for a chain that starts with a convolution")
        inp = ChainInput(pieces)
        x0: ChainX0 = inp if n_pieces > 1 else pieces[0]
        out, kept_idx, kept, means, invstds, rngs = chain_forward(x0, params, specs, stats)
        save_tensors(ctx, (*pieces, *params, *kept, *means, *invstds))
        ctx.n_pieces, ctx.sizes = n_pieces, inp.sizes
        ctx.specs = tuple(specs)
        ctx.kept_idx = tuple(kept_idx)
        ctx.n_params = len(params)
        ctx.rngs = rngs
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        refs = incoming_refs(grad_out)  # first: Note: [freeing the incoming gradient]
        if getattr(ctx, "spent", False):  # Note: [a backward that stops part way]
            raise RuntimeError(BACKWARD_TWICE)
        saved = load_tensors(ctx)
        specs: Tuple[ChainLayerSpec, ...] = ctx.specs
        n, k, m = ctx.n_params, sum(s.bn is not None for s in specs), ctx.n_pieces
        pieces, params = saved[:m], saved[m: m + n]
        rest = saved[m + n:]
        n_kept = len(ctx.kept_idx)
        kept = dict(zip(ctx.kept_idx, rest[:n_kept]))
        means, invstds = rest[n_kept: n_kept + k], rest[n_kept + k:]
        x0: ChainX0 = ChainInput(pieces) if m > 1 else pieces[0]  # type: ignore[arg-type]
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():  # Note: [double backward] in autograd/double_backward.py
            # w.r.t. the concatenation, then split (Note: [a head over a concatenation])
            with torch.enable_grad():
                x = head_input(x0)
            grads = differentiable_backward(ctx, grad_out, (x, *params), _rebuild(specs, means, invstds, ctx.rngs),
                                            needs=(any(needs[:m]), *needs[m: m + n]))
            return (*split_grad(grads[0], ctx.sizes, needs[:m]), *grads[1: 1 + n]) + (None,) * (len(needs) - m - n)
        free_kept = not _keeping_graph()
        sink = Recording(param_sink(ctx, 1, params))
        try:
            grads = chain_backward(grad_out, x0, params, specs, kept, means, invstds,  # type: ignore[arg-type]
                                   (any(needs[:m]), *needs[m: m + n]),
                                   free_grad_out=_sole_owner(grad_out, refs), free_kept=free_kept,
                                   rngs=ctx.rngs, sink=sink)
        finally:  # Note: [a backward that stops part way]
            if free_kept and (sink.accumulated or any(_freed(t) for t in (*kept.values(), *means, *invstds))):
                ctx.spent = True
        out = (*split_grad(grads[0], ctx.sizes, needs[:m]), *grads[1:])
        return out + (None,) * (len(needs) - len(out))


def _rebuild(specs: Sequence[ChainLayerSpec], means: Sequence[Tensor], invstds: Sequence[Tensor],
             rngs: Optional[Sequence[Tuple[RNGState, ...]]] = None) -> Any:
    """The chain from its inputs with differentiable reference ops (double backward)."""
    mean_of, invstd_of = _stat_maps(specs, means, invstds)
    off = param_offsets(specs)

    def rebuild(x0: Tensor, *params: Optional[Tensor]) -> Tensor:
        x = x0
        for i, spec in enumerate(specs):
            w, b, g, beta, tws = split_params(spec, params[off[i]: off[i + 1]])
            if spec.conv is not None and i > 0:
                x = spec.conv.pad_input(x)
            if spec.conv is None:
                x = head_input(x)
            if spec.bn is not None:
                if spec.bn.batch_stats:
                    rm = rv = None
                    bn = BNSpec(spec.bn.eps, True, 0.0)
                else:
                    rm, rv = mean_of[i], invstd_of[i].pow(-2) - spec.bn.eps
                    bn = spec.bn
                if spec.conv is not None and not spec.tail:  # an ordinary layer: the shared reference
                    x = conv_bn_act_reference(x, ConvBNTensors(w, b, g, beta, rm, rv), spec.conv, bn, spec.act)  # type: ignore[arg-type]
                    continue
            if spec.conv is not None:
                x = conv_forward(x, w, b, spec.conv)  # type: ignore[arg-type]
            if spec.bn is not None:
                x = F.batch_norm(x, rm, rv, g, beta, False, 0.0, spec.bn.eps) if rm is not None else (
                    F.batch_norm(x, None, None, g, beta, True, 0.0, spec.bn.eps))
            if spec.tail:
                x = tail_reference(x, spec.tail, tws, rngs[i] if rngs is not None else ())
            else:
                x = spec.act(x)
        return x

    return rebuild


def _keep(j: int, grad: Optional[Tensor]) -> Optional[Tensor]:
    return grad


def _layer_sizes(x0: ChainX0, params: Sequence[Optional[Tensor]],
                 specs: Sequence[ChainLayerSpec]) -> Tuple[List[int], List[int]]:
    """Element counts of each layer's conv output (a head's: its BN input) and (unpadded) input;
    ``x0`` arrives padded."""
    shape: Sequence[int] = x0.shape
    ys: List[int] = []
    xs: List[int] = []
    off = param_offsets(specs)
    for i, spec in enumerate(specs):
        if spec.conv is None:
            out = shape
        else:
            conv = spec.conv if i > 0 else dataclasses.replace(spec.conv, pre_pad=())
            out = conv_output_shape(shape, params[off[i]].shape, conv)  # type: ignore[union-attr]
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
