"""The one place the benchmarks, the timeline plots and the demo import matplotlib."""
from __future__ import annotations

from typing import Any

__all__ = ["pyplot"]


def pyplot(needed_by: str, remedy: str = "pip install matplotlib (or convbn[plot])") -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (PNG files, no display).

    Args:
        needed_by: what needs it, for the error (``"--plot"``, ``"the demo's plot"``).
        remedy: how to get it (or do without it).

    Returns:
        The ``matplotlib.pyplot`` module.

    Raises:
        ImportError: matplotlib is missing; the message says ``needed_by`` and ``remedy``.

    Example:
        >>> plt = pyplot("--plot")  # doctest: +SKIP
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"{needed_by} needs matplotlib: {remedy}") from exc
    return plt
