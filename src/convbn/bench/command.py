"""``convbn bench``: one command, three benchmarks.

* ``convbn bench [options]`` -- training: eager vs convert (auto, budgets, tutorial,
  recompute_bn) vs ``torch.utils.checkpoint`` vs ``torch.compile`` activation budgets
  (:mod:`convbn.bench.training`);
* ``convbn bench --inference [options]`` -- eval latency: unfused vs fx ``fuse`` vs
  ``convbn.fold`` (+ script / compile) (:mod:`convbn.bench.inference`);
* ``convbn bench --ddp N [options]`` -- data-parallel training with SyncBatchNorm on N
  processes (gloo on CPU, NCCL on CUDA) (:mod:`convbn.bench.ddp`).

``convbn bench [--inference | --ddp N] --help`` lists each mode's options.
"""
from __future__ import annotations

import argparse

from ..cli import Command

__all__ = ["COMMAND"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--inference", action="store_true", help="eval latency: unfused vs fx fuse vs convbn.fold")
    mode.add_argument("--ddp", type=int, default=0, metavar="N", help="data-parallel training on N processes")
    parser.add_argument("--help-mode", action="store_true", help="show the options of the chosen mode")


def _run(args: argparse.Namespace) -> int:
    if args.inference:
        from .inference import add_inference_arguments as add, main_inference as main

        prog = "convbn bench --inference"
    elif args.ddp:
        from .ddp import add_ddp_arguments as add, main_ddp as main

        prog = f"convbn bench --ddp {args.ddp}"
    else:
        from .training import add_training_arguments as add, main_training as main

        prog = "convbn bench"
    sub = argparse.ArgumentParser(prog=prog)
    add(sub)
    extra = list(args.extra) + (["--help"] if args.help_mode else [])
    if args.ddp:
        extra = ["--ddp", str(args.ddp)] + extra
    return int(main(sub.parse_args(extra)))


COMMAND = Command(
    name="bench",
    help="benchmarks: training memory/speed (default), --inference latency, --ddp N data-parallel",
    add_arguments=_add_arguments,
    run=_run,
    passthrough=True,
)
