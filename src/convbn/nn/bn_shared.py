"""A second reader of a BatchNorm's output: the same batch norm, without a second update.

Note: [a pre-activation head shared by several convs]
    A pre-activation block that downsamples reads ``z = act(BN(x))`` with two convs (the
    body's first conv and the projection shortcut). A fused head chain (BN -> act -> conv)
    keeps only ``x`` and rebuilds ``z`` in backward, but it has one conv. Each further conv
    gets a head of its own over the same ``x`` whose BN is a :class:`SharedBatchStats` of
    the first: in training it normalises with the *batch* statistics of ``x`` (the same
    values the first computes) and leaves the running statistics and
    ``num_batches_tracked`` alone (the first head updates them once, as eager does); in
    eval mode it reads the running statistics. Backward is exact: BatchNorm's backward is
    linear in the upstream gradient, so the heads' gradients for ``x``, ``weight`` and
    ``bias``, summed by autograd, are eager's for ``dz = dz_1 + dz_2`` (batch statistics
    included). The cost is a second reduction over ``x``; the saving is ``z``, which no
    conv keeps any more.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SharedBatchStats", "BatchNormOfSource"]


class BatchNormOfSource(_BatchNorm):
    """Base of the BatchNorms that compute with another BatchNorm's tensors: it holds the
    source unregistered (no ``state_dict`` keys, no tensors of its own), takes its mode from
    the source (``model.train()`` reaches it through the source) and checks inputs as the
    source does. Subclasses say which attributes they read from the source."""

    def __init__(self, source: _BatchNorm, source_name: str = "") -> None:
        if not isinstance(source, _BatchNorm):
            raise TypeError(f"{type(self).__name__} expects a _BatchNorm source, but got {type(source).__name__}")
        nn.Module.__init__(self)
        object.__setattr__(self, "_source", source)  # not a submodule: no state_dict keys
        self.source_name = source_name

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "training":  # the mode is the source's (model.train() sets it there)
            return
        super().__setattr__(name, value)

    def _check_input_dim(self, input: Tensor) -> None:
        object.__getattribute__(self, "_source")._check_input_dim(input)


class SharedBatchStats(BatchNormOfSource):
    """The batch norm of ``source`` (a ``_BatchNorm``) that never updates its running statistics.

    Every attribute is ``source``'s, read at each access (mode, eps, momentum, weight, bias,
    running statistics), except that in training it tracks no running statistics and has no
    ``num_batches_tracked``: it normalises with the batch statistics and updates nothing. It
    is not registered in ``state_dict`` (it owns no tensor) and ``model.train()`` reaches it
    through ``source``.

    Args:
        source: the BatchNorm whose computation it repeats.
        source_name: ``source``'s qualified name, for reports.

    Example:
        >>> bn = nn.BatchNorm2d(4)
        >>> view = SharedBatchStats(bn, "bn")
        >>> x = torch.randn(2, 4, 3, 3)
        >>> torch.equal(view(x), bn(x)), int(bn.num_batches_tracked)
        (True, 1)
    """

    _own = ("_source", "source_name", "_parameters", "_buffers", "_modules", "__dict__", "__class__")

    def __getattribute__(self, name: str) -> Any:
        if name in ("weight", "bias", "running_mean", "running_var", "eps", "momentum", "affine",
                    "num_features", "training", "track_running_stats", "num_batches_tracked"):
            src = object.__getattribute__(self, "_source")
            if name == "track_running_stats":
                return src.track_running_stats and not src.training
            if name == "num_batches_tracked":
                return None
            return getattr(src, name)
        return super().__getattribute__(name)

    def extra_repr(self) -> str:
        return f"batch statistics of {self.source_name or type(self._source).__name__}, no running-statistics update"
