"""``convbn explain ... --frontier``: the (peak, time) plane of the user's model and input, as a
table, or drawn with ``--plot PATH`` (the measuring is :mod:`convbn.bench.frontier_run`'s)."""
from __future__ import annotations

import argparse
import sys

from torch import Tensor, nn

from .cli import fraction, positive_int

__all__ = ["add_frontier_arguments", "run_frontier_command"]

#: ``--dtype`` -> the frontier's precision.
_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def add_frontier_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``explain --frontier``."""
    group = parser.add_argument_group("frontier (with --frontier)")
    group.add_argument("--frontier", action="store_true",
                       help="measure the step's peak and time of eager, torch.compile (with memory budgets), "
                            "per-block checkpointing and convbn's plans, with and without compile; mark the frontier")
    group.add_argument("--rounds", type=positive_int, default=5, help="interleaved timed rounds (default 5)")
    group.add_argument("--plans", type=positive_int, default=3,
                       help="convbn plans from the lowest peak to eager's (default 3)")
    group.add_argument("--compile-budget", type=fraction, action="append", default=None, metavar="B",
                       help="torch.compile activation-memory budgets, repeatable (default 0.5 and 0.3)")
    group.add_argument("--no-compile", action="store_true", help="leave out every torch.compile configuration")
    group.add_argument("--plot", default=None, metavar="PATH", help="also draw the plane into PATH (PNG; [plot] extra)")


def run_frontier_command(args: argparse.Namespace, model: nn.Module, x: Tensor) -> int:
    """Measure and print the frontier of ``model`` on ``x``; with ``--plot`` draw it too."""
    from .bench.frontier import frontier_table
    from .bench.frontier_run import FrontierSettings, run_frontier

    if args.strategy != "auto":
        raise ValueError(f"--frontier measures convbn's auto plans, but got --strategy {args.strategy}")
    if args.memory is not None or args.memory_budget is not None or args.peak_budget is not None:
        raise ValueError("--frontier measures the plans from the lowest peak to eager's itself: leave out "
                         "--memory, --memory-budget and --peak-budget (--time-budget adds its plan)")
    if args.plot is not None:
        from .bench.plotting import pyplot

        pyplot("--plot", " (leave out --plot for a table)")  # the ImportError before minutes of measuring
    budgets = tuple(args.compile_budget or (0.5, 0.3))
    settings = FrontierSettings(precision=_PRECISION[args.dtype], compile=not args.no_compile, compile_budgets=budgets,
                                plans=args.plans, rounds=args.rounds,
                                time_budgets=(args.time_budget,) if args.time_budget is not None else ())
    quiet = getattr(args, "progress", None) is False
    points = run_frontier(model, x, settings, progress=None if quiet else (
        lambda s: print(f"convbn explain --frontier: {s}", file=sys.stderr, flush=True)))
    print(f"{args.spec}, input {'x'.join(map(str, x.shape))}, {settings.precision}: training step peak and time, "
          f"median of {settings.rounds} interleaved rounds (* on the frontier)")
    print(frontier_table(points, markdown=False))
    if args.plot is not None:
        from .bench.frontier_plot import plot_frontier

        print(f"plot: {plot_frontier(points, args.plot, title=f'{args.spec} {settings.precision}')}")
    return 0
