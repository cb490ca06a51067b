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

``frozen`` normalises with the running statistics (BN in eval mode while training),
so BN is folded into the conv weight on the fly and one convolution does the work.
Its activation derivative needs either the output (ReLU family: ``out > 0`` iff
``z > 0``; the output is usually kept by the next layer anyway) or, for smooth
activations, the pre-activation ``z``.

Running statistics are updated once, in forward (``native_batch_norm``); backward
only reads the saved ``mean``/``invstd``.

# Note: [double backward]
# The first-order backward uses native kernels under no-grad. When autograd asks for
# a differentiable backward (``create_graph=True``, i.e. grad mode is on inside
# backward) the Functions instead rebuild the layer from the saved *inputs* with the
# differentiable reference ops and differentiate that, so second derivatives flow
# through the conv, the batch statistics and the activation. Ordinary training never
# takes that branch.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd import Function

from ..functional.activations import Activation
from ..functional.batchnorm import BNSpec, bn_apply, bn_backward, bn_forward
from ..functional.conv import ConvSpec, conv_backward, conv_forward, scale_out_channels, sum_per_out_channel
from ..functional.fold import fold_bn_into_preceding
from ..functional.reference import conv_bn_act_reference
from .release import calibrate, free_storage, incoming_refs, keeping_graph, sole_owner
from .saving import load_tensors, save_tensors

__all__ = [
    "RecomputeConvFunction",
    "RecomputeBNFunction",
    "FrozenFunction",
    "bn_act_backward",
    "differentiable_backward",
]

# Positions of the differentiable inputs shared by the three Functions:
# forward(ctx, x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act)
_N_DIFF = 5


def bn_act_backward(
    grad_out: Tensor,
    y: Tensor,
    bn_weight: Optional[Tensor],
    mean: Tensor,
    invstd: Tensor,
    bn: BNSpec,
    act: Activation,
    mask: Tuple[bool, bool, bool],
    bn_bias: Optional[Tensor] = None,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Backward of ``out = act(BN(y))`` from ``y``: recompute ``z``, then BN backward.

    Returns:
        ``(grad_y, grad_bn_weight, grad_bn_bias)`` where ``mask`` asks.
    """
    if act.is_identity:
        return bn_backward(grad_out, y, bn_weight, mean, invstd, bn, mask)
    grad_z = act.backward_(grad_out, bn_apply(y, mean, invstd, bn_weight, bn_bias))
    return bn_backward(grad_z, y, bn_weight, mean, invstd, bn, mask)


def differentiable_backward(
    ctx: Any, grad_out: Tensor, inputs: Sequence[Optional[Tensor]], rebuild: Any,
    needs: Optional[Sequence[bool]] = None,
) -> Tuple[Optional[Tensor], ...]:
    """See Note: [double backward]. ``rebuild(*inputs)`` recomputes the output with
    differentiable ops; gradients are taken w.r.t. the inputs autograd asked for
    (``needs``, one flag per input; default ``ctx.needs_input_grad``)."""
    if any(getattr(spec, "process_group", None) is not None for spec in _bn_specs(ctx)):
        raise RuntimeError(
            "double backward (create_graph=True) through cross-process SyncBatchNorm statistics is not "
            "supported by convbn; run it without convert() or with a single process"
        )
    needs = ctx.needs_input_grad if needs is None else needs
    wanted = [i for i, t in enumerate(inputs) if t is not None and needs[i]]
    with torch.enable_grad():
        out = rebuild(*inputs)
        grads = torch.autograd.grad(
            out, [inputs[i] for i in wanted], grad_out, create_graph=True, allow_unused=True
        )
    result: List[Optional[Tensor]] = [None] * max(len(needs), len(inputs))
    for i, g in zip(wanted, grads):
        result[i] = g
    return tuple(result)


def _bn_specs(ctx: Any) -> List[BNSpec]:
    """Every BNSpec of a fused Function's ctx (single layer or chain)."""
    out: List[BNSpec] = []
    for spec in ctx.specs:
        if isinstance(spec, BNSpec):
            out.append(spec)
        elif hasattr(spec, "bn"):
            out.append(spec.bn)
    return out


def _param_mask(ctx: Any) -> Tuple[bool, bool, bool, bool, bool]:
    n = ctx.needs_input_grad
    return n[0], n[1], n[2], n[3], n[4]


def _finish(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """Pad the differentiable inputs' gradients with ``None`` for the specs."""
    return tuple(grads) + (None,) * (len(ctx.needs_input_grad) - len(grads))


def _batch_stat_forward(
    ctx: Any,
    keep_y: bool,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    bn_weight: Optional[Tensor],
    bn_bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    conv: ConvSpec,
    bn: BNSpec,
    act: Activation,
) -> Tensor:
    """Forward shared by the two recompute strategies; they differ in whether ``y`` is kept."""
    y = conv_forward(x, weight, bias, conv)
    z, mean, invstd = bn_forward(y, bn_weight, bn_bias, running_mean, running_var, bn)
    # recompute_conv: the whole point is that the conv output does not outlive forward
    save_tensors(ctx, (x, y if keep_y else None, weight, bias, bn_weight, bn_bias, mean, invstd))
    del y
    ctx.specs = (conv, bn, act)
    return act(z, inplace=True)


def _batch_stat_backward(ctx: Any, grad_out: Tensor, refs: int) -> Tuple[Optional[Tensor], ...]:
    x, y, weight, bias, bn_weight, bn_bias, mean, invstd = load_tensors(ctx)
    conv, bn, act = ctx.specs
    if torch.is_grad_enabled():
        rm, rv = (None, None) if bn.batch_stats else (mean, invstd.pow(-2) - bn.eps)
        return differentiable_backward(
            ctx, grad_out, (x, weight, bias, bn_weight, bn_bias), _rebuild_with_stats(ctx, rm, rv)
        )
    nx, nw, nb, ng, nbeta = _param_mask(ctx)
    kept = y is not None
    if y is None:
        y = conv_forward(x, weight, bias, conv)  # recompute_conv
    # Notes: [freeing the incoming gradient], [freeing kept tensors early] (autograd/release.py)
    engine_grad = grad_out if sole_owner(grad_out, refs) else None
    grad_z = grad_out if act.is_identity else act.backward_(grad_out, bn_apply(y, mean, invstd, bn_weight, bn_bias))
    del grad_out
    if engine_grad is not None and grad_z is not engine_grad:
        free_storage(engine_grad)
        engine_grad = None
    grad_y, g_gamma, g_beta = bn_backward(grad_z, y, bn_weight, mean, invstd, bn, (nx or nw or nb, ng, nbeta))
    del grad_z
    if engine_grad is not None:
        free_storage(engine_grad)
    if kept and not keeping_graph():
        free_storage(y)
    del y
    gx, gw, gb = conv_backward(grad_y, x, weight, conv, (nx, nw, nb))
    return _finish(ctx, gx, gw, gb, g_gamma, g_beta)


class RecomputeConvFunction(Function):
    """Conv -> BN -> act keeping only the conv input; the conv is recomputed in backward.

    This is the method of the PyTorch tutorial "Fusing Convolution and Batch Norm using
    Custom Function", generalised to every conv/BN option.
    ``apply(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act)``.
    """

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Tensor:  # type: ignore[override]
        calibrate()  # Note: [calibrating outside backward] in autograd/release.py
        return _batch_stat_forward(ctx, False, *args)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        refs = incoming_refs(grad_out)  # first: Note: [freeing the incoming gradient]
        return _batch_stat_backward(ctx, grad_out, refs)


class RecomputeBNFunction(Function):
    """Conv -> BN -> act keeping the conv input and output; BN + act recomputed element-wise.

    ``apply(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act)``.
    """

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Tensor:  # type: ignore[override]
        calibrate()  # Note: [calibrating outside backward] in autograd/release.py
        return _batch_stat_forward(ctx, True, *args)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        refs = incoming_refs(grad_out)  # first: Note: [freeing the incoming gradient]
        return _batch_stat_backward(ctx, grad_out, refs)


class FrozenFunction(Function):
    """Conv -> BN(running stats) -> act as ONE convolution with BN folded in on the fly.

    .. math::
        W' = s W,\\quad b' = s (b - \\mu) + \\beta,\\quad s = \\gamma / \\sqrt{\\sigma^2 + \\epsilon}

    Backward maps the folded weight's gradients back to ``W``, ``b``, ``gamma``, ``beta``:
    ``dW = s dW'``, ``db = s db'``, ``dbeta = db'``,
    ``dgamma = (sum(dW' * W) + db' (b - mu)) / sqrt(var + eps)``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        bn_weight: Optional[Tensor],
        bn_bias: Optional[Tensor],
        running_mean: Optional[Tensor],
        running_var: Optional[Tensor],
        conv: ConvSpec,
        bn: BNSpec,
        act: Activation,
    ) -> Tensor:
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
                ctx, grad_out, (x, weight, bias, bn_weight, bn_bias), _rebuild_with_stats(ctx, rm, rv)
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


def _rebuild_with_stats(ctx: Any, rm: Optional[Tensor], rv: Optional[Tensor]) -> Any:
    conv, bn, act = ctx.specs
    stats_bn = BNSpec(bn.eps, bn.batch_stats and rm is None, 0.0)

    def rebuild(x, w, b, g, beta):  # type: ignore[no-untyped-def]
        return conv_bn_act_reference(x, w, b, g, beta, rm, rv, conv, stats_bn, act)

    return rebuild
