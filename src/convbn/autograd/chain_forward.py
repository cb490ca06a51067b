"""The chain's forward without autograd: :func:`chain_forward`, which runs the layers and
returns what backward needs (the kept conv outputs, each BatchNorm's batch statistics, each
dropout's RNG state), and :func:`chain_forward_no_grad`, the same layers when nothing needs
gradients. :class:`~convbn.autograd.chain.ChainFunction` and the custom op
(``autograd/chain_op.py``) call the first; ``autograd/chain.py`` describes the chain, its flat
parameter layout and its backward, and re-exports both names.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..functional.batchnorm import bn_forward
from ..functional.conv import conv_forward
from ..functional.conv_bn_call import ConvBNTensors, conv_bn_act_no_grad as _forward_no_grad
from ..functional.tail import RNGState
from .chain_kernels import fused_layer_forward
from .chain_spec import ChainLayerSpec, ChainX0, head_input, param_offsets, split_params
from .chain_tail import tail_forward

__all__ = ["chain_forward", "chain_forward_no_grad"]


def _apply_tail(z: List[Tensor], spec: ChainLayerSpec, tws: Sequence[Tensor], owned: bool,
                capture: Optional[List[RNGState]]) -> Tensor:
    """The layer's tail on ``z``, a one-element list emptied here (see :func:`tail_forward`)."""
    if spec.tail:
        return tail_forward(z, spec.tail, tws, owned, capture=capture)
    return spec.act(z.pop(), inplace=owned)


def chain_forward(
    x0: ChainX0,
    params: Sequence[Optional[Tensor]],
    specs: Sequence[ChainLayerSpec],
    stats: Sequence[Tuple[Optional[Tensor], Optional[Tensor]]],
) -> Tuple[Tensor, List[int], List[Tensor], List[Tensor], List[Tensor], List[Tuple[RNGState, ...]]]:
    """Run the chain (no autograd); returns ``(out, kept_idx, kept_y, means, invstds, rngs)``:
    ``means``/``invstds`` for the layers with a BN, in order; ``rngs`` per layer the RNG
    state before each dropout of its tail (Note: [dropout in a chain])."""
    x = x0
    kept: List[Tensor] = []
    kept_idx: List[int] = []
    means: List[Tensor] = []
    invstds: List[Tensor] = []
    rngs: List[Tuple[RNGState, ...]] = []
    off = param_offsets(specs)
    for i, spec in enumerate(specs):
        w, b, g, beta, tws = split_params(spec, params[off[i]: off[i + 1]])
        rm, rv = stats[i]
        if spec.conv is None:
            y = head_input(x)  # a head normalises the chain input itself
        else:
            if i > 0:
                x = spec.conv.pad_input(x)  # constant pre-pad only (see FusedChain)
            y = conv_forward(x, w, b, spec.conv)  # type: ignore[arg-type]
        del x
        if spec.saves_y:
            kept.append(y)
            kept_idx.append(i)
        fused = None if spec.tail else fused_layer_forward(y, g, beta, rm, rv, spec.bn, spec.act)
        if fused is not None:  # the opt-in fused kernels (autograd/chain_kernels.py)
            x, mean, invstd = fused
            means.append(mean)
            invstds.append(invstd)
            rngs.append(())
            del y
            continue
        if spec.bn is not None:
            z, mean, invstd = bn_forward(y, g, beta, rm, rv, spec.bn)
            means.append(mean)
            invstds.append(invstd)
            owned = True
        else:
            z, owned = y, not spec.saves_y
        del y
        capture: List[RNGState] = []
        box = [z]
        del z
        x = _apply_tail(box, spec, tws, owned, capture)
        rngs.append(tuple(capture))
    return x, kept_idx, kept, means, invstds, rngs


def chain_forward_no_grad(
    x: Tensor,
    params: Sequence[Optional[Tensor]],
    specs: Sequence[ChainLayerSpec],
    stats: Sequence[Tuple[Optional[Tensor], Optional[Tensor]]],
) -> Tensor:
    """The chain's forward when nothing needs gradients (running stats still update; dropouts
    draw from the global RNG as eager's do)."""
    off = param_offsets(specs)
    with torch.no_grad():
        for i, spec in enumerate(specs):
            w, b, g, beta, tws = split_params(spec, params[off[i]: off[i + 1]])
            rm, rv = stats[i]
            if spec.conv is not None and i > 0:
                x = spec.conv.pad_input(x)
            if spec.conv is not None and spec.bn is not None and not spec.tail:
                x = _forward_no_grad(x, ConvBNTensors(w, b, g, beta, rm, rv), spec.conv, spec.bn, spec.act)  # type: ignore[arg-type]
                continue
            owned = False
            if spec.conv is None:
                x = head_input(x)
            else:
                x, owned = conv_forward(x, w, b, spec.conv), True  # type: ignore[arg-type]
            if spec.bn is not None:
                x, owned = bn_forward(x, g, beta, rm, rv, spec.bn)[0], True
            box = [x]
            del x
            x = _apply_tail(box, spec, tws, owned, None)
    return x
