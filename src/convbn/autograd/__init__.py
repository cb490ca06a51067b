"""convbn.autograd: the ``torch.autograd.Function``s of the fast paths, and ``conv_bn_act``.

The tutorial's reference Functions live in :mod:`convbn.reference`.
"""
from .chain import ChainFunction
from .dispatch import conv_bn_act
from .fused import FrozenFunction, RecomputeBNFunction, RecomputeConvFunction

__all__ = [
    "ChainFunction",
    "FrozenFunction",
    "RecomputeBNFunction",
    "RecomputeConvFunction",
    "conv_bn_act",
]
