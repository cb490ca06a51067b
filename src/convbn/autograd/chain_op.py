"""The chain as an opaque ``torch.library`` custom op, for ``torch.compile``.

# Note: [why a custom op under torch.compile]
# Dynamo can trace ``ChainFunction`` into the graph, but AOTAutograd then sees the
# chain's forward and its backward as one joint graph: the convolution a
# ``recompute_conv`` layer recomputes in backward is the same computation as in
# forward, so the partitioner keeps its output instead (convolutions are never
# recomputed by its policy) and the compiled model keeps *more* than the eager
# converted one. Behind a custom op the chain is opaque: what backward gets is exactly
# what ``setup_context`` saves (the chain input, kept conv outputs, per-channel
# statistics), so compiled and uncompiled converted models keep the same bytes.
#
# Static per-chain structure (conv geometry, activations, tails) cannot be an op
# argument, so it is found by a string key (autograd/chain_structure.py: owned by the
# chains that have it, never a table that only grows); the plan (keep_y, may_drop)
# travels as flag lists; the per-call momentum
# factors travel as a tensor so ``momentum=None`` never forces a recompile. A tail with
# a dropout in training (p > 0) is not run through the op: its RNG replay (Note: [dropout
# in a chain]) reads and restores the global generators, which a compiled graph does not
# reproduce exactly; FusedChain runs such a chain as eager modules under torch.compile.
"""
# no `from __future__ import annotations`: torch 2.5's custom_op reads the annotations of the
# ops below as objects (it cannot resolve `Tuple[...]` given as a string)

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .._compat import functorch_config
from ..functional.batchnorm import BNSpec
from ..functional.conv import conv_output_shape
from .chain import ChainLayerSpec, chain_backward, chain_forward, param_offsets
from .chain_input import ChainInput, concat_shape, split_grad
from .chain_structure import register_chain, structure_of
from .chain_layout import conform, dense_strides, empty_strided_like, layer_formats, memory_format_of, strides_for

__all__ = ["register_chain", "chain_op_apply"]

def _specs(key: str, factors: Optional[Tensor], keep_y: Sequence[bool], batch_stats: Sequence[bool],
           may_drop: Sequence[bool]) -> List[ChainLayerSpec]:
    """The layer specs of one call: the static structure under ``key`` and the whole per-call
    plan (``keep_y``, ``may_drop``) as the op's flag lists carry it."""
    momenta = factors.tolist() if factors is not None else [0.0] * len(keep_y)
    return [ChainLayerSpec(conv, None if eps is None else BNSpec(eps, bs, float(m)), act, ky, tail, md)
            for (conv, act, eps, tail), m, ky, bs, md in zip(structure_of(key).layers, momenta, keep_y, batch_stats,
                                                             may_drop)]


def _optional(params: Sequence[Tensor], present: Sequence[bool]) -> List[Optional[Tensor]]:
    """Custom ops take ``Tensor[]`` (``Tensor?[]`` gets no autograd): empty tensors stand for ``None``."""
    return [p if h else None for p, h in zip(params, present)]


def _stats(running: Sequence[Tensor], has_stats: Sequence[bool]) -> List[Tuple[Optional[Tensor], Optional[Tensor]]]:
    it = iter(running)
    return [(next(it), next(it)) if h else (None, None) for h in has_stats]


@torch.library.custom_op("convbn::chain_fwd", mutates_args=())
def _chain_fwd(
    pieces: List[Tensor], params: List[Tensor], running: List[Tensor], factors: Tensor, key: str,
    keep_y: List[bool], batch_stats: List[bool], has_stats: List[bool], present: List[bool],
    may_drop: List[bool],
) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
    # functional (an autograd formula needs it): the updated running stats are outputs,
    # copied into the buffers by the caller.
    new_running = [t.clone() for t in running]
    specs, stats = _specs(key, factors, keep_y, batch_stats, may_drop), _stats(new_running, has_stats)
    with torch.no_grad():
        out, kept_idx, kept, means, invstds, _ = chain_forward(_x0(pieces), _optional(params, present), specs, stats)
    # Note: [the chain ops' output strides] in autograd/chain_layout.py
    fmts = _formats(pieces, params, specs)
    kept = [conform(y, strides_for(y.shape, fmts[i])) for i, y in zip(kept_idx, kept)]
    return conform(out, strides_for(out.shape, fmts[-1])), [*kept, *means, *invstds], new_running


def _formats(pieces: Sequence[Tensor], params: Sequence[Tensor], specs: Sequence[ChainLayerSpec]) -> List[torch.memory_format]:
    off = param_offsets(specs)
    return layer_formats(pieces[0], [params[off[i]] if s.conv is not None else None for i, s in enumerate(specs)])


def _grad_x_strides(pieces: Sequence[Tensor]) -> Tuple[Any, ...]:
    """Strides of the chain input's gradient (Note: [the chain ops' output strides])."""
    if len(pieces) == 1:
        return dense_strides(pieces[0])
    return strides_for(concat_shape(pieces), memory_format_of(pieces[0]))


def _x0(pieces: Sequence[Tensor]) -> Any:
    """The chain input: the one tensor, or a head's pieces (Note: [a head over a concatenation])."""
    return pieces[0] if len(pieces) == 1 else ChainInput(pieces)


def _stat_dtype(x: Tensor, running: Optional[Tensor], batch_stats: bool) -> torch.dtype:
    if not batch_stats and running is not None:
        return running.dtype
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@_chain_fwd.register_fake
def _(pieces: List[Tensor], params: List[Tensor], running: List[Tensor], factors: Tensor, key: str,
      keep_y: List[bool], batch_stats: List[bool], has_stats: List[bool], present: List[bool],
      may_drop: List[bool]) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
    specs = _specs(key, None, keep_y, batch_stats, may_drop)
    x0 = pieces[0]  # dtype and device (pieces share them); the shape is the concatenation's
    fmts = _formats(pieces, params, specs)
    shape: Sequence[int] = concat_shape(pieces)
    kept, means, invstds = [], [], []
    off = param_offsets(specs)
    it = iter(running)
    for i, s in enumerate(specs):
        if s.conv is not None:
            w = params[off[i]]
            if i > 0 and s.conv.pre_pad:
                shape = list(shape)
                for j in range(len(s.conv.pre_pad) // 2):
                    shape[-1 - j] += s.conv.pre_pad[2 * j] + s.conv.pre_pad[2 * j + 1]
            shape = conv_output_shape(shape, w.shape, s.conv)  # type: ignore[union-attr]
        rm = next(it) if has_stats[i] else None
        if has_stats[i]:
            next(it)
        if s.saves_y:
            kept.append(empty_strided_like(x0, shape, strides_for(shape, fmts[i])))
        if s.bn is not None:
            dt = _stat_dtype(x0, rm, s.bn.batch_stats)
            means.append(x0.new_empty((shape[1],), dtype=dt))
            invstds.append(x0.new_empty((shape[1],), dtype=dt))
    out = empty_strided_like(x0, shape, strides_for(shape, fmts[-1]))
    return out, [*kept, *means, *invstds], [torch.empty_like(t) for t in running]


@torch.library.custom_op("convbn::chain_bwd", mutates_args=())
def _chain_bwd(
    grad_out: Tensor, pieces: List[Tensor], params: List[Tensor], saved: List[Tensor],
    key: str, keep_y: List[bool], batch_stats: List[bool], needs: List[bool], present: List[bool],
    may_drop: List[bool],
) -> List[Tensor]:
    specs = _specs(key, None, keep_y, batch_stats, may_drop)  # backward never touches running stats
    kept_idx = [i for i, s in enumerate(specs) if s.saves_y]
    k, n_kept = sum(s.bn is not None for s in specs), len(kept_idx)
    kept = dict(zip(kept_idx, saved[:n_kept]))
    means, invstds = saved[n_kept: n_kept + k], saved[n_kept + k:]
    # ``needs``: the chain input's flag, then the parameters'; the input's gradient comes back
    # whole (returns may not alias each other) and is split into the pieces' by the caller
    grads = chain_backward(grad_out, _x0(pieces), _optional(params, present), specs, kept, means, invstds, needs)
    # custom ops return tensors: an empty tensor stands for "no gradient"; each gradient in
    # the layout the fake kernel says (Note: [the chain ops' output strides])
    strides = [_grad_x_strides(pieces), *[dense_strides(p) for p in params]]
    return [conform(g, st) if g is not None else pieces[0].new_empty(0) for g, st in zip(grads, strides)]


@_chain_bwd.register_fake
def _(grad_out: Tensor, pieces: List[Tensor], params: List[Tensor], saved: List[Tensor],
      key: str, keep_y: List[bool], batch_stats: List[bool], needs: List[bool], present: List[bool],
      may_drop: List[bool]) -> List[Tensor]:
    x0 = pieces[0]
    shapes = [concat_shape(pieces), *[p.shape for p in params]]
    strides = [_grad_x_strides(pieces), *[dense_strides(p) for p in params]]
    return [empty_strided_like(x0, sh, st, dtype=t.dtype) if n else x0.new_empty(0)
            for t, sh, st, n in zip([x0, *params], shapes, strides, needs)]


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    pieces, params, running, factors, key, keep_y, batch_stats, has_stats, present, may_drop = inputs
    _, saved, _ = output
    ctx.save_for_backward(*pieces, *[p for p, h in zip(params, present) if h], *saved)
    ctx.n_pieces = len(pieces)
    ctx.present = present
    ctx.key, ctx.keep_y, ctx.batch_stats, ctx.may_drop = key, keep_y, batch_stats, may_drop
    ctx.structure = structure_of(key)  # held until backward: the key's entry stays alive with it
    ctx.n_running, ctx.n_layers = len(running), len(keep_y)
    ctx.n_saved = len(saved)
    ctx.needs = [p.requires_grad for p in pieces] + [h and p.requires_grad for p, h in zip(params, present)]


def _backward(ctx: Any, grad_out: Tensor, grad_saved: Any, grad_running: Any) -> Tuple[Any, ...]:
    m = ctx.n_pieces
    pieces, rest = list(ctx.saved_tensors[:m]), ctx.saved_tensors[m:]
    it = iter(rest[: len(rest) - ctx.n_saved])
    params = [next(it) if p else pieces[0].new_empty(0) for p in ctx.present]
    saved = list(rest[len(rest) - ctx.n_saved:])
    needs = [any(ctx.needs[:m]), *ctx.needs[m:]]
    grads = _chain_bwd(grad_out, pieces, params, saved, ctx.key, ctx.keep_y, ctx.batch_stats, needs, ctx.present,
                       ctx.may_drop)
    piece_grads = split_grad(grads[0] if needs[0] else None, [int(p.shape[1]) for p in pieces], ctx.needs[:m])
    out = [g if n else None for g, n in zip(grads[1:], ctx.needs[m:])]
    # one entry per op argument: pieces, params, running stats, factors, key and the flag lists
    return piece_grads, out, [None] * ctx.n_running, None, None, None, None, None, None, None


torch.library.register_autograd("convbn::chain_fwd", _backward, setup_context=_setup_context)


def _partitioner_may_recompute_ops() -> bool:
    """Whether AOTAutograd's partitioner may recompute an op outside its allowlist (a custom op)."""
    cfg = functorch_config()
    return (float(getattr(cfg, "activation_memory_budget", 1.0)) < 1.0 or bool(getattr(cfg, "aggressive_recomputation", False))
            or not bool(getattr(cfg, "ban_recompute_not_in_allowlist", True)))


def _must_save_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.convbn.chain_fwd.default else CheckpointPolicy.PREFER_RECOMPUTE


def _must_save_chain() -> Any:
    return create_selective_checkpoint_contexts(_must_save_policy)


def chain_op_apply(
    key: str,
    x0: Union[Tensor, Sequence[Tensor]],
    params: Sequence[Optional[Tensor]],
    specs: Sequence[ChainLayerSpec],
    stats: Sequence[Tuple[Optional[Tensor], Optional[Tensor]]],
) -> Tensor:
    """Run the chain registered under ``key`` through the custom op (what
    :class:`convbn.nn.FusedChain` does while compiling); ``x0`` is the chain input, or a
    head chain's pieces concatenated along dim 1 (Note: [a head over a concatenation])."""
    pieces = [x0] if isinstance(x0, Tensor) else list(x0)
    x0 = pieces[0]
    has_stats = [rm is not None and rv is not None for rm, rv in stats]
    running = [t for (rm, rv), h in zip(stats, has_stats) if h for t in (rm, rv)]  # type: ignore[misc]
    # one device for all factors: ``momentum=None`` gives a tensor on the buffers' device
    factors = torch.stack([
        s.bn.momentum.to(device=x0.device, dtype=torch.float64) if s.bn is not None and isinstance(s.bn.momentum, Tensor)
        else torch.tensor(float(s.bn.momentum) if s.bn is not None else 0.0, dtype=torch.float64, device=x0.device)
        for s in specs
    ])
    present = [p is not None for p in params]
    dense = [p if p is not None else x0.new_empty(0) for p in params]
    # the whole plan travels as flag lists (keep_y, may_drop): the op rebuilds the specs from them
    flags = ([s.keep_y for s in specs], [s.bn is not None and s.bn.batch_stats for s in specs], has_stats, present,
             [s.may_drop for s in specs])

    def run(pieces: List[Tensor], dense: List[Tensor], running: List[Tensor], factors: Tensor) -> Any:
        return _chain_fwd(pieces, dense, running, factors, key, *flags)

    # Note: [never recomputed by the partitioner] To the partitioner an opaque op is
    # cheap to re-run, so it may recompute the whole chain in backward instead of keeping
    # its outputs (every convolution twice: the opposite of the plan). A selective
    # checkpoint policy marks the op MUST_SAVE; everything else stays the partitioner's call.
    # (eager calls of the op, in tests, need no policy: nothing partitions them). Only a
    # partitioner that may recompute ops outside its allowlist (an activation memory budget
    # below 1, or aggressive recomputation) needs it: by default a custom op is never
    # recomputed, and the checkpoint region would only add a warning about ``context_fn``.
    if torch.compiler.is_compiling() and _partitioner_may_recompute_ops():
        out, _, new_running = checkpoint(
            run, pieces, dense, running, factors, use_reentrant=False, context_fn=_must_save_chain
        )
    else:
        out, _, new_running = run(pieces, dense, running, factors)
    with torch.no_grad():
        for old, new in zip(running, new_running):
            old.copy_(new)
    return out
