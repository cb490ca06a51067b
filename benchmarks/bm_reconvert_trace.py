"""A re-convert after a resume (``convert(..., plan=saved)``) with and without the plan's answers
to whether each traced graph depends on the mode (Note: [a mode dependence answered once]).

One process: one first ``convert`` (setup, timed once), then ``--rounds`` interleaved rounds of
[re-convert with the plan as saved, re-convert with the plan's ``modes`` removed (each module
traced a second time with ``training`` flipped, as before the plan carried them)]. Times in the
process's CPU seconds (``time.process_time``, one thread: steadier than wall-clock on a shared
machine) and wall-clock seconds, each as a ratio to the first convert.

    python benchmarks/bm_reconvert_trace.py [--model hrnet|r18|r50|crnn] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from bm_convert_cost import MODELS  # noqa: E402

import convbn  # noqa: E402


def _timed(fn: Callable[[], Any]) -> Tuple[float, float, Any]:
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - cpu, time.perf_counter() - wall, out


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hrnet", choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    label, make, shape = MODELS[args.model]
    torch.manual_seed(0)
    model, x = make(), torch.randn(shape)
    cpu1, wall1, fast = _timed(lambda: convbn.convert(model, example_inputs=x, progress=False))
    plan = fast.convbn_report.plan.as_dict()
    without = dict(plan, modes=[])
    print(f"torch {torch.__version__}; {label}, input {'x'.join(map(str, shape))}: first convert {cpu1:.2f} CPU s, "
          f"{wall1:.2f} s")
    print("| round | re-convert | CPU s (x first) | wall s (x first) |")
    print("|---|---|---:|---:|")
    for r in range(args.rounds):
        for name, p in (("plan as saved", plan), ("plan without its mode answers", without)):
            cpu, wall, again = _timed(lambda: convbn.convert(model, example_inputs=x, progress=False, plan=p))
            assert again.convbn_report.reused_plan
            print(f"| {r + 1} | {name} | {cpu:.2f} ({cpu / cpu1:.3f}x) | {wall:.2f} ({wall / wall1:.3f}x) |", flush=True)


if __name__ == "__main__":
    main()
