"""convbn.autograd: the ``torch.autograd.Function``s (fast paths and tutorial references)."""
from .batchnorm2d import BatchNorm2dFunction
from .chain import ChainFunction
from .conv2d import Conv2dFunction
from .fused import FrozenFunction, RecomputeBNFunction, RecomputeConvFunction
from .linear import LinearFunction
from .tutorial_fused import TutorialFusedConvBN2dFunction

__all__ = [
    "BatchNorm2dFunction",
    "ChainFunction",
    "Conv2dFunction",
    "FrozenFunction",
    "LinearFunction",
    "RecomputeBNFunction",
    "RecomputeConvFunction",
    "TutorialFusedConvBN2dFunction",
]
