"""``convert(time_budget=T)``: its predicted step time against the measured one, on several models.

For each model and each ``--time-budget T``: ``convbn.convert(model, example_inputs=x,
time_budget=T)`` (the step costs measured inside that call, Note: [a plan's step time]), then
the eager model and every plan timed in interleaved rounds (a training step: gradients set to
None, forward, mean-of-output loss, backward; thread CPU time with one thread) and each plan's
step peak measured (:func:`convbn.memory.allocator_peak`). The table gives the plan's predicted
and measured step time as ratios of eager's, the prediction error (measured / predicted - 1),
and predicted / measured peak.

    python benchmarks/bm_time_budget.py --model torchvision:resnet18 --input 8x3x112x112 \\
        --model mnist --input 64x1x28x28 --model 'monai:UNet(spatial_dims=2,in_channels=3,out_channels=2,channels=(16,32,64,128),strides=(2,2,2),norm="batch")' --input 8x3x128x128
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from typing import List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402
from convbn.bench.models import build_model  # noqa: E402
from convbn.memory import allocator_peak  # noqa: E402


def _step(model: torch.nn.Module, x: torch.Tensor) -> float:
    for p in model.parameters():
        p.grad = None
    t = time.thread_time()
    model(x).float().mean().backward()
    return time.thread_time() - t


def run(spec: str, shape: List[int], budgets: List[float], rounds: int) -> None:
    torch.manual_seed(0)
    base, _ = build_model(spec)
    base.train()
    x = torch.randn(*shape)
    models = {"eager": copy.deepcopy(base)}
    reports = {}
    for b in budgets:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = convbn.convert(copy.deepcopy(base), example_inputs=x, time_budget=b, progress=False)
        name = f"time_budget={b:g}"
        models[name], reports[name] = m, (m.convbn_report, bool(caught))
    peaks = {}
    for n, m in models.items():
        _step(m, x)
        for p in m.parameters():
            p.grad = None
        peaks[n] = allocator_peak(lambda m=m: m(x).float().mean().backward())
    times = {n: [] for n in models}
    names = list(models)
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(_step(models[n], x))
    eager = statistics.median(times["eager"])
    for n in names[1:]:
        rep, warned = reports[n]
        measured = statistics.median(times[n]) / eager
        pred = rep.predicted_time_ratio
        c = rep.step_costs
        recomputed = sum(1 for p in rep.pairs if p.kind == "layer" and p.strategy == "recompute_conv")
        print(f"| {spec.split('(')[0]} {'x'.join(map(str, shape))} | {n} | {recomputed}/{len(rep.pairs)} "
              f"| {c.eager * 1e3:.1f} | {c.base / c.eager:.3f} | {pred:.3f}{' (fastest)' if warned else ''} "
              f"| {measured:.3f} | {measured / pred - 1:+.1%} | {peaks[n] / peaks['eager']:.3f} "
              f"| {rep.predicted_peak_bytes / 2**20:.1f} / {peaks[n] / 2**20:.1f} |", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--input", action="append", required=True, help="NxCxHxW, one per --model")
    ap.add_argument("--time-budget", type=float, action="append", default=None)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    if len(args.model) != len(args.input):
        ap.error("give one --input per --model")
    torch.set_num_threads(1)
    import_torchvision_without_fake_kernels()
    print(f"# torch {torch.__version__}, 1 thread, {args.rounds} interleaved rounds (thread CPU time), "
          "peak: CPU allocator (step: zero_grad, forward, mean loss, backward)")
    print("| model | plan | convs recomputed / pairs | eager ms (in convert) | keep-all x eager (in convert) "
          "| predicted x eager | measured x eager | error | peak x eager | predicted / measured peak MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec, shape in zip(args.model, args.input):
        run(spec, [int(v) for v in shape.split("x")], args.time_budget or [1.0, 1.05, 1.2, 10.0], args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
