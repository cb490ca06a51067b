"""convbn.nn: thin modules over convbn's Functions."""
from .chain import ChainLayer, FusedChain
from .fused import FusedConvBN1d, FusedConvBN2d, FusedConvBN3d
from .linear import Linear
from .sync import SyncBatchNorm
from .tutorial import TutorialFusedConvBN2d

__all__ = ["ChainLayer", "FusedChain", "FusedConvBN1d", "FusedConvBN2d", "FusedConvBN3d", "Linear", "SyncBatchNorm", "TutorialFusedConvBN2d"]
