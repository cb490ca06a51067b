"""The largest batch that trains within a memory limit, eager and converted (issue 24), on CPU.

For each model, a limit of its resident bytes (parameters, buffers, SGD momentum) plus
eager's step peak at batch 4 plus ``--times`` times what 4 more samples add to it (so eager
fits about ``4 + 4 * times`` samples and the search stays affordable on a CPU): :func:`convbn.max_batch` (loss the output's mean), then
an independent check on fresh copies: the standard-loop step at the batch it found, the
converted model planned for that batch (``convert(memory_limit=...)``), measured by
:func:`convbn.memory.timeline`, against the peak ``max_batch`` reported; and the batch
above it, measured during the search, over the limit.

    python benchmarks/bm_max_batch.py [--times 3] [--models LABEL ...]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bm_peak_vs_eager import MODELS  # noqa: E402

import convbn  # noqa: E402
from convbn.largest_batch import _batch_of  # noqa: E402
from convbn.memory import timeline  # noqa: E402
from convbn.memory.budget import resident_bytes  # noqa: E402

DEFAULT = ["tv:mobilenet_v3_small", "tv:shufflenet_v2_x0_5", "monai:BasicUNet (BN, dropout 0.1)",
           "monai:UNet (BN, dropout 0.1, PReLU)", "efficientnet_pytorch:b0", "tv:regnet_x_400mf", "tv:resnet18",
           "monai:resnet18 (2-D)", "monai:DenseNet121 (2-D)"]


def check(model, opt, sample, batch, limit, fused):
    """The step's peak at ``batch`` on fresh copies (the optimizer warmed as max_batch does)."""
    m, o = copy.deepcopy((model, opt))
    timeline(m, *_batch_of(sample, 2), optimizer=o)
    x = _batch_of(sample, batch)
    if fused:
        state = resident_bytes(m, o) - resident_bytes(m)
        m = convbn.convert(m, example_inputs=x, memory_limit=limit - state)
    return timeline(m, *x, optimizer=o).peak


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=DEFAULT)
    parser.add_argument("--times", type=float, default=3.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    mib = 2.0**20
    print(f"limit: resident + eager's peak at batch 4 + {args.times} x (its peak at 8 - at 4); SGD(momentum=0.9); loss: mean of the output\n")
    print("| model (sample) | limit | eager batch | convbn batch | **gain** | resident | max_batch's convbn peak | "
          "measured again | diff | batch+1 needs (eager / convbn) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label in args.models:
        torch.manual_seed(0)
        model, shape = MODELS[label]()
        model.train()
        sample = (torch.randn(2, *shape),)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        m, o = copy.deepcopy((model, opt))
        timeline(m, *_batch_of(sample, 2), optimizer=o)
        p4 = timeline(m, *_batch_of(sample, 4), optimizer=o).peak
        p8 = timeline(m, *_batch_of(sample, 8), optimizer=o).peak
        limit = resident_bytes(m, o) + p4 + int(args.times * (p8 - p4))
        fit = convbn.max_batch(model, sample, limit, optimizer=opt, confirm=True)  # the batch above measured too
        again = check(model, opt, sample, fit.convbn_batch, limit, fused=True)
        again_e = check(model, opt, sample, fit.eager_batch, limit, fused=False)
        over_e = fit.resident + fit.probes["eager"][fit.eager_batch + 1]
        over_c = fit.resident + fit.probes["convbn"][fit.convbn_batch + 1]
        diff = max(abs(again - fit.convbn_peak) / fit.convbn_peak, abs(again_e - fit.eager_peak) / fit.eager_peak)
        print(f"| {label} ({'x'.join(map(str, shape))}) | {limit / mib:.1f} MiB | {fit.eager_batch} | {fit.convbn_batch} | **{fit.gain:.2f}** | "
              f"{fit.resident / mib:.1f} MiB | {fit.convbn_peak / mib:.2f} MiB | {again / mib:.2f} MiB | "
              f"{100 * diff:.2f} % | {over_e / mib:.1f} / {over_c / mib:.1f} MiB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
