"""Same-process step time of convbn plans, interleaved, with CPU time beside wall time.

One training step (gradients set to None, forward, mean loss, backward; no optimizer) of
the eager model and of each ``convert(strategy="auto", ...)`` plan asked for, run round
robin (round ``r`` starts at configuration ``r mod n``) so that load changes hit every
configuration alike. Per configuration: the median wall time, the median CPU time of the
calling thread (``time.thread_time``: with one intra-op thread, forward and backward both
run on it, and time the process spent waiting for a core on a shared machine is not
counted), their ratios to eager and to ``--ref``, the conv recompute per step (the report's
``extra_flops``) and the planner's predicted peak. ``--profile N`` adds a table of each
operator's self time, the median over ``N`` profiled steps per configuration
(``torch.profiler``, CPU), to attribute a difference: conv forwards (recompute), conv and
BN backwards, element-wise rebuilds, the Functions' Python. ``--base REV`` adds the ``auto``
plan of convbn as of git revision ``REV``, imported beside this tree in the same process
(:func:`_import_revision`): "then vs now" without a second process, whose allocator state
alone moves eager's step by several percent on this machine.

Run::

    python benchmarks/bm_step_time.py --model "monai:resnet50(spatial_dims=2,n_input_channels=3,conv1_t_stride=2)" \\
        --batch-size 8 --image-size 224 --threads 1 --rounds 9 --budget 0.483 --peak-budget 0.5 --ref budget=0.483
    python benchmarks/bm_step_time.py --threads 2 --rounds 15 --base bce2aca --ref "base auto"
"""
from __future__ import annotations

import argparse
import collections
import copy
import functools
import importlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import statistics
import time
from typing import Any, Dict, List, Tuple
from unittest import mock

import torch
from torch import nn

import convbn
from convbn.bench.models import build_model
from convbn.passes.plan import auto_plan, peak_planner


def _import_revision(rev: str, into: str) -> Any:
    """convbn as of git revision ``rev``, importable beside this tree's as ``convbn_base``.

    The revision's ``src/convbn`` is extracted into ``into`` under the new name; its absolute
    ``convbn`` imports and its ``torch.library`` namespace (``convbn::``, one registration per
    process) are renamed textually, nothing else. Both versions then run in one process, so
    eager, the base's plan and this tree's plan share one allocator and one machine state.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", root, "archive", rev, "src/convbn"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    pkg = os.path.join(into, "convbn_base")
    os.rename(os.path.join(into, "src", "convbn"), pkg)
    for folder, _, files in os.walk(pkg):
        for f in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, f)
            with open(path) as fh:
                text = fh.read()
            text = re.sub(r"^(\s*)from convbn([. ])", r"\1from convbn_base\2", text, flags=re.M)
            text = re.sub(r"^(\s*)import convbn\b", r"\1import convbn_base", text, flags=re.M)
            text = text.replace('"convbn::', '"convbn_base::').replace('("convbn",', '("convbn_base",')
            with open(path, "w") as fh:
                fh.write(text)
    sys.path.insert(0, into)
    return importlib.import_module("convbn_base")


def _configs(model: nn.Module, x: torch.Tensor, budgets: List[float], peaks: List[float],
             tolerances: List[float] = (), base: Any = None, strategies: List[str] = ()) -> Dict[str, nn.Module]:
    out: Dict[str, nn.Module] = {"eager": model, "auto": convbn.convert(copy.deepcopy(model), example_inputs=x)}
    if base is not None:
        out["base auto"] = base.convert(copy.deepcopy(model), example_inputs=x)
    for t in tolerances:
        # the default plan with another tolerance above the lowest peak (peak_planner.PEAK_TOLERANCE):
        # what a different default would cost in time
        plan = functools.partial(peak_planner.plan_for_peak, tolerance=t)
        with mock.patch.object(auto_plan, "plan_for_peak", plan):
            out[f"tol={t:g}"] = convbn.convert(copy.deepcopy(model), example_inputs=x)
    for b in budgets:
        out[f"budget={b:g}"] = convbn.convert(copy.deepcopy(model), example_inputs=x, memory_budget=b)
    for p in peaks:
        out[f"peak={p:g}"] = convbn.convert(copy.deepcopy(model), example_inputs=x, peak_budget=p)
    for s in strategies:
        out[s] = convbn.convert(copy.deepcopy(model), example_inputs=x, strategy=s)
    return out


def _step(model: nn.Module, x: torch.Tensor) -> None:
    # the "auto+kernels" configuration runs its whole step with the fused element-wise kernels
    with convbn.fused_kernels(bool(getattr(model, "_bm_fused_kernels", False))):
        for p in model.parameters():
            p.grad = None
        model(x).float().mean().backward()


def _time(cfgs: Dict[str, nn.Module], x: torch.Tensor, rounds: int) -> Tuple[Dict[str, float], Dict[str, float]]:
    wall: Dict[str, List[float]] = collections.defaultdict(list)
    cpu: Dict[str, List[float]] = collections.defaultdict(list)
    names = list(cfgs)
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t, c = time.perf_counter(), time.thread_time()
            _step(cfgs[n], x)
            cpu[n].append(time.thread_time() - c)
            wall[n].append(time.perf_counter() - t)
    return ({n: statistics.median(v) for n, v in wall.items()}, {n: statistics.median(v) for n, v in cpu.items()})


def _profile(cfgs: Dict[str, nn.Module], x: torch.Tensor, steps: int, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    runs: Dict[str, List[Dict[str, float]]] = {n: [] for n in cfgs}
    counts: Dict[str, Dict[str, int]] = {n: {} for n in cfgs}
    for _ in range(steps):
        for n, m in cfgs.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _step(m, x)
            events = prof.key_averages()
            runs[n].append({e.key: e.self_cpu_time_total / 1e3 for e in events})
            counts[n].update({e.key: e.count for e in events})
    med = {n: {k: statistics.median([r.get(k, 0.0) for r in rs]) for k in set().union(*rs)} for n, rs in runs.items()}
    keys = sorted(set().union(*med.values()), key=lambda k: -max(m.get(k, 0.0) for m in med.values()))[:top]
    print(f"\n| operator (self ms, median of {steps}; calls) | " + " | ".join(cfgs) + " |")
    print("|---|" + "---:|" * len(cfgs))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{med[n].get(k, 0.0):.1f} ({counts[n].get(k, 0)})" for n in cfgs) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="monai:resnet50(spatial_dims=2,n_input_channels=3,conv1_t_stride=2)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=None,
                    help="spatial size of the input (default: the model's own, 28 for mnist)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds, one step of every configuration each")
    ap.add_argument("--budget", type=float, action="append", default=[], help="add convert(memory_budget=X)")
    ap.add_argument("--peak-budget", type=float, action="append", default=[], help="add convert(peak_budget=X)")
    ap.add_argument("--tolerance", type=float, action="append", default=[],
                    help="add the default plan made with this tolerance above the lowest peak")
    ap.add_argument("--base", default=None, metavar="REV",
                    help="add 'base auto': convert(auto) of convbn at git revision REV, in this process")
    ap.add_argument("--strategy", action="append", default=[], choices=("recompute_bn", "recompute_conv"),
                    help="add convert(strategy=S)")
    ap.add_argument("--fused-kernels", action="store_true",
                    help="add 'C+kernels' for every converted configuration C: the same plan with the fused "
                         "element-wise kernels (issue 25)")
    ap.add_argument("--ref", default="auto", help="the configuration the last ratio column is to")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="also profile N steps per configuration")
    ap.add_argument("--top", type=int, default=25, help="operators shown by --profile")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, shape = build_model(args.model)
    spatial = shape[1:] if args.image_size is None else [args.image_size] * (len(shape) - 1)
    x = torch.randn(args.batch_size, shape[0], *spatial)
    base = _import_revision(args.base, tempfile.mkdtemp(prefix="convbn_base_")) if args.base else None
    cfgs = _configs(model.train(), x, args.budget, args.peak_budget, args.tolerance, base, args.strategy)
    if args.fused_kernels:  # each plan again, with autograd/chain_kernels.py's fused kernels on
        for n in [n for n in cfgs if n not in ("eager", "base auto")]:
            cfgs[f"{n}+kernels"] = copy.deepcopy(cfgs[n])
            cfgs[f"{n}+kernels"]._bm_fused_kernels = True
    if args.ref not in cfgs:
        raise SystemExit(f"--ref {args.ref!r} is not one of {list(cfgs)}")
    for m in cfgs.values():  # warm-up
        _step(m, x)
    wall, cpu = _time(cfgs, x, args.rounds)
    print(f"{args.model}, input {tuple(x.shape)}, {args.threads} thread(s), {args.rounds} interleaved rounds")
    print(f"\n| config | recompute GMAC | predicted peak MiB | wall ms | wall / eager | CPU ms | CPU / eager | "
          f"CPU / {args.ref} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n, m in cfgs.items():
        rep = getattr(m, "convbn_report", None)
        gmac = f"{sum(p.extra_flops for p in rep.pairs) / 1e9:.2f}" if rep is not None else "-"
        predicted = getattr(rep, "predicted_peak_bytes", None)  # a base revision may not predict peaks
        peak = f"{predicted / 2**20:.1f}" if predicted else "-"
        print(f"| {n} | {gmac} | {peak} | {wall[n] * 1e3:.1f} | {wall[n] / wall['eager']:.3f} | {cpu[n] * 1e3:.1f} | "
              f"{cpu[n] / cpu['eager']:.3f} | {cpu[n] / cpu[args.ref]:.3f} |")
    if args.profile:
        _profile(cfgs, x, args.profile, args.top)


if __name__ == "__main__":
    main()
