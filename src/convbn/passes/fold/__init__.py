"""The inference pass: BatchNorm folded into a neighbouring conv / linear layer (``api``: fold)."""
