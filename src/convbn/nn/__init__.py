"""convbn.nn: thin modules over convbn's Functions (reference modules: :mod:`convbn.reference`)."""
from .chain import ChainLayer, FusedChain
from .fused_conv_bn import FusedConvBN1d, FusedConvBN2d, FusedConvBN3d
from .fused_conv_norm import (FusedConvGroupNorm1d, FusedConvGroupNorm2d, FusedConvGroupNorm3d,
                              FusedConvInstanceNorm1d, FusedConvInstanceNorm2d, FusedConvInstanceNorm3d)
from .norm_chain import FusedNormChain
from .sync import SyncBatchNorm

__all__ = ["ChainLayer", "FusedChain", "FusedConvBN1d", "FusedConvBN2d", "FusedConvBN3d", "FusedConvGroupNorm1d",
           "FusedConvGroupNorm2d", "FusedConvGroupNorm3d", "FusedConvInstanceNorm1d", "FusedConvInstanceNorm2d",
           "FusedConvInstanceNorm3d", "FusedNormChain", "SyncBatchNorm"]
