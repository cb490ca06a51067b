"""What answering :func:`convbn.max_batch` costs in memory and time, on CPU, against the
training it answers for (issue 41 item 2).

For one model and limit: ``max_batch(model, x, memory, optimizer=SGD(momentum=0.9))``
under :func:`convbn.memory.allocator_peak` (every byte the CPU allocator serves above what
was live before the call: the copy, its optimizer state, the steps, the convolutions'
scratch space), its wall time, and for comparison, measured the same way in the same
process, what training at the answers takes: a copy of the model and optimizer, its
warm-up step and one standard-loop step at the eager answer.

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python benchmarks/bm_max_batch_peak.py \\
        --model tv:resnet50 --size 224 --memory 768MiB [--confirm auto|true|false]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bm_peak_vs_eager import MODELS  # noqa: E402

import convbn  # noqa: E402
from convbn.batch_search import batch_of  # noqa: E402
from convbn.memory import allocator_peak, format_bytes  # noqa: E402
from convbn.memory.budget import parse_memory  # noqa: E402


def _train_at(model: torch.nn.Module, sample: tuple, batch: int) -> int:
    """Allocator peak of a copy + warm-up + one standard-loop step at ``batch`` (eager)."""
    def run() -> None:
        m = copy.deepcopy(model).train()
        o = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
        x = batch_of(sample, batch)
        for _ in range(2):  # the first makes the momentum buffers, the second is the step measured alike
            o.zero_grad(set_to_none=True)
            m(*x).float().mean().backward()
            o.step()
    return allocator_peak(run)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tv:resnet50")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--memory", default="768MiB")
    parser.add_argument("--confirm", default="auto", choices=["auto", "true", "false"])
    args = parser.parse_args(argv)
    confirm: Any = {"auto": "auto", "true": True, "false": False}[args.confirm]
    torch.manual_seed(0)
    model, _shape = MODELS[args.model]()
    model.train()
    sample = (torch.randn(2, 3, args.size, args.size),)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    out: Dict[str, Any] = {}
    t = time.perf_counter()
    peak = allocator_peak(lambda: out.setdefault("fit", convbn.max_batch(model, sample, args.memory, optimizer=opt,
                                                                        confirm=confirm, progress=True)))
    seconds = time.perf_counter() - t
    fit = out["fit"]
    limit = parse_memory(args.memory)
    print(fit)
    eager = _train_at(model, sample, fit.eager_batch)
    print(f"| model | memory | confirm | eager / convbn batch | answering: allocator peak | over the memory | "
          f"training at the eager answer | max_batch time |")
    print(f"| {args.model} {args.size}² | {args.memory} | {args.confirm} | {fit.eager_batch} / {fit.convbn_batch} | "
          f"{format_bytes(peak)} ({peak / limit:.3f} x) | {format_bytes(peak - limit)} | {format_bytes(eager)} "
          f"({eager / limit:.3f} x) | {seconds:.0f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
