"""convbn.passes: torch.fx graph passes (convert for training, fold for inference)."""
from .convert import convert, explain
from .fold import fold

__all__ = ["convert", "explain", "fold"]
