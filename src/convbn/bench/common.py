"""Helpers every benchmark runner shares: the loss, timing, cells and output files.

One implementation each, used by :mod:`convbn.bench.training`, :mod:`convbn.bench.ddp`
and :mod:`convbn.bench.inference`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch import Tensor

from .._compat import pytree

from convbn.cli import output_path

__all__ = [
    "DTYPES",
    "add_output_arguments",
    "backward_and_step",
    "first_tensor",
    "fmt",
    "projection_loss",
    "rows_to_json",
    "short_error",
    "timed_ms",
    "write_outputs",
    "write_text",
]

#: ``--dtype`` names of every benchmark.
DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


def first_tensor(out: Any) -> Tensor:
    """The model's output tensor: ``out`` itself, or the first tensor leaf of a tuple / dict / dataclass.

    Raises:
        TypeError: ``out`` holds no tensor.
    """
    if isinstance(out, Tensor):
        return out
    for t in pytree.tree_leaves(out):
        if isinstance(t, Tensor):
            return t
    raise TypeError(f"the model returned no tensor (got {type(out).__name__})")


def projection_loss(out: Tensor, proj: Tensor) -> Tensor:
    """A loss with O(1) gradients for any output shape: a fixed random projection per sample."""
    return (out.float() * proj).sum() / out.shape[0]


def backward_and_step(loss: Tensor, optimizer: torch.optim.Optimizer, scaler: Optional[Any] = None) -> None:
    """The step after the loss: ``loss.backward()`` and ``optimizer.step()``, or, with a
    ``torch.amp.GradScaler``, the scaled backward, ``scaler.step`` and ``scaler.update``
    (float16 autocast); the benchmarks' one spelling of it."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()


def timed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of ``fn()``: CUDA events after a synchronize on a GPU, ``perf_counter`` on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def short_error(exc: BaseException, limit: int = 240) -> str:
    """``"TypeName: first line of the message"``, the line cut at ``limit`` characters (for a table cell)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:limit]}"


def fmt(value: Optional[float], spec: str) -> str:
    """A number formatted with ``spec`` for a table cell, ``"-"`` when it was not measured."""
    return "-" if value is None else format(value, spec)


def rows_to_json(rows: Sequence[Any]) -> str:
    """Dataclass rows as a JSON list of objects (their field names); NaN / inf become ``null``."""

    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v  # NaN / inf are not JSON

    return json.dumps([{k: clean(v) for k, v in dataclasses.asdict(r).items()} for r in rows], indent=2)


def write_text(path: str, text: str) -> None:
    """Write ``text`` (and a newline) to ``path``; ``"-"`` prints it."""
    if path == "-":
        print(text)
    else:
        with open(path, "w") as fh:
            fh.write(text + "\n")


def add_output_arguments(parser: argparse.ArgumentParser, plot_help: str) -> None:
    """Add ``--plot``, ``--json``, ``--markdown``, ``--wide`` and ``--progress`` / ``--quiet`` (``--no-progress``)
    (read by :func:`write_outputs`; ``args.progress`` is ``None``, ``True`` or ``False``).

    Args:
        parser: the benchmark's parser.
        plot_help: what ``--plot PATH`` draws.
    """
    parser.add_argument("--plot", type=output_path, default=None, metavar="PATH", help=plot_help)
    parser.add_argument("--json", type=output_path, nargs="?", const="-", default=None, metavar="PATH",
                        help="write all rows as JSON to PATH (no PATH or '-': stdout)")
    parser.add_argument("--markdown", type=output_path, nargs="?", const="-", default=None, metavar="PATH",
                        help="write all columns as a markdown table to PATH (no PATH or '-': stdout)")
    parser.add_argument("--wide", action="store_true", help="print every column (default: the key columns, 120 wide)")
    from ..cli import add_progress_arguments

    add_progress_arguments(parser, "a bar")


def progress_bar(progress: Optional[bool]) -> Any:
    """A ``rich`` progress bar on stderr: ``None`` where stderr is a terminal, ``True`` always,
    ``False`` never (the bar disabled)."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True, force_terminal=True if progress else None)
    return Progress(console=console, disable=progress is False or not console.is_terminal, transient=True)


def write_outputs(args: argparse.Namespace, rows: Sequence[Any], to_markdown: Callable[[Sequence[Any]], str],
                  to_json: Callable[[Sequence[Any]], str], plot: Callable[[Sequence[Any], str], None]) -> None:
    """Write ``rows`` where ``--markdown`` / ``--json`` / ``--plot`` ask (``-``: standard output)."""
    if getattr(args, "markdown", None):
        write_text(args.markdown, to_markdown(rows))
    if getattr(args, "json", None):
        write_text(args.json, to_json(rows))
    if getattr(args, "plot", None):
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")

