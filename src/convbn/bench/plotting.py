"""The one place the benchmarks, the timeline plots and the demo import matplotlib."""
from __future__ import annotations

from typing import Any

from convbn.extras import require

__all__ = ["pyplot"]


def pyplot(needed_by: str, alternative: str = "", extra: str = "plot") -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (PNG files, no display).

    Args:
        needed_by: what needs it, for the error (``"--plot"``, ``"the demo's plot"``).
        alternative: how to do without it, appended to the error (``" (or pass --no-plot)"``).
        extra: the convbn extra the error names (``plot``; the demo's is ``demo``).

    Returns:
        The ``matplotlib.pyplot`` module.

    Raises:
        ImportError: matplotlib is missing; the message says ``needed_by``, the extra and ``alternative``.

    Example:
        >>> plt = pyplot("--plot")  # doctest: +SKIP
    """
    matplotlib = require("matplotlib", needed_by, extra, alternative)
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", needed_by, extra, alternative)
