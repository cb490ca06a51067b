"""Where a per-sample-norm net's training step spends its time: torch.profiler, eager beside convert.

The nets of :mod:`bm_norm_peaks` (no library needed); each configuration warmed up once, then
``--steps`` standard steps (``zero_grad(set_to_none=True)``, forward, mean loss, backward, SGD
step) under :class:`torch.profiler.profile` (CPU), printed as the profiler's table by self time::

    python benchmarks/bm_norm_profile.py --net 2 [--steps 2] [--rows 18]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bm_norm_peaks as bm  # noqa: E402

import convbn  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--net", type=int, default=0, help=f"index into bm_norm_peaks.MODELS (0..{len(bm.MODELS) - 1})")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=18)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    label, make, shape, _ = bm.MODELS[args.net]
    torch.manual_seed(0)
    eager = make()
    x = torch.randn(shape)
    converted = convbn.convert(copy.deepcopy(eager), example_inputs=(x,))
    print(f"{label} {tuple(shape)}")
    for name, model in (("eager", eager), ("convert", converted)):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        bm._step_time(model, x, opt)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                bm._step_time(model, x, opt)
        print(f"===== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=45))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
