"""Per-sample norm chains (issue 39): the operators a training step dispatches and the host (Python)
time per chain layer, eager beside convert.

Two tables, neither read off a clock for its counts:

* ``ops``: the nets of :mod:`bm_norm_peaks` at small inputs (``--nets``: those whose label starts
  so, at their :mod:`bm_norm_peaks` inputs: the plans, and so the recompute, depend on sizes),
  one training step (zero_grad(set_to_none=True), forward in float32 or under bf16 autocast,
  float32 mean loss, backward) counted by a ``TorchDispatchMode`` (``tests/op_count_helpers.py``):
  kernels (each a launch on an accelerator) and casts / copies / allocations, eager and convert.
* ``host``: a chain of ``depth`` GroupNorm -> SiLU -> Conv layers on a 1 x 8 x 4 x 4 input, where
  compute is negligible and the step is the host's: the median step (forward, loss, backward,
  SGD step) of ``--rounds`` interleaved rounds of ``--steps`` steps each (thread CPU time, one
  intra-op thread), and convert's extra time per chain layer over eager's; beside it, exact, the
  Python function calls of one step (``cProfile``'s count, C functions called from Python included).

    python benchmarks/bm_norm_host.py [--rounds 15] [--steps 20] [--depth 8] [--only ops|host]
                                      [--nets ConvNeXt ...]
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import bm_norm_peaks as bm  # noqa: E402
from op_count_helpers import step_ops  # noqa: E402

import convbn  # noqa: E402

#: small inputs of the nets of bm_norm_peaks (a plan depends on sizes: ``--nets`` takes bm_norm_peaks' own)
SMALL = {"diffusion": (2, 3, 16, 16), "3-D": (2, 1, 8, 8, 8), "ConvNeXt": (2, 3, 32, 32)}


def ops_table(nets: Optional[List[str]] = None) -> None:
    print(f"| net ({'input' if nets else 'small input'}) | amp | kernels: eager / convert | casts, copies, allocations: "
          "eager / convert | convert's extra kernels and casts |")
    print("|---|---|---:|---:|---|")
    for label, make, full, _ in bm.MODELS:
        if nets and not any(label.startswith(n) for n in nets):
            continue
        shape = full if nets else next(v for k, v in SMALL.items() if label.startswith(k))
        torch.manual_seed(0)
        eager = make()
        x = torch.randn(shape)
        fast = convbn.convert(copy.deepcopy(eager), example_inputs=(x,))
        for amp in (None, torch.bfloat16):
            e, f = step_ops(eager, x, amp), step_ops(fast, x, amp)
            ek, ec, fk, fc = (c.of_kind(k) for c in (e, f) for k in ("kernels", "casts"))
            extra = ", ".join(f"{k} +{n}" for k, n in sorted(((fk - ek) + (fc - ec)).items()))
            print(f"| {label.split(' (')[0]} {shape} | {'bf16' if amp else 'fp32'} | {sum(ek.values())} / "
                  f"{sum(fk.values())} | {sum(ec.values())} / {sum(fc.values())} | {extra} |", flush=True)


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.conv = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.silu(self.norm(x)))


def _step(model: nn.Module, x: Tensor, opt: torch.optim.Optimizer, amp: bool) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    out.float().mean().backward()
    opt.step()


def _python_calls(model: nn.Module, x: Tensor, opt: torch.optim.Optimizer, amp: bool) -> int:
    """The Python function calls (and C functions called from Python) of one step: exact."""
    prof = cProfile.Profile()
    prof.enable()
    _step(model, x, opt, amp)
    prof.disable()
    return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]


def host_times(depth: int, rounds: int, steps: int, amp: bool) -> Dict[str, float]:
    """Median seconds per step of eager and convert on a tiny input, interleaved rounds; and
    each one's Python calls per step (``"<name> calls"``)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[Block(8) for _ in range(depth)])
    x = torch.randn(1, 3, 4, 4)
    variants = {"eager": eager, "convert": convbn.convert(copy.deepcopy(eager), example_inputs=(x,))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in variants.items()}
    times: Dict[str, List[float]] = {k: [] for k in variants}
    calls: Dict[str, float] = {}
    for k, m in variants.items():
        for _ in range(3):
            _step(m, x, opts[k], amp)
        calls[f"{k} calls"] = _python_calls(m, x, opts[k], amp)
    for r in range(rounds):
        for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            t0 = time.thread_time()
            for _ in range(steps):
                _step(variants[k], x, opts[k], amp)
            times[k].append((time.thread_time() - t0) / steps)
    return {**{k: statistics.median(v) for k, v in times.items()}, **calls}


def host_table(depth: int, rounds: int, steps: int) -> None:
    print(f"| chain of {depth} GroupNorm -> SiLU -> Conv layers, input (1, 3, 4, 4) | eager step us | "
          "convert step us | convert / eager | convert's extra us per layer | Python calls per step: eager / "
          "convert (extra per layer) |")
    print("|---|---:|---:|---:|---:|---:|")
    for amp in (False, True):
        t = host_times(depth, rounds, steps, amp)
        print(f"| {'bf16 autocast' if amp else 'float32'} | {t['eager'] * 1e6:.0f} | {t['convert'] * 1e6:.0f} | "
              f"{t['convert'] / t['eager']:.2f}x | {(t['convert'] - t['eager']) / depth * 1e6:.0f} | "
              f"{t['eager calls']:.0f} / {t['convert calls']:.0f} ({(t['convert calls'] - t['eager calls']) / depth:.0f}) |",
              flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--only", choices=("ops", "host"), default=None)
    parser.add_argument("--nets", nargs="*", default=None,
                        help="ops of these nets (label prefixes) at bm_norm_peaks' inputs, not the small ones")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.only != "host":
        ops_table(args.nets)
    if args.only != "ops":
        host_table(args.depth, args.rounds, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
