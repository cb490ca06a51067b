"""``convbn explain SPEC --input-shape ...``: what :func:`convbn.convert` would do to a model.

``SPEC`` is a benchmark model spec (``mnist``, ``monai:resnet18``,
``'monai:resnet50(spatial_dims=2)'``, ``efficientnet:b0`` ... see
:mod:`convbn.bench.models`) or ``module:callable`` naming a function or class of the
user's that returns an ``nn.Module`` (``mypkg.nets:build_net``, found in the current folder
first). The per-layer report lists each fused pair with its strategy, kept bytes and
recomputed MACs, and each BatchNorm left alone with the reason. ``--dtype bfloat16`` /
``float16`` explains the model under autocast and ``--channels-last`` with channels-last
weights and input: the configuration the model trains in.

Example:
    $ convbn explain mnist --input-shape 64x1x28x28
    $ convbn explain mypkg.nets:build_net --input-shape 8x3x224x224 --memory-budget 0.5
    $ convbn explain mnist --memory 16GiB    # the largest batch eager and convbn train in 16 GiB
    $ convbn explain mnist --memory 16GiB --quiet   # no progress lines on stderr
    $ convbn explain mynet:build --checkpoint last.ckpt --dtype bfloat16 --channels-last
    $ convbn explain mnist --input-shape 64x1x28x28 --time-budget 1.05   # the lowest peak within 5 % of eager's time
    $ convbn explain torchvision:resnet18 --input-shape 8x3x112x112 --frontier --time-budget 1.05 --plot frontier.png

``--frontier`` measures, side by side in one process, the training step's peak and time of
eager, ``torch.compile`` (with activation-memory budgets 0.5 and 0.3), per-block
checkpointing and convbn's plans from the lowest peak to eager's, each with and without
compile, and marks the frontier (:mod:`convbn.bench.frontier_run`): a table, and with
``--plot PATH`` a picture (the ``[plot]`` extra).
"""
from __future__ import annotations

import argparse
import contextlib
from typing import get_args

import torch

from .cli import Command, add_progress_arguments, add_renamed_option, fraction, memory_size, positive_float
from .cli_frontier import add_frontier_arguments, run_frontier_command
from .functional.strategies import ConvertStrategy
from .cli_model import add_model_arguments, channels_last_format, load_model, model_input, resolve_shape

__all__ = ["load_model", "resolve_shape", "add_arguments", "run", "COMMAND", "AUTOCAST_DTYPES"]

#: ``--dtype`` choices: ``float32`` runs as is, the others under ``torch.autocast``.
AUTOCAST_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``convbn explain``."""
    add_model_arguments(parser)
    parser.add_argument("--strategy", choices=get_args(ConvertStrategy), default="auto",
                        help="convert strategy to explain")
    parser.add_argument("--memory-budget", type=fraction, default=None, metavar="X",
                        help="with --strategy auto: target saved activation bytes as a fraction in (0, 1] of eager "
                             "(convert's memory_budget)")
    add_renamed_option(parser, "--budget", "--memory-budget", type=fraction, dest="memory_budget")
    parser.add_argument("--peak-budget", type=fraction, default=None, metavar="X",
                        help="with --strategy auto: the training step's peak memory allowed, a fraction in (0, 1] "
                             "of eager's")
    parser.add_argument("--time-budget", type=positive_float, default=None, metavar="T",
                        help="with --strategy auto: the step time allowed as a ratio of eager's (e.g. 1.05): the "
                             "lowest peak predicted within it (convert's time_budget)")
    add_frontier_arguments(parser)
    parser.add_argument("--memory", type=memory_size, default=None, metavar="SIZE",
                        help="also report the largest batch that trains within SIZE (e.g. 16GiB, 512MiB), eager "
                             "and converted (convbn.max_batch; runs real steps at the batches it tries)")
    parser.add_argument("--no-chain", action="store_true", help="do not chain consecutive layers (tutorial's method)")
    parser.add_argument("--dtype", choices=tuple(AUTOCAST_DTYPES), default="float32",
                        help="float32, or mixed precision: the model under torch.autocast with this dtype")
    parser.add_argument("--channels-last", action="store_true",
                        help="channels-last weights and input (channels_last_3d for 3-D models)")
    add_progress_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Print the report of :func:`convbn.explain`; returns the exit code."""
    from .passes.convert.api import explain

    for flag, value in (("--memory-budget", args.memory_budget), ("--peak-budget", args.peak_budget),
                        ("--time-budget", args.time_budget)):
        if value is not None and args.strategy != "auto":
            raise ValueError(f"{flag} is used by --strategy auto only, but got --strategy {args.strategy}")
    if args.memory is not None:  # its size was checked while parsing
        if args.strategy != "auto":
            raise ValueError(f"--memory plans with --strategy auto only, but got --strategy {args.strategy}")
    model, default = load_model(args.spec, args.checkpoint)
    model = model.to(args.device).train()
    x = model_input(args, model, default, channels_last=args.channels_last)
    if args.channels_last:
        model = model.to(memory_format=channels_last_format(x.dim()))
    dtype = AUTOCAST_DTYPES[args.dtype]
    if args.frontier:
        return run_frontier_command(args, model, x)
    autocast = (torch.autocast(torch.device(args.device).type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())
    progress = getattr(args, "progress", None)
    with autocast:
        report = explain(model, x, strategy=args.strategy, memory_budget=args.memory_budget, peak_budget=args.peak_budget,
                         time_budget=args.time_budget, chain=not args.no_chain, progress=progress)
    how = "".join((f", autocast {args.dtype}" if dtype is not None else "",
                   ", channels-last" if args.channels_last else ""))
    print(f"{args.spec}, input {'x'.join(map(str, x.shape))}{how}", flush=True)
    print(report, flush=True)  # the report before the longer search
    if args.memory is not None:
        from .largest_batch import max_batch

        fit = max_batch(model, x, args.memory, chain=not args.no_chain, progress=progress)
        print(fit)
    return 0


COMMAND = Command(
    name="explain",
    help="per-layer report of what convbn.convert would do: strategy, kept bytes, recompute MACs, skipped norms",
    add_arguments=add_arguments,
    run=run,
)
