"""A benchmark file of ``benchmarks/`` loaded as a module, for tests that run its nets."""
from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

__all__ = ["load_benchmark"]

_BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


@functools.lru_cache(maxsize=None)
def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (loaded once per process)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(_BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
