"""What counting a module's calls by what ran costs (``GraphForward.count_call``, read by the live
report: Note: [a report says what ran, call by call] in passes/report/calls_seen.py).

The block of ``tests/test_report_variants.py`` (``Conv -> norm`` twice, ``forward(x, inject=None)``)
converted and called once each way, so that it holds a variant and counts its calls; then calls of
the captured kind timed with the counting as it is and with it replaced by a no-op, interleaved
rounds in one process, the median of each and their ratio. CPU, one thread, no_grad.

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python benchmarks/bm_call_counting.py [--rounds 7] [--calls 2000]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import convbn
from convbn.passes.graph.graph_module import GraphForward
from test_report_variants import NORMS, Net


def _per_call(block: torch.nn.Module, x: torch.Tensor, calls: int) -> float:
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(calls):
            block(x)
    return (time.perf_counter() - t) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    fast = convbn.convert(Net(NORMS["batchnorm"]))
    x = torch.randn(2, 3, 8, 8)
    fast(x)
    fast.use = 1
    fast(x)  # captures the variant for inject=<given>: the block counts its calls from now on
    counting = GraphForward.count_call
    times = {"counting": [], "no-op": []}
    try:
        for _ in range(args.rounds):
            for kind in times:
                GraphForward.count_call = counting if kind == "counting" else (lambda self, route: None)
                times[kind].append(_per_call(fast.block, x, args.calls))
    finally:
        GraphForward.count_call = counting
    c, n = statistics.median(times["counting"]), statistics.median(times["no-op"])
    print(f"per call of the captured kind (median of {args.rounds} rounds x {args.calls}): counting {c * 1e6:.1f} us, "
          f"no-op {n * 1e6:.1f} us, ratio {c / n:.3f}")


if __name__ == "__main__":
    main()
