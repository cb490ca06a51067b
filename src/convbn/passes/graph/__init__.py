"""Shared graph infrastructure of both passes: tracing (and its hazards), the in-place rewrite, hooks, shape-only uses, the conv / linear layers both passes recognise."""
