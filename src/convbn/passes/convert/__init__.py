"""The training pass: Conv -> BN (-> tail) chains matched and rewritten into FusedChain calls (``api``: convert, explain)."""
