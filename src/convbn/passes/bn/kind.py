"""What kind of BatchNorm a module is: the one answer both passes read, by ``isinstance``.

A user's subclass of ``nn.BatchNorm2d`` (timm's ``BatchNormAct2d``, a ``LazyBatchNorm2d``, one
with extra attributes) is a ``BatchNorm2d``: it normalises what its base class normalises, and
convert and fold treat it so. Whether its *forward* is torch's is another question
(:func:`convbn.nn.standard_bn.has_standard_bn_forward`; a norm-act forward: :mod:`convbn.passes.bn.recognise`).
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["bn_conv_dims"]

# a linear layer is a 0-D convolution (Note: [three kinds of convolution] in functional/conv.py)
_DIMS: Tuple[Tuple[type, Tuple[int, ...]], ...] = (
    (nn.BatchNorm1d, (0, 1)), (nn.BatchNorm2d, (2,)), (nn.BatchNorm3d, (3,)),
)


def bn_conv_dims(module: object) -> Optional[Tuple[int, ...]]:
    """Whether ``module`` is a BatchNorm, and the layers it may follow.

    Args:
        module: any object (a module, a ``BatchNormView``, ...).

    Returns:
        ``None`` where ``module`` is no ``_BatchNorm``; else the dimensionality of the
        convolutions whose output it may normalise (``0``: a linear layer), by ``isinstance``
        on ``BatchNorm1d`` / ``2d`` / ``3d`` (subclasses included), or ``()`` for a
        ``_BatchNorm`` of none of them (``SyncBatchNorm``, a direct ``_BatchNorm`` subclass):
        any rank.

    Example:
        >>> class MyBN(nn.BatchNorm2d): pass
        >>> bn_conv_dims(MyBN(4)), bn_conv_dims(nn.SyncBatchNorm(4)), bn_conv_dims(nn.ReLU())
        ((2,), (), None)
    """
    if not isinstance(module, _BatchNorm):
        return None
    for cls, dims in _DIMS:
        if isinstance(module, cls):
            return dims
    return ()
