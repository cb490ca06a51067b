"""convbn.reference: the tutorial's reference Functions and modules.

Hand-written backward passes, kept plain and obviously right: the oracle the fast paths
are tested against and what ``examples/`` runs. Production code (``autograd/``, ``nn/``,
``passes/``) never imports them.
"""
from .batchnorm2d import BatchNorm2dFunction
from .conv2d import Conv2dFunction
from .linear import Linear, LinearFunction
from .tutorial_fused import TutorialFusedConvBN2d, TutorialFusedConvBN2dFunction

__all__ = [
    "BatchNorm2dFunction",
    "Conv2dFunction",
    "Linear",
    "LinearFunction",
    "TutorialFusedConvBN2d",
    "TutorialFusedConvBN2dFunction",
]
