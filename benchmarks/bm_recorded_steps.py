"""The planner's four recorded steps (the eager step and the converted all-recompute step, at
batches 1 and 2: Note: [measured on two slices of the batch]) with convbn's meter, with torch's
``MemTracker`` / ``ModTracker`` hooks as they are, and the same four steps unmetered.

For each model (setup not timed: one ``convert``, the eager reference shared with it): one
warm-up round, then ``--rounds`` interleaved rounds of [the four steps with convbn's meter, the
four with torch's hooks, the four unmetered], each in this process's CPU seconds
(``time.process_time``, one thread), medians, as ratios to one eager training step at the example
batch measured in the same rounds. Both metered sides must record the same numbers (the eager
step's timeline points and every number of the planner's inputs): the script checks it.

    python benchmarks/bm_recorded_steps.py [--models r50 r18] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402
from convbn.memory import peaks  # noqa: E402
from convbn.passes.check.validate import StateSnapshot  # noqa: E402
from convbn.passes.graph.graph_module import eager  # noqa: E402
from convbn.passes.graph.share_copy import share_copy  # noqa: E402
from convbn.passes.plan.chain_plans import recompute_all  # noqa: E402
from convbn.passes.plan.plan_inputs import chains_of, trained_outputs_loss  # noqa: E402
from convbn.passes.plan.sliced_measure import SLICE_PAIRS, record_eager_and_chains  # noqa: E402

#: name -> (label, model factory, example batch shape)
MODELS: Dict[str, Tuple[str, Callable[[], nn.Module], Tuple[int, ...]]] = {
    "r50": ("torchvision ResNet-50", lambda: import_torchvision_without_fake_kernels().models.resnet50(),
            (8, 3, 224, 224)),
    "r18": ("torchvision ResNet-18", lambda: import_torchvision_without_fake_kernels().models.resnet18(),
            (16, 3, 224, 224)),
}


def _unmetered(model: nn.Module, x: torch.Tensor) -> None:
    """One training step as the planner records it (mean loss, no optimizer), state put back, no meter."""
    with StateSnapshot(model):
        model.train()
        for p in model.parameters():
            p.grad = None
        trained_outputs_loss(model(x)).backward()
        for p in model.parameters():
            p.grad = None


def _torch_hooks(on: bool) -> None:
    """Swap in torch's tracker and hooks as they are (``on``) or convbn's meter back."""
    peaks.lean_mem_tracker = (lambda base: base) if on else _LEAN
    peaks.releasing_mod_tracker = (lambda backward=True: _RELEASING()) if on else _RELEASING


_LEAN, _RELEASING = peaks.lean_mem_tracker, peaks.releasing_mod_tracker


def measure(key: str, rounds: int) -> Dict[str, Any]:
    label, make, shape = MODELS[key]
    torch.manual_seed(0)
    x = torch.randn(shape)
    fast = convbn.convert(make(), example_inputs=x, progress=False)
    with eager(fast):
        reference = share_copy(fast)
    pair = SLICE_PAIRS[0]
    recorded: Dict[str, Any] = {}

    def metered(torch_hooks: bool) -> None:
        _torch_hooks(torch_hooks)
        try:
            runs = [record_eager_and_chains(reference, fast, (x[:b],)) for b in pair]
        finally:
            _torch_hooks(False)
        recorded[str(torch_hooks)] = [(r.eager_points, r.eager_ops, r.inputs) for r in runs]

    def plain() -> None:
        for m in chains_of(fast):
            m.apply_plan(recompute_all(m))
        for b in pair:
            _unmetered(reference, x[:b])
            _unmetered(fast, x[:b])

    sides = {"convbn's meter": lambda: metered(False), "torch's hooks": lambda: metered(True),
             "unmetered": plain, "eager step": lambda: _unmetered(reference, x)}
    cpu: Dict[str, List[float]] = {k: [] for k in sides}
    for r in range(rounds + 1):
        for k, f in sides.items():
            c = time.process_time()
            f()
            if r:  # the first round warms up
                cpu[k].append(time.process_time() - c)
    assert recorded["False"] == recorded["True"], "the two meters recorded different numbers"
    return dict(label=label, shape=shape, pair=pair, **{k: statistics.median(v) for k, v in cpu.items()})


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["r50"], choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, cpu, threads 1, load average {os.getloadavg()[0]:.1f}")
    print("| model | batches | eager step (CPU s) | four steps unmetered (x) | convbn's meter (x) | "
          "torch's hooks (x) | meter's own cost: convbn / torch's (x) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for key in args.models:
        m = measure(key, args.rounds)
        e = m["eager step"]
        ours, theirs, plain = m["convbn's meter"], m["torch's hooks"], m["unmetered"]
        print(f"| {m['label']} {'x'.join(map(str, m['shape']))} | {m['pair'][0]}, {m['pair'][1]} | {e:.2f} | "
              f"{plain:.2f} ({plain / e:.2f}x) | {ours:.2f} ({ours / e:.2f}x) | {theirs:.2f} ({theirs / e:.2f}x) | "
              f"{(ours - plain) / e:.2f}x / {(theirs - plain) / e:.2f}x |", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}; both meters recorded the same numbers")


if __name__ == "__main__":
    main()
