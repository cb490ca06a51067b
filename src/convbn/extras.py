"""Optional packages: what each ``pip install 'convbn[EXTRA]'`` adds, and one clear error when one is missing.

The library needs torch only. The command line's extras:

* ``cli`` -- rich: the tables and progress bars of ``convbn bench`` and ``convbn demo``;
* ``plot`` -- matplotlib: the PNGs of ``--plot`` / ``--timeline``;
* ``onnx`` -- onnx, onnxscript (torch's ONNX exporter) and onnxruntime (the check of the
  written file): ``convbn fold --save-onnx`` and :func:`convbn.deploy.save_onnx`;
* ``demo`` -- everything ``convbn demo`` uses: numpy, scikit-learn (its built-in digits),
  matplotlib and rich;
* ``all`` -- all of the above.

Example:
    >>> np = require("numpy", "reading MNIST files", "demo")  # doctest: +SKIP
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = ["PACKAGES", "require"]

#: The pip name of each optional module convbn imports (where it differs from the module's name).
PACKAGES = {"sklearn": "scikit-learn"}


def require(module: str, needed_by: str, extra: str, alternative: str = "") -> Any:
    """Import ``module``, or raise one ImportError line naming the extra that installs it.

    Args:
        module: the module to import (``"sklearn.datasets"``).
        needed_by: what needs it, as the message starts (``"convbn demo"``).
        extra: the convbn extra that installs it (``"demo"``).
        alternative: appended to the message, e.g. ``" (or pass --no-plot)"``.

    Returns:
        The imported module.

    Raises:
        ImportError: ``"convbn demo needs scikit-learn: pip install 'convbn[demo]'"`` when the
            package is missing; when it is installed but fails to import, the message says so
            and gives its error instead.
    """
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
        top = module.split(".")[0]
        package = PACKAGES.get(top, top)
        try:
            installed = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            installed = False
        if not installed:
            raise ImportError(f"{needed_by} needs {package}: pip install 'convbn[{extra}]'{alternative}") from exc
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ImportError(f"{needed_by} needs {package}, which is installed but fails to import ({detail})") from exc
