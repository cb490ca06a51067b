"""Helpers shared by the example scripts: the ``--out`` option, checks and graph drawing.

Graphs are drawn with ``torchviz.make_dot`` and rendered to SVG and PNG by graphviz's
``dot`` program. Both are optional: when either is missing, one line says so and the
example carries on with its numerical checks.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import torch

__all__ = ["parse_out_dir", "check", "draw_graph", "finish"]

_failures: List[str] = []
_skip_reported = False


def parse_out_dir(description: str) -> Path:
    """Parse ``--out DIR`` (default ``out/examples``); also use one CPU thread.

    Args:
        description: the script's help text.

    Returns:
        The output directory (not created until something is drawn).

    Example:
        >>> out = parse_out_dir("demo")  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--out", type=Path, default=Path("out/examples"), help="directory for graph drawings"
    )
    out_dir = parser.parse_args().out
    # The examples use tiny tensors: starting worker threads for them costs more than it
    # saves, and on a busy machine it can make them many times slower.
    torch.set_num_threads(1)
    return out_dir


def check(name: str, passed: bool) -> None:
    """Print one check's result and remember failures for :func:`finish`.

    Args:
        name: what was checked.
        passed: its outcome.

    Example:
        >>> check("1 + 1 == 2", 1 + 1 == 2)
        [ ok ] 1 + 1 == 2
    """
    print(f"[{' ok ' if passed else 'FAIL'}] {name}")
    if not passed:
        _failures.append(name)


def finish() -> None:
    """Exit with status 1 if any :func:`check` failed, else print a summary.

    Example:
        >>> finish()  # doctest: +SKIP
    """
    if _failures:
        raise SystemExit(f"{len(_failures)} check(s) failed: {', '.join(_failures)}")
    print("all checks passed")


def _skip(reason: str) -> None:
    global _skip_reported
    if not _skip_reported:
        print(f"skipping graph drawing: {reason}")
        _skip_reported = True


def draw_graph(
    tensor: torch.Tensor,
    name: str,
    out_dir: Path,
    params: Optional[Dict[str, torch.Tensor]] = None,
) -> Optional[List[Path]]:
    """Draw the autograd graph that produced ``tensor`` into ``out_dir/name.{svg,png}``.

    Args:
        tensor: a tensor with a ``grad_fn``.
        name: file stem.
        out_dir: output directory, created if needed.
        params: optional ``{label: tensor}`` to name leaf tensors in the drawing.

    Returns:
        The written paths, or ``None`` when drawing was skipped.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> draw_graph((x * 2).exp(), "demo", Path("out"))  # doctest: +SKIP
    """
    try:
        import torchviz  # noqa: F401  (optional dependency)
    except ImportError:
        _skip("torchviz is not installed (install it with `pip install torchviz`)")
        return None
    if shutil.which("dot") is None:
        _skip("graphviz's `dot` program is not on PATH (install graphviz, e.g. `apt-get install graphviz`)")
        return None
    import graphviz

    out_dir.mkdir(parents=True, exist_ok=True)
    graph = torchviz.make_dot(tensor, params=params)
    written = []
    try:
        for fmt in ("svg", "png"):
            written.append(Path(graph.render(filename=name, directory=str(out_dir), format=fmt, cleanup=True)))
    except graphviz.backend.ExecutableNotFound:
        _skip("graphviz's `dot` program could not be run (install graphviz)")
        return None
    print(f"drew {name}: " + ", ".join(str(p) for p in written))
    return written
