"""The (peak, time) frontier of one model: eager, torch.compile (with and without an
activation-memory budget), per-block checkpointing and convbn's plans from the lowest peak to
eager's, each with and without compile, measured side by side in one process.

Setup (building, converting, compiling: untimed), ``--warmup`` untimed steps per
configuration, each step's peak measured once (exact on CPU: every byte the CPU allocator
serves, compiled code's buffers included), then ``--rounds`` interleaved rounds of one step
per configuration, order rotated each round; the printed table gives peak and median step time
as ratios of eager's and marks the frontier (no other point at least as low on both axes and
lower on one). See :mod:`convbn.bench.frontier_run`.

    python benchmarks/bm_frontier.py --model torchvision:resnet18 --batch-size 8 --image-size 112
    python benchmarks/bm_frontier.py --model torchvision:resnet18 --batch-size 8 --image-size 112 --precision bf16
    python benchmarks/bm_frontier.py --model mnist --batch-size 4 --no-compile --plans 1 --rounds 1   # smoke
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402
from convbn.bench.frontier import frontier_table  # noqa: E402
from convbn.bench.frontier_run import PRECISIONS, FrontierSettings, run_frontier  # noqa: E402
from convbn.bench.models import build_model  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="torchvision:resnet18")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=None, help="default: the model's own input size")
    ap.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--plans", type=int, default=3, help="convert peak=X plans from the lowest peak to eager's")
    ap.add_argument("--compile-budget", type=float, action="append", default=None)
    ap.add_argument("--time-budget", type=float, action="append", default=[], help="add convert(time_budget=T)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--layout-optimization", choices=("on", "off"), default=None,
                    help="inductor's layout optimisation for every compiled configuration (default: inductor's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model.startswith("torchvision:"):
        import_torchvision_without_fake_kernels()  # torchvision's CPU wheel: model code only (tests/zoo.py)
    base, shape = build_model(args.model)
    if args.image_size:
        shape = (shape[0],) + (args.image_size,) * (len(shape) - 1)
    base = base.to(args.device).train()
    x = torch.randn(args.batch_size, *shape, device=args.device)
    settings = FrontierSettings(precision=args.precision, compile=not args.no_compile,
                                compile_budgets=tuple(args.compile_budget or (0.5, 0.3)), plans=args.plans,
                                time_budgets=tuple(args.time_budget), rounds=args.rounds, warmup=args.warmup,
                                layout_optimization=None if args.layout_optimization is None
                                else args.layout_optimization == "on")
    points = run_frontier(base, x, settings, progress=lambda s: print(f"# {s}", file=sys.stderr, flush=True))
    clock = "thread CPU time" if args.device == "cpu" and args.threads == 1 else "wall time"
    print(f"# {args.model} input {'x'.join(map(str, x.shape))} {args.precision} on {args.device}, torch "
          f"{torch.__version__}, convbn {convbn.__version__}, {args.threads} thread(s), {args.rounds} interleaved "
          f"rounds ({clock}), peak: {'CPU allocator' if args.device == 'cpu' else 'CUDA allocator'}"
          + (f", inductor layout optimisation {args.layout_optimization}" if args.layout_optimization else ""))
    print(frontier_table(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
