"""The standard BatchNorm computation of any BatchNorm-like module, and a BatchNorm view.

Model zoos write BatchNorm in more ways than ``nn.BatchNorm2d``: ``_BatchNorm`` subclasses
whose ``forward`` normalises and then applies a dropout and an activation (norm-act
layers), modules that hold BatchNorm tensors and call ``F.batch_norm`` on them, frozen
BatchNorms holding only buffers. :func:`convbn.convert` recognises the batch-norm
*computation* inside them (:mod:`convbn.passes.bn.recognise`) and fuses it; these two
helpers are what the fused model runs with:

* :func:`standard_batch_norm` -- what ``_BatchNorm.forward`` (or ``nn.SyncBatchNorm.forward``)
  computes for a module, whatever its own class's ``forward`` adds after it. A graph in
  which a norm-act layer was inlined calls it where the layer normalised.
* :class:`BatchNormView` -- a ``_BatchNorm`` whose tensors are another module's (read at
  every access, so ``.to()`` / ``load_state_dict`` on the model reach it) with a fixed mode,
  momentum and eps: what a fused chain reads for a functional ``F.batch_norm`` call or a
  frozen BatchNorm. It is never registered as a submodule (``state_dict`` keys stay the
  model's own) and ``model.train()`` does not reach it, so its fixed mode holds.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .sync import SyncBatchNorm

__all__ = ["frozen_batch_norm", "standard_batch_norm", "standard_bn_forward", "has_standard_bn_forward", "BatchNormView"]


def has_standard_bn_forward(bn: nn.Module) -> bool:
    """``bn``'s class computes with a torch (or convbn) BatchNorm forward, not its own."""
    return type(bn).forward in (_BatchNorm.forward, nn.SyncBatchNorm.forward, SyncBatchNorm.forward)


def standard_bn_forward(bn: _BatchNorm):  # type: ignore[no-untyped-def]
    """The torch forward that computes ``bn``'s batch norm: ``nn.SyncBatchNorm.forward`` for
    a ``nn.SyncBatchNorm`` (subclass), else ``_BatchNorm.forward``."""
    if isinstance(bn, SyncBatchNorm):
        return SyncBatchNorm.forward
    return nn.SyncBatchNorm.forward if isinstance(bn, nn.SyncBatchNorm) else _BatchNorm.forward


def standard_batch_norm(bn: _BatchNorm, input: Tensor) -> Tensor:
    """``bn``'s standard batch-norm computation on ``input`` (no hooks, no subclass extras).

    Reads ``bn``'s mode, momentum, running statistics and ``num_batches_tracked`` at call
    time and updates them exactly as ``nn.BatchNorm2d`` does.

    Args:
        bn: a ``_BatchNorm`` (any subclass).
        input: its input.

    Returns:
        The normalised tensor.

    Example:
        >>> bn = nn.BatchNorm2d(4)
        >>> standard_batch_norm(bn, torch.randn(2, 4, 3, 3)).shape
        torch.Size([2, 4, 3, 3])
    """
    if not isinstance(bn, _BatchNorm):
        raise TypeError(f"standard_batch_norm expects a _BatchNorm module, but got {type(bn).__name__}")
    return standard_bn_forward(bn)(bn, input)


def frozen_batch_norm(bn: nn.Module, input: Tensor, ranks: Tuple[int, ...]) -> Tensor:
    """Eval-mode batch norm of ``input`` with ``bn``'s buffers: what a frozen BatchNorm computes
    on inputs of the ranks it was recognised on (:mod:`convbn.passes.bn.frozen`).

    Args:
        bn: a module with tensors ``weight``, ``bias``, ``running_mean``, ``running_var`` and ``eps``.
        input: its input.
        ranks: the input ranks on which ``bn`` computes a batch norm.

    Returns:
        ``F.batch_norm(input, running_mean, running_var, weight, bias, training=False, eps=eps)``.

    Raises:
        ValueError: ``input``'s rank is not in ``ranks`` (the module's own code would not
            compute a batch norm there).
    """
    if input.dim() not in ranks:
        raise ValueError(f"{type(bn).__name__} computes a batch norm on {list(ranks)}-D inputs, "
                         f"but got a {input.dim()}-D input of shape {tuple(input.shape)}")
    return F.batch_norm(input, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, float(bn.eps))


class BatchNormView(_BatchNorm):
    """A ``_BatchNorm`` over another module's tensors, with a fixed mode, momentum and eps.

    Args:
        source: the module holding the tensors.
        num_features: number of channels.
        weight, bias, running_mean, running_var: the attribute names of ``source``'s tensors
            (``None``: absent).
        eps: the eps the computation uses.
        momentum: the running-statistics momentum it uses.
        training: whether it normalises with batch statistics (and updates running ones).

    Example:
        >>> frozen = torchvision.ops.FrozenBatchNorm2d(8)  # buffers only, eval maths
        >>> view = BatchNormView(frozen, 8, eps=frozen.eps)
        >>> view.running_mean is frozen.running_mean
        True
    """

    def __init__(self, source: nn.Module, num_features: int, *, weight: Optional[str] = "weight",
                 bias: Optional[str] = "bias", running_mean: Optional[str] = "running_mean",
                 running_var: Optional[str] = "running_var", eps: float = 1e-5, momentum: float = 0.0,
                 training: bool = False) -> None:
        nn.Module.__init__(self)
        object.__setattr__(self, "_source", source)  # not a submodule: no state_dict keys
        object.__setattr__(self, "_names", {"weight": weight, "bias": bias, "running_mean": running_mean,
                                            "running_var": running_var})
        self.num_features = num_features
        self.eps = float(eps)
        self.momentum = float(momentum)
        self.affine = weight is not None
        self.track_running_stats = running_mean is not None
        self.num_batches_tracked = None
        self.training = training

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        # the four tensors are read from the source at every access (see module docstring)
        if name in ("weight", "bias", "running_mean", "running_var"):
            names = object.__getattribute__(self, "_names")
            attr = names[name]
            return None if attr is None else getattr(object.__getattribute__(self, "_source"), attr)
        return super().__getattribute__(name)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def train(self, mode: bool = True) -> "BatchNormView":
        """Does nothing: the view computes in the mode the model's code fixed."""
        return self

    def extra_repr(self) -> str:
        return (f"{self.num_features}, of {type(self._source).__name__}, eps={self.eps}, "
                f"momentum={self.momentum}, training={self.training}")
