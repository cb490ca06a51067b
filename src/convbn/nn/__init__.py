"""convbn.nn: thin modules over convbn's Functions (reference modules: :mod:`convbn.reference`)."""
from .chain import ChainLayer, FusedChain
from .fused_conv_bn import FusedConvBN1d, FusedConvBN2d, FusedConvBN3d
from .sync import SyncBatchNorm

__all__ = ["ChainLayer", "FusedChain", "FusedConvBN1d", "FusedConvBN2d", "FusedConvBN3d", "SyncBatchNorm"]
