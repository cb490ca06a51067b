"""``convbn bench``: one command, three benchmarks, one set of flag names.

* ``convbn bench [options]`` -- training: eager vs convert (auto, budgets, tutorial,
  recompute_bn) vs ``torch.utils.checkpoint`` vs ``torch.compile`` activation budgets
  (:mod:`convbn.bench.training`);
* ``convbn bench --inference [options]`` -- eval latency: unfused vs fx ``fuse`` vs
  ``convbn.fold`` (+ script / compile) (:mod:`convbn.bench.inference`);
* ``convbn bench --ddp N [options]`` -- data-parallel training with SyncBatchNorm on N
  processes (gloo on CPU, NCCL on CUDA) (:mod:`convbn.bench.ddp`).

``convbn bench [--inference | --ddp N] --help`` lists the chosen mode's real options with
their defaults. Every mode spells shared options the same way: ``--model SPEC``
(repeatable), ``--batch-size``, ``--image-size``, ``--device``, ``--dtype``,
``--json PATH``, ``--markdown PATH``, ``--plot PATH``.
"""
from __future__ import annotations

import argparse
from typing import Sequence

from ..cli import AddArguments, Command, positive_int

__all__ = ["COMMAND"]


def _add_modes(parser: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--inference", action="store_true",
                      help="eval latency: unfused vs fx fuse vs convbn.fold (see 'convbn bench --inference --help')")
    mode.add_argument("--ddp", type=positive_int, default=None, metavar="N",
                      help="data-parallel training on N processes (see 'convbn bench --ddp 2 --help')")
    return mode


def _add_training(parser: argparse.ArgumentParser) -> None:
    from .training import add_training_arguments

    _add_modes(parser)
    add_training_arguments(parser)


def _add_inference(parser: argparse.ArgumentParser) -> None:
    from .inference import add_inference_arguments

    _add_modes(parser)
    add_inference_arguments(parser)


def _add_ddp(parser: argparse.ArgumentParser) -> None:
    from .ddp import add_ddp_arguments

    _add_modes(parser)
    add_ddp_arguments(parser)


def _select(argv: Sequence[str]) -> AddArguments:
    """The mode chosen by the bench arguments (``--inference``, ``--ddp N`` / ``--ddp=N``, else training)."""
    if "--inference" in argv:
        return _add_inference
    if any(a == "--ddp" or a.startswith("--ddp=") for a in argv):
        return _add_ddp
    return _add_training


def _run(args: argparse.Namespace) -> int:
    from .table import require_rich

    require_rich("convbn bench")  # its progress bars and tables: fail before the benchmark, not after
    if args.inference:
        from .inference import main_inference as main
    elif args.ddp:
        from .ddp import main_ddp as main
    else:
        from .training import main_training as main
    return int(main(args))


COMMAND = Command(
    name="bench",
    help="benchmarks: training memory/speed (default), --inference latency, --ddp N data-parallel",
    add_arguments=_add_training,
    run=_run,
    select=_select,
)
