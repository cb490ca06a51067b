"""BatchNorm pieces of a fused layer: statistics, normalisation and its backward.

.. math::
    z = \\gamma \\, \\frac{y - \\mu}{\\sqrt{\\sigma^2 + \\epsilon}} + \\beta

with ``mu``/``sigma^2`` the biased per-channel batch statistics when normalising with
batch statistics (training, or no running stats), or the running statistics otherwise.
Training updates ``running_mean``/``running_var`` (unbiased variance) exactly once, in
forward, through ``native_batch_norm``; every later use of the statistics (recompute,
backward) reads the saved ``mean``/``invstd`` instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["BNSpec", "bn_forward", "bn_apply", "bn_backward", "channel_view"]

aten = torch.ops.aten


@dataclass(frozen=True)
class BNSpec:
    """How a fused layer normalises.

    Attributes:
        eps: added to the variance inside the square root.
        batch_stats: normalise with the batch's statistics (``True`` in training, or
            whenever there are no running stats); otherwise with the running stats.
        momentum: exponential-average factor for the running-stat update (the value
            ``nn.BatchNorm`` computes, ``1/num_batches_tracked`` for ``momentum=None``).
        process_group: when set, batch statistics (and their gradients) are reduced over
            this ``torch.distributed`` process group, as ``nn.SyncBatchNorm`` does.
    """

    eps: float = 1e-5
    batch_stats: bool = True
    momentum: Any = 0.1  # a float, or a 0-d tensor under torch.compile with momentum=None
    process_group: Any = field(default=None, compare=False, hash=False)


def channel_view(t: Tensor, ndim: int) -> Tensor:
    """``(C,)`` -> ``(1, C, 1, ...)`` broadcastable against an ``ndim``-D activation."""
    return t.reshape(1, -1, *([1] * (ndim - 2)))


def bn_forward(
    y: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    spec: BNSpec,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Normalise ``y``; returns ``(z, mean, invstd)`` (``mean``/``invstd`` are ``(C,)`` float).

    With batch statistics the running stats (if given) are updated in place, once.
    """
    if spec.batch_stats and spec.process_group is not None:
        return _sync_forward(y, weight, bias, running_mean, running_var, spec)
    if spec.batch_stats and isinstance(spec.momentum, Tensor):
        # momentum=None under torch.compile: the factor 1/num_batches_tracked is a tensor.
        z, mean, invstd = torch.native_batch_norm(y, weight, bias, None, None, True, 0.0, spec.eps)
        if running_mean is not None and running_var is not None:
            n = y.numel() // y.shape[1]
            var = (invstd.double().pow(-2) - spec.eps) * (n / max(n - 1, 1))
            with torch.no_grad():
                running_mean.lerp_(mean.to(running_mean.dtype), spec.momentum.to(running_mean.dtype))
                running_var.lerp_(var.to(running_var.dtype), spec.momentum.to(running_var.dtype))
        return z, mean, invstd
    if spec.batch_stats and bias is not None and uses_cudnn(y, weight, spec):
        z, mean, invstd, _ = aten.cudnn_batch_norm(y, weight, bias, running_mean, running_var, True, spec.momentum, spec.eps)
        return z, mean, invstd
    if spec.batch_stats:
        z, mean, invstd = torch.native_batch_norm(
            y, weight, bias, running_mean, running_var, True, spec.momentum, spec.eps
        )
        return z, mean, invstd
    if running_mean is None or running_var is None:
        raise ValueError("normalising without batch statistics needs running_mean and running_var")
    mean = running_mean.clone()
    invstd = torch.rsqrt(running_var + spec.eps)
    return bn_apply(y, mean, invstd, weight, bias), mean, invstd


class _EmptyPerDevice(dict):
    """An empty uint8 tensor per device: cuDNN's (unused) reserve space argument."""

    def __missing__(self, device: torch.device) -> Tensor:
        t = self[device] = torch.empty(0, dtype=torch.uint8, device=device)
        return t


_EMPTY = _EmptyPerDevice()


def uses_cudnn(y: Tensor, weight: Optional[Tensor], spec: BNSpec) -> bool:
    """Whether training-mode batch norm of ``y`` runs on cuDNN's kernels, as eager's would.

    # Note: [cuDNN batch norm]
    # Eager ``F.batch_norm`` on CUDA dispatches to cuDNN when it can (about twice as fast as
    # ``native_batch_norm`` on an H100 for ResNet shapes, forward and backward); the fused
    # layers follow the same choice so they are as fast and give eager's bits. The
    # conditions are those of ATen's backend selection for the cases convbn meets, with
    # one restriction: channels-last inputs stay on the native kernels, because cuDNN's
    # persistent mode for them needs a reserve buffer between forward and backward (the
    # non-persistent modes used here need none: the backward gets an empty one). (The
    # forward also needs a bias; the backward does not, and gives the same gradient.)
    """
    return (
        y.is_cuda and y.dim() >= 3 and weight is not None
        and torch.backends.cudnn.enabled and torch.backends.cudnn.is_available()
        and y.dtype in (torch.float32, torch.float64, torch.float16) and weight.dtype != torch.bfloat16
        and (y.dtype != torch.float16 or weight.dtype == torch.float32)
        and y.is_contiguous() and y.shape[0] <= 880801 and y.numel() < 2**31 - 1
        and spec.eps >= 1e-5 and spec.process_group is None and not isinstance(spec.momentum, Tensor)
    )


def bn_apply(y: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """Recompute ``z`` from ``y`` and saved statistics: ``z = y * a + (beta - mean * a)``, ``a = gamma * invstd``."""
    scale = invstd if weight is None else invstd * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    scale = channel_view(scale.to(y.dtype), y.dim())
    shift = channel_view(shift.to(y.dtype), y.dim())
    return torch.addcmul(shift, y, scale)


def bn_backward(
    grad_z: Tensor,
    y: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    invstd: Tensor,
    spec: BNSpec,
    mask: Tuple[bool, bool, bool],
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(grad_y, grad_gamma, grad_beta)`` with ``aten.native_batch_norm_backward``.

    (Its ``out=`` overload computes into a temporary and copies, so writing ``grad_y``
    over ``grad_z`` would save no memory and cost a copy: measured, not used.)

    With batch statistics this includes the terms through ``mean`` and ``var``:
    ``grad_y = gamma * invstd * (g - mean(g) - xhat * mean(g * xhat))``; with running
    statistics it is the plain per-channel scale ``gamma * invstd * g``.
    """
    if spec.batch_stats and spec.process_group is not None:
        out = _sync_backward(grad_z, y, weight, mean, invstd, spec, mask)
    elif spec.batch_stats and uses_cudnn(y, weight, spec):
        out = aten.cudnn_batch_norm_backward(y, grad_z.contiguous(), weight, None, None, mean, invstd, spec.eps, _EMPTY[y.device])
    elif spec.batch_stats:
        out = aten.native_batch_norm_backward(
            grad_z, y, weight, None, None, mean, invstd, True, spec.eps, list(mask)
        )
    else:
        # Running statistics are constants: BN is the per-channel affine map a*y + c.
        out = _affine_backward(grad_z, y, weight, mean, invstd, mask)
    gy, gw, gb = out
    return (gy if mask[0] else None), (gw if mask[1] else None), (gb if mask[2] else None)


def _affine_backward(
    grad_z: Tensor,
    y: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    invstd: Tensor,
    mask: Tuple[bool, bool, bool],
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Backward of ``z = gamma * (y - mean) * invstd + beta`` with constant ``mean``/``invstd``."""
    dims: List[int] = [0] + list(range(2, y.dim()))
    acc = torch.promote_types(grad_z.dtype, torch.float32)
    gy = gw = gb = None
    if mask[0]:
        scale = invstd if weight is None else invstd * weight
        gy = grad_z * channel_view(scale.to(grad_z.dtype), y.dim())
    if mask[1]:
        xhat = (y.to(acc) - channel_view(mean.to(acc), y.dim())) * channel_view(invstd.to(acc), y.dim())
        gw = (grad_z.to(acc) * xhat).sum(dims).to(mean.dtype)
    if mask[2]:
        gb = grad_z.sum(dims, dtype=acc).to(mean.dtype)
    return gy, gw, gb


# --------------------------------------------------------------------------- cross-process


def _reduce_dims(y: Tensor) -> List[int]:
    return [0] + list(range(2, y.dim()))


def _sync_forward(
    y: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    spec: BNSpec,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Batch statistics over every process of ``spec.process_group`` (SyncBatchNorm semantics).

    Two all-reduces, both exact: ``[count, sum(y)]`` gives the global mean, then
    ``sum((y - mean)^2)`` gives the global biased variance (no ``E[y^2] - mean^2``
    cancellation). Running stats take the unbiased global variance.
    """
    import torch.distributed as dist

    dims = _reduce_dims(y)
    acc = torch.promote_types(y.dtype, torch.float32)
    local_count = y.numel() // y.shape[1]
    packed = torch.cat([y.new_full((1,), float(local_count), dtype=acc), y.sum(dims, dtype=acc)])
    dist.all_reduce(packed, group=spec.process_group)
    count, mean = packed[0], packed[1:] / packed[0]
    centred = y.to(acc) - channel_view(mean, y.dim())
    sq = centred.square().sum(dims)
    del centred
    dist.all_reduce(sq, group=spec.process_group)
    var = sq / count
    invstd = torch.rsqrt(var + spec.eps)
    n = int(count.item())
    if n <= 1:
        raise ValueError(f"Expected more than 1 value per channel across processes when training, got {n}")
    if running_mean is not None and running_var is not None:
        m = spec.momentum
        with torch.no_grad():
            running_mean.mul_(1 - m).add_(mean.to(running_mean.dtype), alpha=m)
            running_var.mul_(1 - m).add_((var * (n / (n - 1))).to(running_var.dtype), alpha=m)
    return bn_apply(y, mean, invstd, weight, bias), mean, invstd


def _sync_backward(
    grad_z: Tensor,
    y: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    invstd: Tensor,
    spec: BNSpec,
    mask: Tuple[bool, bool, bool],
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    r"""Backward of :func:`_sync_forward`.

    .. math::
        \frac{\partial L}{\partial y} = \gamma\,\sigma^{-1}\Big(g - \frac{\sum g}{N}
        - \hat y \frac{\sum g \hat y}{N}\Big)

    with the two sums all-reduced over the group and ``N`` the global count. The
    returned ``gamma``/``beta`` gradients are this process's share (summed over its
    own samples); data-parallel training averages them across processes, as with
    ``nn.SyncBatchNorm``.
    """
    import torch.distributed as dist

    dims = _reduce_dims(y)
    acc = torch.promote_types(grad_z.dtype, torch.float32)
    xhat = (y.to(acc) - channel_view(mean.to(acc), y.dim())) * channel_view(invstd.to(acc), y.dim())
    g = grad_z.to(acc)
    sum_g, sum_gx = g.sum(dims), (g * xhat).sum(dims)
    gw = sum_gx.to(mean.dtype) if mask[1] else None
    gb = sum_g.to(mean.dtype) if mask[2] else None
    gy = None
    if mask[0]:
        c = y.shape[1]
        packed = torch.cat([sum_g, sum_gx, sum_g.new_full((1,), float(y.numel() // c))])
        dist.all_reduce(packed, group=spec.process_group)
        n = packed[-1]
        mean_g, mean_gx = packed[:c] / n, packed[c:2 * c] / n
        scale = invstd.to(acc) if weight is None else invstd.to(acc) * weight.to(acc)
        gy = (g - channel_view(mean_g, y.dim()) - xhat * channel_view(mean_gx, y.dim())) * channel_view(scale, y.dim())
        gy = gy.to(grad_z.dtype)
    return gy, gw, gb
