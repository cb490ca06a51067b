"""A per-sample-norm chain under ``torch.compile``: plain ops in a selective checkpoint.

# Note: [a norm chain under torch.compile]
# Dynamo cannot trace :class:`~convbn.autograd.norm_chain.NormChainFunction`'s backward (it
# runs ``torch.autograd.grad`` on a recomputed norm), and compile of the model's own modules
# keeps every convolution's output and more. As for BatchNorm chains (Note: [a chain inductor
# can see into] in ``chain_compiled.py``), the chain is written here as the very eager ops
# (the convolution, the norm row's ``compute``, the tail) inside ``torch.utils.checkpoint``
# with a selective policy that states the plan to the partitioner:
#
#     convolution whose output the plan keeps     MUST_SAVE       (the kept ``y``)
#     any other convolution                       MUST_RECOMPUTE  (recomputed in backward)
#     everything else (the norm, the tail)        PREFER_RECOMPUTE
#
# (BatchNorm chains' policy, ``chain_compiled.chain_contexts``: one flag per convolution, and
# torch's advisory about a ``context_fn`` under compile is dropped for it, as for theirs.)
#
# so what backward keeps is the chain input, the kept conv outputs and the parameters, as in
# the eager Function, and inductor fuses the norm and the tail into the kernels around them.
# The convolution is ``chain_compiled.chain_convolution``'s, as in BatchNorm chains: on the CPU
# the opaque ``convbn::conv``, so that inductor's layout optimisation saves no channels_last copy
# of a conv weight (Note: [a conv inductor cannot re-layout] in ``conv_op.py``).
# Nothing is per norm: the region calls the row's ``compute`` of :data:`convbn.functional.norms.NORMS`.
#
# Running statistics (an InstanceNorm with ``track_running_stats`` in training) move once: the
# row's ``compute`` updates *clones* of the buffers inside the region (a recompute updates new
# clones, thrown away), the region returns them and they are copied into the buffers outside.
#
# Autocast: the conv weights come cast by the caller (as autocast casts a conv module's); the
# region runs under the caller's autocast state, so the norm and the tail see autocast's own
# casts, and each convolution casts its input to its weight's dtype (as ``F.conv2d`` under
# autocast does). Float rounding: the compiler's, like compiled eager's.
"""
from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..functional.conv import channel_linear
from ..functional.tail import DropoutOp
from .chain_compiled import chain_contexts, chain_convolution
from .norm_chain import NormLayerSpec, Stats, _offsets, _post, _split, norm_chain_reference

__all__ = ["compilable_norm_chain", "norm_chain_compiled_apply"]

def compilable_norm_chain(specs: Sequence[NormLayerSpec]) -> bool:
    """Whether a chain's layers run in the region: every convolution a convolution, or a linear
    layer on the channels that ends the chain (its output is the region's: nothing for the policy
    to keep), not a linear layer on rows, which the policy would not see; and no training dropout
    in a tail (the region would draw its mask anew in its backward: the call runs eager's modules)."""
    last = len(specs) - 1
    if any(isinstance(op, DropoutOp) for s in specs for op in s.tail):
        return False
    return all(s.conv is None or not (s.conv.is_linear or s.conv.channel_linear)
               or (s.conv.channel_linear and i == last and s.norm is None and not s.tail and s.act.is_identity)
               for i, s in enumerate(specs))


def _body(specs: Sequence[NormLayerSpec], tracks: Sequence[bool]) -> Any:
    off = _offsets(specs)

    def run(x: Tensor, *args: Optional[Tensor]) -> Tuple[Tensor, ...]:
        params, running = args[: off[-1]], iter(args[off[-1]:])
        moved: List[Tensor] = []
        for i, spec in enumerate(specs):
            w, b, g, beta, tws = _split(spec, params[off[i]: off[i + 1]])
            if spec.conv is not None:
                c = spec.conv
                xin = (x if i == 0 else c.pad_input(x)).to(w.dtype)
                if c.channel_linear:  # the chain's end (compilable_norm_chain): F.linear over the channels
                    x = channel_linear(xin, w, b)
                    continue
                x = chain_convolution(xin)(xin, w, b, list(c.stride), list(c.padding), list(c.dilation), c.transposed,
                                           c.kernel_output_padding(), c.groups)
            stats: Stats = (None, None)
            if tracks[i]:  # clones the row's compute updates (a recompute updates new ones)
                stats = (next(running).clone(), next(running).clone())
                moved += [stats[0], stats[1]]
            elif spec.norm is not None and not spec.norm.use_input_stats:
                stats = (next(running), next(running))
            x = _post(spec, x, g, beta, tws, stats, update=tracks[i])
        return (x, *[t.detach() for t in moved])

    return run


def norm_chain_compiled_apply(x0: Tensor, params: Sequence[Optional[Tensor]], specs: Sequence[NormLayerSpec],
                              stats: Sequence[Stats]) -> Tensor:
    """Run a chain :func:`compilable_norm_chain` accepts as plain ops in a selective checkpoint
    (Note: [a norm chain under torch.compile]); running statistics updated once, as eager's."""
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x0, *params))):
        with torch.no_grad():  # nothing to keep: the eager ops, running statistics updated where given
            return norm_chain_reference(x0, params, specs, stats)
    tracks = [s.norm is not None and s.norm.use_input_stats and rm is not None and rv is not None
              for s, (rm, rv) in zip(specs, stats)]
    running = [t for s, (rm, rv), tr in zip(specs, stats, tracks)
               if tr or (s.norm is not None and not s.norm.use_input_stats) for t in (rm, rv)]
    keep = tuple(s.saves_y for s in specs if s.conv is not None and not s.conv.channel_linear) or (False,)
    out, *moved = checkpoint(_body(specs, tracks), x0, *params, *running, use_reentrant=False,
                             context_fn=functools.partial(chain_contexts, keep))
    with torch.no_grad():
        targets = [t for (rm, rv), tr in zip(stats, tracks) if tr for t in (rm, rv)]
        for old, new in zip(targets, moved):
            old.copy_(new)
    return out
