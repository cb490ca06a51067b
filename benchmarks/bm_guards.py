"""What guarding a converted model costs: per call, and on the first call.

torchvision's ResNet-50, batch 8, 224x224, CPU, float32, ``convbn.convert`` without
``example_inputs`` (the path whose first call checks the rewrite against the original):

* ``convert``: seconds for ``convbn.convert(model)``;
* ``first step``: seconds for the first forward + backward (the first-call check, the lazy
  plan, the first-backward check);
* ``step``: median seconds of a later forward + backward;
* ``guards``: microseconds per call for checking every installed forward's guards (the
  checks ``nn.Module.__call__`` runs before the graph), median of many repetitions; with
  the number of modules guarded; and milliseconds to build them (part of ``convert``, once
  per installed forward). Absent on a build without guards.

Run on a checkout without guards (``PYTHONPATH=<that>/src``) for the "before" figures.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/bm_guards.py [--steps 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import convbn  # noqa: E402
from convbn.passes.graph.graph_module import installed  # noqa: E402
from zoo import import_torchvision_without_fake_kernels  # noqa: E402


def step(model: torch.nn.Module, x: torch.Tensor) -> float:
    t = time.perf_counter()
    model(x).mean().backward()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="later steps timed (median)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-steps", action="store_true", help="guards only: no training steps timed")
    args = parser.parse_args()
    tv = import_torchvision_without_fake_kernels()
    torch.manual_seed(0)
    model = tv.models.resnet50()
    x = torch.randn(args.batch, 3, 224, 224)
    t = time.perf_counter()
    fast = convbn.convert(model)
    t_convert = time.perf_counter() - t
    t_first = step(fast, x) if not args.no_steps else float("nan")
    later = statistics.median(step(fast, x) for _ in range(args.steps)) if not args.no_steps else float("nan")
    forwards = [f for f in map(installed, fast.modules()) if f is not None]
    guards = [f.guards for f in forwards if getattr(f, "guards", None) is not None]
    print(f"ResNet-50 b{args.batch} 224x224 CPU, {torch.get_num_threads()} threads, "
          f"{len(fast.convbn_report.pairs)} pairs fused, {len(forwards)} installed forwards")
    print(f"convert      {t_convert:8.3f} s")
    print(f"first step   {t_first:8.3f} s (forward + backward, checks included)")
    print(f"later step   {later:8.3f} s (median of {args.steps})")
    if guards:
        reps = 2000
        times = []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(reps):
                for g in guards:
                    assert g.changed() is None
            times.append((time.perf_counter() - t) / reps * 1e6)
        guarded = sum(len(g) for g in guards)
        us = statistics.median(times)
        print(f"guards       {us:8.1f} us per call ({guarded} modules guarded; "
              f"{us * 1e-6 / later * 100:.4f} % of a step)")
        builds = []
        for _ in range(7):
            t = time.perf_counter()
            for g in guards:
                g.refresh()  # records every guarded module again, as installing does
            builds.append((time.perf_counter() - t) * 1e3)
        print(f"guard build  {statistics.median(builds):8.2f} ms (once per installed forward, in convert)")
    else:
        print("guards       none (a build without guards)")


if __name__ == "__main__":
    main()
