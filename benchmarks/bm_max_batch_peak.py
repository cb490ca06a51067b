"""What answering :func:`convbn.max_batch` costs in memory and time, on CPU (issue 41 item 2).

One model, one limit: ``max_batch(model, x, memory, optimizer=SGD(momentum=0.9))`` in a fresh
process, its wall time and the process's memory while answering, two ways:

* **RSS high-water mark**: the kernel's ``ru_maxrss`` after the call minus the RSS when it
  began (exact for the process, and conservative: RSS includes the allocator's cached blocks
  and code loaded during the call; valid because the call sets the process's high-water mark,
  which the script checks);
* **CPU allocator**: :func:`convbn.memory.allocator_peak` (the profiler's allocation events
  replayed), with ``--allocator`` (in a separate run: the profiler slows the call).

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python benchmarks/bm_max_batch_peak.py \\
        --model tv:resnet50 --size 224 --memory 768MiB [--confirm auto|true|false] [--allocator] \\
        [--method predict|measure] [--channels-last] [--prediction-off]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bm_peak_vs_eager import MODELS  # noqa: E402

import convbn  # noqa: E402
from convbn.memory import allocator_peak, format_bytes  # noqa: E402
from convbn.memory.budget import parse_memory  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _prediction_off() -> None:
    """The convbn side's prediction made (a copy converted and stepped at 2, 4 and 3), then
    taken as off, so that the side is measured on a copy converted again."""
    from convbn.batch_search import Search

    real = Search._fused_prediction
    Search._fused_prediction = lambda self: (lambda out: out if isinstance(out, str) else  # type: ignore[method-assign]
                                             " (the prediction was off)")(real(self))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tv:resnet50")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--memory", default="768MiB")
    parser.add_argument("--confirm", default="auto", choices=["auto", "true", "false"])
    parser.add_argument("--allocator", action="store_true", help="measure with allocator_peak instead of RSS")
    parser.add_argument("--method", default="predict", choices=["predict", "measure"])
    parser.add_argument("--channels-last", action="store_true", help="model and inputs in channels-last memory format")
    parser.add_argument("--prediction-off", action="store_true",
                        help="treat the convbn side's prediction as off: it is measured on a copy converted again "
                             "(the path on which a copy let go used to stay alive beside the next)")
    args = parser.parse_args(argv)
    if args.prediction_off:
        _prediction_off()
    confirm: Any = {"auto": "auto", "true": True, "false": False}[args.confirm]
    torch.manual_seed(0)
    model, _shape = MODELS[args.model]()
    model.train()
    sample = (torch.randn(2, 3, args.size, args.size),)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
        sample = (sample[0].to(memory_format=torch.channels_last),)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    limit = parse_memory(args.memory)
    out: Dict[str, Any] = {}
    call = lambda: out.setdefault("fit", convbn.max_batch(model, sample, args.memory, optimizer=opt,  # noqa: E731
                                                         confirm=confirm, method=args.method, progress=True))
    start, high_before = _rss(), _maxrss()
    t = time.perf_counter()
    peak = allocator_peak(call) if args.allocator else 0
    if not args.allocator:
        call()
    seconds = time.perf_counter() - t
    if not args.allocator:
        if _maxrss() <= high_before:
            raise SystemExit("the call did not set the process's RSS high-water mark: no figure")
        peak = _maxrss() - start
    fit = out["fit"]
    print(fit)
    meter = "CPU allocator (profiler)" if args.allocator else "RSS high-water mark - RSS at the start"
    print("| model | memory | method, confirm | eager / convbn batch | answering's peak | meter | over the memory | time |")
    print(f"| {args.model} {args.size}² | {args.memory} | {args.method}, {args.confirm} | {fit.eager_batch} / {fit.convbn_batch} | "
          f"{format_bytes(peak)} ({peak / limit:.3f} x) | {meter} | {format_bytes(max(0, peak - limit))} | {seconds:.0f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
