"""convbn: fused Convolution + BatchNorm (+ activation) for PyTorch."""
__version__ = "0.1.0"
