"""``convbn.nn.SyncBatchNorm``: cross-process BatchNorm that also runs on CPU (gloo).

``nn.SyncBatchNorm`` only synchronises CUDA tensors, and ``DistributedDataParallel``
refuses CPU models containing one. :func:`convbn.convert` swaps each
``nn.SyncBatchNorm`` for this class, sharing the very same parameters and buffers
(same ``state_dict`` keys), so a converted model trains data-parallel on CPU or GPU;
fused Conv -> SyncBatchNorm layers reduce their statistics across the group in
forward and backward.

It also holds how a BatchNorm module's call is read -- :func:`bn_spec_from_module`,
:func:`bn_running_stats`, :func:`sync_group` -- which the fused modules share with it
(``nn.fused_conv_bn`` imports them from here: the dependency runs one way).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..autograd.batchnorm import BatchNormFunction
from ..functional.batchnorm import BNSpec

__all__ = ["SyncBatchNorm", "bn_running_stats", "bn_spec_from_module", "sync_group"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over N-D inputs with statistics reduced over ``process_group``.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as ``nn.SyncBatchNorm``.
        process_group: the group to reduce over (``None``: the default group).
        device, dtype: factory kwargs.

    Example:
        >>> bn = SyncBatchNorm.from_module(nn.SyncBatchNorm(8))
        >>> bn(torch.randn(4, 8, 5, 5)).shape  # no process group initialised: local stats
        torch.Size([4, 8, 5, 5])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Optional[Any] = None,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    @classmethod
    def from_module(cls, bn: nn.SyncBatchNorm) -> "SyncBatchNorm":
        """A ``SyncBatchNorm`` sharing ``bn``'s parameters and buffers (no copies)."""
        if not isinstance(bn, _BatchNorm):
            raise TypeError(f"expected a BatchNorm module, but got {type(bn).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats", "training"):
            setattr(new, attr, getattr(bn, attr))
        new.process_group = getattr(bn, "process_group", None)
        for name, p in bn._parameters.items():
            new._parameters[name] = p
        for name, b in bn._buffers.items():
            new._buffers[name] = b
        new._non_persistent_buffers_set = set(bn._non_persistent_buffers_set)
        return new

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        spec = bn_spec_from_module(self)
        if spec.process_group is None:
            # Nothing to synchronise (eval mode, no process group, or a group of one):
            # exactly nn.BatchNorm, double backward included. Check the batch first so a
            # failing call leaves num_batches_tracked alone.
            if spec.batch_stats and input.numel() // input.shape[1] <= 1:
                raise ValueError(
                    f"Expected more than 1 value per channel when training, got input size {input.size()}"
                )
            return super().forward(input)
        spec = bn_spec_from_module(self, advance=True)
        rm, rv = bn_running_stats(self)
        return BatchNormFunction.apply(input, self.weight, self.bias, rm, rv, spec)


def bn_running_stats(bn: _BatchNorm) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The running stats ``nn.BatchNorm`` would pass to ``F.batch_norm`` in its current mode."""
    if not bn.training or bn.track_running_stats:
        return bn.running_mean, bn.running_var
    return None, None


def bn_spec_from_module(bn: _BatchNorm, *, advance: bool = False) -> BNSpec:
    """The :class:`BNSpec` for one forward of ``bn``, mirroring ``_BatchNorm.forward``.

    Args:
        bn: the BatchNorm module.
        advance: increment ``num_batches_tracked`` as a training forward does (call only
            once the inputs have been checked, so a failing call changes no state).
    """
    factor = 0.0 if bn.momentum is None else float(bn.momentum)
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        if advance:
            bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            if torch.compiler.is_compiling():
                # keep the cumulative-average factor a tensor: no data-dependent Python float
                factor = 1.0 / (bn.num_batches_tracked + (0 if advance else 1)).to(torch.float64)  # type: ignore[assignment]
            else:
                factor = 1.0 / float(int(bn.num_batches_tracked) + (0 if advance else 1))
    batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
    return BNSpec(float(bn.eps), batch_stats, factor, sync_group(bn))


def sync_group(bn: _BatchNorm) -> Any:
    """The process group an ``nn.SyncBatchNorm`` reduces over in this call, or ``None``.

    Mirrors ``nn.SyncBatchNorm.forward``: statistics are synchronised in training
    mode when ``torch.distributed`` is initialised and the group has more than one
    process. Unlike ``nn.SyncBatchNorm``, CPU tensors (gloo) are supported.
    """
    if not isinstance(bn, (nn.SyncBatchNorm, SyncBatchNorm)) or not bn.training:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = bn.process_group or dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None
