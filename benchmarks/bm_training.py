"""Training benchmark as code (fvcore ``bm_*`` style): a parameter list, one run per case, one table.

Every case runs all configurations of :mod:`convbn.bench.training` (eager, ``convbn.convert``
strategies, checkpoint per block, ``torch.compile`` with activation-memory budgets) in one
process, round-robin; building, planning and compiling happen before the timed steps.

Run (on a quiet machine; ``--quick`` for a smoke run)::

    python benchmarks/bm_training.py --json training.json --plot training.png --markdown training.md
    python benchmarks/bm_training.py --quick
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List

from convbn.bench.training import TrainingRow, print_table, rows_to_json, rows_to_markdown, run_training_bench, write_plot

#: One dict of :func:`run_training_bench` keyword arguments per case.
CASES: List[Dict[str, Any]] = [
    dict(spec="mnist", batch_size=256),
    dict(spec="monai:resnet18", batch_size=16, image_size=128),
    dict(spec="monai:resnet50(spatial_dims=2,n_input_channels=3,conv1_t_stride=2)", batch_size=8, image_size=128),
    dict(spec="efficientnet:b0", batch_size=8, image_size=128),
    dict(spec="monai:DenseNet121", batch_size=8, image_size=128),
    dict(spec="monai:UNet", batch_size=2, image_size=48),
]
QUICK_CASES: List[Dict[str, Any]] = [dict(spec="mnist", batch_size=64)]


def bm_training(cases: List[Dict[str, Any]], steps: int, warmup: int, use_compile: bool,
                budgets: List[float]) -> List[TrainingRow]:
    rows: List[TrainingRow] = []
    for case in cases:
        rows += run_training_bench(steps=steps, warmup=warmup, use_compile=use_compile, budgets=budgets, **case)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="mnist only, no torch.compile, few steps")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget", type=float, action="append", default=None, help="default: 0.35")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--plot", default=None, metavar="PATH")
    parser.add_argument("--markdown", default=None, metavar="PATH")
    args = parser.parse_args()
    cases = QUICK_CASES if args.quick else CASES
    steps, warmup = (3, 1) if args.quick else (args.steps, args.warmup)
    rows = bm_training(cases, steps, warmup, not (args.no_compile or args.quick),
                       [0.35] if args.budget is None else args.budget)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(rows_to_json(rows) + "\n")
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(rows_to_markdown(rows) + "\n")
    if args.plot:
        write_plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
