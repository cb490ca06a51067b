"""What ``convert(model, example_inputs=x)`` itself costs, against one eager training step on the same x.

For each model (setup not timed): one eager warm-up step, then ``--rounds`` interleaved rounds
of [one eager training step, one ``convert``], then one ``convert(plan=...)`` with the first
conversion's plan (a re-convert after a resume: Note: [a conversion made once]). Times are
medians, as ratios to the eager step of the same process, both in wall-clock seconds and in
this process's CPU seconds (``time.process_time``: one thread, so on a machine shared with
other jobs the CPU ratio moves far less with their load than the wall-clock one). Peaks, in a separate pass (the meter
slows what it measures): the allocator's peak over the whole ``convert`` call above what was
live before it, and over one eager step (``zero_grad(set_to_none=True)``, forward, mean
loss, backward, SGD step with momentum): on CPU every allocation and free the CPU allocator
reports to ``torch.profiler`` (:func:`convbn.memory.allocator_peak`), on CUDA the caching
allocator's blocks the same way (not ``max_memory_allocated``: the planner's CUDA meter resets
that counter inside convert, which hid all but the last part of the call).

    python benchmarks/bm_convert_cost.py [--models r18 r50 hrnet crnn] [--rounds 2] [--device cpu|cuda] [--no-peaks]
                                         [--phases]

``--phases``: also one more ``convert`` whose CPU seconds are split by where they go (the check's
eager and converted steps, the planner's recorded steps, the rest: tracing, matching, planning),
each as a ratio to the eager step; the functions are wrapped for that call only.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from convert_cost_models import CRNNLike, HRNetLike  # noqa: E402
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402
from convbn.memory import allocator_peak  # noqa: E402


def _tv(name: str) -> Callable[[], nn.Module]:
    return lambda: getattr(import_torchvision_without_fake_kernels().models, name)()


#: name -> (label, model factory, input shape)
MODELS: Dict[str, Tuple[str, Callable[[], nn.Module], Tuple[int, ...]]] = {
    "r18": ("torchvision ResNet-18", _tv("resnet18"), (16, 3, 224, 224)),
    "r50": ("torchvision ResNet-50", _tv("resnet50"), (8, 3, 224, 224)),
    "hrnet": ("HRNet-style segmenter (293 BN)", HRNetLike, (2, 3, 128, 128)),
    "crnn": ("CRNN-style recogniser (11 BN, BiLSTM)", CRNNLike, (8, 1, 32, 128)),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes over ``fn()`` above what was live before it, by the allocator's own events
    (on CUDA too: ``max_memory_allocated`` does not nest, and convert's CUDA meters reset it)."""
    _sync(device)
    return allocator_peak(fn, device)


def _timed(fn: Callable[[], Any], device: torch.device, cpu: List[float]) -> Tuple[float, Any]:
    """Wall-clock seconds of ``fn()`` and its result; its CPU seconds are appended to ``cpu``."""
    _sync(device)
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    _sync(device)
    cpu.append(time.process_time() - c)
    return time.perf_counter() - t, out


def measure(key: str, rounds: int, device: torch.device, peaks: bool = True) -> Dict[str, Any]:
    label, make, shape = MODELS[key]
    torch.manual_seed(0)
    model = make().to(device)
    x = torch.randn(shape, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(x)  # held through the backward, as a loss that saves the output (cross-entropy) holds as much
        (out if isinstance(out, torch.Tensor) else out[0]).float().mean().backward()
        opt.step()

    step()  # warm-up (and the momentum buffers exist from here on)
    steps: List[float] = []
    converts: List[float] = []
    cpu_steps: List[float] = []
    cpu_converts: List[float] = []
    cpu_again: List[float] = [float("nan")]
    fast: Any = None
    for _ in range(rounds):
        steps.append(_timed(step, device, cpu_steps)[0])
        opt.zero_grad(set_to_none=True)
        t, fast = _timed(lambda: convbn.convert(model, example_inputs=x, progress=False), device, cpu_converts)
        converts.append(t)
    again_t = float("nan")
    if getattr(fast.convbn_report, "plan", None) is not None:  # (a convbn without convert(plan=...): not timed)
        plan = fast.convbn_report.plan.as_dict()
        again_t, again = _timed(lambda: convbn.convert(model, example_inputs=x, progress=False, plan=plan), device,
                                cpu_again)
        assert again.convbn_report.reused_plan and again.convbn_report.plan == fast.convbn_report.plan
        del again
    del fast
    gc.collect()
    step_t = statistics.median(steps)
    cpu = dict(cpu_step=statistics.median(cpu_steps), cpu_convert=statistics.median(cpu_converts), cpu_again=cpu_again[-1])
    if not peaks:
        return dict(label=label, batch=shape, step=step_t, convert=statistics.median(converts), again=again_t,
                    eager_peak=float("nan"), convert_peak=float("nan"), **cpu)
    eager_peak = _peak(step, device)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    held: List[Any] = []
    convert_peak = _peak(lambda: held.append(convbn.convert(model, example_inputs=x, progress=False)), device)
    return dict(label=label, batch=shape, step=step_t, convert=statistics.median(converts), again=again_t,
                eager_peak=eager_peak, convert_peak=convert_peak, **cpu)


#: (module, function, label) of what ``--phases`` times
PHASES = (("convbn.passes.check.step", "_eager_step", "check: eager step"),
          ("convbn.passes.check.step", "_streamed", "check: converted step (comparisons included)"),
          ("convbn.passes.plan.sliced_measure", "record_eager_and_chains", "planner: recorded eager + converted steps"),
          ("convbn.passes.plan.auto_plan", "record_eager_and_chains", "planner: recorded eager + converted steps"))


def phases(key: str, device: torch.device) -> List[Tuple[str, float]]:
    """CPU seconds of one ``convert`` of ``key``'s model split by :data:`PHASES` (and the rest), after
    one warm-up eager step; first the CPU seconds of an eager forward and backward (mean loss, no
    optimizer step)."""
    import importlib

    label, make, shape = MODELS[key]
    torch.manual_seed(0)
    model = make().to(device)
    x = torch.randn(shape, device=device)
    model(x).float().mean().backward()  # warm-up
    model.zero_grad(set_to_none=True)
    cpu: List[float] = []
    _timed(lambda: model(x).float().mean().backward(), device, cpu)
    model.zero_grad(set_to_none=True)
    spent: Dict[str, float] = {}
    saved = []
    for mod_name, fn, what in PHASES:
        mod = importlib.import_module(mod_name)
        saved.append((mod, fn, getattr(mod, fn)))

        def timed(*a: Any, _f: Any = getattr(mod, fn), _w: str = what, **k: Any) -> Any:
            c = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                spent[_w] = spent.get(_w, 0.0) + time.process_time() - c
        setattr(mod, fn, timed)
    try:
        _timed(lambda: convbn.convert(model, example_inputs=x, progress=False), device, cpu)
    finally:
        for mod, fn, f in saved:
            setattr(mod, fn, f)
    rest = cpu[1] - sum(spent.values())
    return [("eager step", cpu[0]), ("convert", cpu[1]), *spent.items(), ("the rest", rest)]


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-peaks", action="store_true", help="times only (no allocator pass)")
    parser.add_argument("--phases", action="store_true", help="also where one convert's CPU seconds go")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}, threads {torch.get_num_threads()}")
    print("| model | input | eager step | convert (x eager step) | convert(plan=) (x first convert) "
          "| CPU s: eager step / convert (x) / convert(plan=) (x first) "
          "| eager step peak | convert peak | convert / eager peak |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for key in args.models:
        r = measure(key, args.rounds, device, peaks=not args.no_peaks)
        mib = 2 ** 20
        print(f"| {r['label']} | {'x'.join(map(str, r['batch']))} | {r['step']:.2f} s | {r['convert']:.1f} s "
              f"({r['convert'] / r['step']:.1f}x) | {r['again']:.2f} s ({r['again'] / r['convert']:.3f}x) "
              f"| {r['cpu_step']:.2f} / {r['cpu_convert']:.1f} ({r['cpu_convert'] / r['cpu_step']:.1f}x) / "
              f"{r['cpu_again']:.2f} ({r['cpu_again'] / r['cpu_convert']:.3f}x) "
              f"| {r['eager_peak'] / mib:.1f} MiB | {r['convert_peak'] / mib:.1f} MiB "
              f"| {r['convert_peak'] / r['eager_peak']:.4f} ({r['convert_peak'] - r['eager_peak']:+.0f} B) |", flush=True)
    if args.phases:
        labels = list(dict.fromkeys(w for _, _, w in PHASES))
        print("\n| model | " + " | ".join(["eager step (CPU s)", "convert"] + labels + ["the rest"])
              + " |\n|---|" + "---:|" * (len(labels) + 3))
        for key in args.models:
            parts = phases(key, device)
            step = parts[0][1]
            cells = [f"{parts[0][1]:.2f}"] + [f"{s:.2f} ({s / step:.2f}x)" for _, s in parts[1:]]
            print(f"| {MODELS[key][0]} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
