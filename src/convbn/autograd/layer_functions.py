"""Single-layer fused Conv -> BatchNorm -> activation ``autograd.Function``s.

Each strategy is named by what it keeps for backward (saved bytes, SPEC §3):

==================  =====================================  ==========================
strategy            keeps (besides parameters, (C,) stats)  recomputes in backward
==================  =====================================  ==========================
``recompute_conv``  conv input ``x``                        conv, BN, activation
``recompute_bn``    conv input ``x``, conv output ``y``     BN + activation (element-wise)
``frozen``          conv input ``x`` (+ see below)          nothing
==================  =====================================  ==========================

Eager ``Conv -> BN -> act`` keeps ``x``, ``y`` and the activation output.

The two recompute strategies run a layer as a one-layer chain
(:class:`~convbn.autograd.chain.ChainFunction`; Note: [one recompute implementation]).

``frozen`` normalises with the running statistics (BN in eval mode while training),
so BN is folded into the conv weight on the fly and one convolution does the work.
Its activation derivative needs either the output (ReLU family: ``out > 0`` iff
``z > 0``; the output is usually kept by the next layer anyway) or, for smooth
activations, the pre-activation ``z``.

Running statistics are updated once, in forward (``native_batch_norm``); backward
only reads the saved ``mean``/``invstd``. A differentiable backward
(``create_graph=True``) rebuilds the layer with the reference ops (Note: [double
backward] in autograd/double_backward.py).

# Note: [one recompute implementation]
# A single ``recompute_bn`` / ``recompute_conv`` layer is the one-layer case of a chain
# (the chain input is the layer input, which both strategies keep), so it runs through
# ChainFunction: the recompute maths, the early freeing of the incoming gradient and of
# the kept conv output, and double backward exist once. Measured against the separate
# Functions this replaced (CPU, one thread, forward + backward of FusedConvBN2d-style
# calls, medians of interleaved repetitions): saved bytes, the live-tensor peak and
# the bytes kept under torch.compile identical, outputs and gradients bitwise equal,
# time within noise (-4% .. +2%) at (64,16,32,32)->32 and (8,64,56,56)->64 channels.
# Only a toy layer shows the chain's per-call Python bookkeeping: (2,4,8,8)->8, a
# 0.55 ms step, takes about 30 us (6%) longer. A one-layer chain skips the drop
# planning (choose_drops), which has nothing to decide for it. ``frozen`` stays a
# Function of its own: it folds BN into the conv weight and runs one convolution,
# which a chain layer (conv, then BN with running statistics) does not do.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd import Function

from ..functional.activations import Activation
from ..functional.batchnorm import BNSpec
from ..functional.conv import ConvSpec, conv_backward, conv_forward, scale_out_channels, sum_per_out_channel
from ..functional.fold import fold_bn_into_preceding
from ..functional.conv_bn_call import ConvBNTensors
from ..functional.reference import conv_bn_act_reference
from .chain import ChainFunction, ChainLayerSpec
from .double_backward import differentiable_backward
from .saving import load_tensors, save_tensors

__all__ = [
    "RecomputeConvFunction",
    "RecomputeBNFunction",
    "FrozenFunction",
]


def _param_mask(ctx: Any) -> Tuple[bool, bool, bool, bool, bool]:
    n = ctx.needs_input_grad
    return n[0], n[1], n[2], n[3], n[4]


def _finish(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """Pad the differentiable inputs' gradients with ``None`` for the specs."""
    return tuple(grads) + (None,) * (len(ctx.needs_input_grad) - len(grads))


class _OneLayerChain:
    """A recompute strategy's single layer as a one-layer chain (Note: [one recompute
    implementation]); ``apply`` takes the arguments of :class:`FrozenFunction`."""

    keep_y: bool

    @classmethod
    def apply(cls, x: Tensor, *args: Any) -> Tensor:
        """``apply(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act)``
        on a pre-padded ``x``; returns the activation output (its ``grad_fn`` a
        ``ChainFunctionBackward``)."""
        weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act = args
        spec = ChainLayerSpec(conv, bn, act, keep_y=cls.keep_y)
        return ChainFunction.apply(x, weight, bias, bn_weight, bn_bias, (spec,), ((running_mean, running_var),))


class RecomputeConvFunction(_OneLayerChain):
    """Conv -> BN -> act keeping only the conv input; the conv is recomputed in backward.

    Not a ``torch.autograd.Function`` (hence not exported from :mod:`convbn.autograd`):
    ``apply`` is a one-layer :class:`~convbn.autograd.chain.ChainFunction` call. Public
    entry point: ``convbn.conv_bn_act(..., strategy="recompute_conv")``.

    This is the method of the PyTorch tutorial "Fusing Convolution and Batch Norm using
    Custom Function", generalised to every conv/BN option.
    ``apply(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act)``.

    Example:
        >>> from convbn.functional.conv import make_conv_spec
        >>> x, w = torch.randn(4, 3, 8, 8, requires_grad=True), torch.randn(8, 3, 3, 3)
        >>> conv = make_conv_spec(2, (3, 3), 1, 0, 1, 1, "zeros")
        >>> out = RecomputeConvFunction.apply(x, w, None, None, None, None, None, conv,
        ...                                   BNSpec(1e-5, True, 0.1), Activation("relu"))
        >>> out.shape
        torch.Size([4, 8, 6, 6])
    """

    keep_y = False


class RecomputeBNFunction(_OneLayerChain):
    """Conv -> BN -> act keeping the conv input and output; BN + act recomputed element-wise.

    Not a ``torch.autograd.Function``: a one-layer :class:`~convbn.autograd.chain.ChainFunction`
    call, as :class:`RecomputeConvFunction`.

    ``apply(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act)``.
    """

    keep_y = True


class FrozenFunction(Function):
    """Conv -> BN(running stats) -> act as ONE convolution with BN folded in on the fly.

    ``apply(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act)``.

    .. math::
        W' = s W,\\quad b' = s (b - \\mu) + \\beta,\\quad s = \\gamma / \\sqrt{\\sigma^2 + \\epsilon}

    Backward maps the folded weight's gradients back to ``W``, ``b``, ``gamma``, ``beta``:
    ``dW = s dW'``, ``db = s db'``, ``dbeta = db'``,
    ``dgamma = (sum(dW' * W) + db' (b - mu)) / sqrt(var + eps)``.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, *args: Any) -> Tensor:  # type: ignore[override]
        """``args``: the :class:`~convbn.functional.conv_bn_call.ConvBNTensors` fields one by one
        (autograd tracks only tensors passed as arguments), then ``conv, bn, act``."""
        weight, bias, bn_weight, bn_bias, running_mean, running_var = args[:6]
        conv: ConvSpec
        bn: BNSpec
        act: Activation
        conv, bn, act = args[6:]
        if running_mean is None or running_var is None:
            raise ValueError("the frozen strategy normalises with running statistics, but the BatchNorm has none")
        rm, rv = running_mean.clone(), running_var.clone()
        w_f, b_f = fold_bn_into_preceding(weight, bias, rm, rv, bn.eps, bn_weight, bn_bias,
                                          transposed=conv.transposed, groups=conv.groups)
        z = conv_forward(x, w_f, b_f, conv)
        if act.is_identity:
            kept: Optional[Tensor] = None
            out = z
        elif act.output_derivable:
            out = act(z, inplace=True)
            kept = out  # derivative from the output; usually kept by the next layer too
        else:
            kept = z
            out = act(z)
        save_tensors(ctx, (x, weight, bias, bn_weight, bn_bias, rm, rv, kept))
        ctx.specs = (conv, bn, act)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        x, weight, bias, bn_weight, bn_bias, rm, rv, kept = load_tensors(ctx)
        conv, bn, act = ctx.specs
        if torch.is_grad_enabled():
            return differentiable_backward(
                ctx, grad_out, (x, weight, bias, bn_weight, bn_bias), _rebuild_frozen(ctx, rm, rv)
            )
        nx, nw, nb, ng, nbeta = _param_mask(ctx)
        # kept: the output for the ReLU family (its sign tests agree with z's), else z itself
        grad_z = grad_out if act.is_identity else act.backward(grad_out, kept)
        r = torch.rsqrt(rv + bn.eps)
        s = r if bn_weight is None else r * bn_weight
        w_f = scale_out_channels(weight, s.to(weight.dtype), conv)
        any_param = nw or nb or ng or nbeta
        gx, gw_f, gb_f = conv_backward(grad_z, x, w_f, conv, (nx, nw or ng, any_param))
        gw = gb = g_gamma = g_beta = None
        if nw:
            gw = scale_out_channels(gw_f, s.to(gw_f.dtype), conv)
        if nb:
            gb = gb_f * s.to(gb_f.dtype)
        if ng:
            centred = -rm if bias is None else bias - rm
            g_s = sum_per_out_channel(gw_f * weight, conv) + gb_f * centred
            g_gamma = (g_s * r).to(bn_weight.dtype)
        if nbeta:
            g_beta = gb_f.to(bn_bias.dtype)
        return _finish(ctx, gx, gw, gb, g_gamma, g_beta)


def _rebuild_frozen(ctx: Any, rm: Tensor, rv: Tensor) -> Any:
    """The frozen layer with differentiable reference ops, normalising with the running
    statistics seen in forward (Note: [double backward])."""
    conv, bn, act = ctx.specs
    stats_bn = BNSpec(bn.eps, False, 0.0)

    def rebuild(x, w, b, g, beta):  # type: ignore[no-untyped-def]
        return conv_bn_act_reference(x, ConvBNTensors(w, b, g, beta, rm, rv), conv, stats_bn, act)

    return rebuild
