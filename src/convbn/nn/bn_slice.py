"""A BatchNorm over a channel slice of another BatchNorm: its tensors, sliced.

Note: [a BatchNorm over a concatenation of convolutions]
    Mixed-kernel convolutions (MixNet's MixConv, Inception-style branches) concatenate the
    outputs of several convolutions along channels and normalise the result with one
    BatchNorm: ``BN(cat([c_1, ..., c_k], 1))``. BatchNorm is per channel: each channel's
    batch statistics, affine transform and running-statistics update read only that
    channel. So ``BN(cat(c_i)) = cat(BN_i(c_i))``, where ``BN_i`` is the BatchNorm restricted
    to ``c_i``'s channels, value for value (and so is any element-wise activation after
    it). Each ``c_i -> BN_i -> act`` is then an ordinary conv -> BN -> activation layer that
    a fused chain takes, and the concatenation is no longer saved for BatchNorm's backward.

    :class:`BatchNormSlice` is ``BN_i``: ``weight``, ``bias`` and the running statistics are
    views ``[start:stop]`` of the source's, taken at every access (so ``.to()``,
    ``load_state_dict`` and in-place running-statistics updates reach the source's tensors;
    gradients flow through the views into the source's parameters). One BatchNorm forward
    advances ``num_batches_tracked`` once: the slice that runs first (``counts``) holds the
    counter; the others have none and, for a cumulative average (``momentum=None``), read
    the factor ``1 / num_batches_tracked`` the first one has just advanced.
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .bn_shared import BatchNormOfSource

__all__ = ["BatchNormSlice"]

_SLICED = ("weight", "bias", "running_mean", "running_var")
_SHARED = ("eps", "affine", "training", "track_running_stats")


class BatchNormSlice(BatchNormOfSource):
    """The batch norm of ``source`` restricted to channels ``start:stop``.

    Args:
        source: the BatchNorm whose channels it normalises.
        start: first channel.
        stop: one past the last channel.
        counts: this slice advances ``source.num_batches_tracked`` (exactly one slice of a
            split BatchNorm does: the one that runs first).
        source_name: ``source``'s qualified name, for reports.

    Example:
        >>> bn = nn.BatchNorm2d(6)
        >>> x = torch.randn(2, 6, 3, 3)
        >>> a, b = BatchNormSlice(bn, 0, 2, counts=True), BatchNormSlice(bn, 2, 6, counts=False)
        >>> y = torch.cat([a(x[:, :2].contiguous()), b(x[:, 2:].contiguous())], 1)  # pieces as convs give them
        >>> ref = nn.BatchNorm2d(6)
        >>> torch.equal(y, ref(x)), torch.equal(bn.running_var, ref.running_var), int(bn.num_batches_tracked)
        (True, True, 1)
    """

    def __init__(self, source: _BatchNorm, start: int, stop: int, counts: bool, source_name: str = "") -> None:
        if isinstance(source, _BatchNorm) and not 0 <= start < stop <= source.num_features:
            raise ValueError(f"BatchNormSlice expects 0 <= start < stop <= {source.num_features} "
                             f"(the source's num_features), but got start={start}, stop={stop}")
        super().__init__(source, source_name)
        self.start, self.stop, self.counts = int(start), int(stop), bool(counts)

    def __getattribute__(self, name: str) -> Any:
        if name in _SLICED or name in _SHARED or name in ("num_features", "momentum", "num_batches_tracked"):
            src = object.__getattribute__(self, "_source")
            start, stop = object.__getattribute__(self, "start"), object.__getattribute__(self, "stop")
            if name in _SLICED:
                t = getattr(src, name)
                return None if t is None else t[start:stop]
            if name == "num_features":
                return stop - start
            counts = object.__getattribute__(self, "counts")
            if name == "num_batches_tracked":
                return src.num_batches_tracked if counts else None
            if name == "momentum" and src.momentum is None and not counts:
                # cumulative average: the factor the counting slice advanced to in this forward
                nbt = src.num_batches_tracked
                if src.training and src.track_running_stats and nbt is not None:
                    return 1.0 / float(int(nbt))
                return 0.0
            return getattr(src, name)
        return super().__getattribute__(name)

    def extra_repr(self) -> str:
        return (f"channels {self.start}:{self.stop} of {self.source_name or type(self._source).__name__}"
                f"{', advances num_batches_tracked' if self.counts else ''}")
