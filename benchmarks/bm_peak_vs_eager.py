"""Converted step peak vs eager's on real models, in the standard loop (issue 24).

For every model of ``bm_coverage.MODELS`` (and a few where weights dominate memory:
Darknet, pre-activation ResNets, a U-Net with a ResNet-34 encoder), at a small and a
larger input, the step's peak (:func:`convbn.memory.timeline`, Note: [a step's peak]) of
``convbn.convert(model, example_inputs=x)`` and of eager, with gradients set to None and
with gradient accumulation (a second micro-batch adding into ``.grad``). Prints a
markdown table and the count of model/size/mode cells above eager.

    python benchmarks/bm_peak_vs_eager.py [--models LABEL ...] [--batch-size 4]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bm_coverage import MODELS as COVERAGE, Factory, _timm, _tv  # noqa: E402

import convbn  # noqa: E402
from convbn.memory import timeline  # noqa: E402


def _smp_unet() -> Tuple[nn.Module, Tuple[int, ...]]:
    from zoo import import_torchvision_without_fake_kernels

    import_torchvision_without_fake_kernels()
    import segmentation_models_pytorch as smp

    return smp.Unet("resnet34", encoder_weights=None, classes=2), (3, 64, 64)


MODELS: Dict[str, Factory] = {
    **COVERAGE,
    "tv:resnet50": _tv("resnet50"),
    "timm:darknet53": _timm("darknet53"),
    "timm:cspdarknet53": _timm("cspdarknet53"),
    "timm:resnetv2_18 (pre-act)": _timm("resnetv2_18"),
    "smp:Unet(resnet34)": _smp_unet,
}


def peak(model: nn.Module, x: torch.Tensor, accumulate: bool) -> int:
    model.train()
    for p in model.parameters():
        p.grad = None
    if accumulate:
        model(x).float().mean().backward()  # the first micro-batch
    return timeline(model, x, accumulate=accumulate).peak


def measure(label: str, factory: Factory, batch: int, scales: Tuple[float, ...]) -> List[Tuple[str, str, str, int, int]]:
    model, shape = factory()
    rows = []
    for s in scales:
        shp = tuple(shape[:1]) + tuple(max(8, int(d * s)) for d in shape[1:])
        torch.manual_seed(0)
        x = torch.randn(batch, *shp)
        eager = copy.deepcopy(model)
        conv = convbn.convert(copy.deepcopy(model), example_inputs=x)
        for acc in (False, True):
            e, c = peak(eager, x, acc), peak(conv, x, acc)
            rows.append((label, "x".join(map(str, (batch, *shp))), "accumulate" if acc else "None", e, c))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--scales", type=float, nargs="*", default=[1.0, 2.0],
                        help="input side multipliers of the model's default size")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| model | input | grads | eager peak MiB | convbn peak MiB | ratio |")
    print("|---|---|---|---:|---:|---:|")
    above = total = 0
    for label in args.models:
        try:
            rows = measure(label, MODELS[label], args.batch_size, tuple(args.scales))
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"| {label} | | | failed: {type(exc).__name__}: {str(exc)[:80]} | | |", flush=True)
            continue
        for lab, shp, mode, e, c in rows:
            total += 1
            above += c > e
            print(f"| {lab} | {shp} | {mode} | {e / 2**20:.2f} | {c / 2**20:.2f} | {c / e:.3f}{' **above**' if c > e else ''} |",
                  flush=True)
    print(f"\n{above} of {total} (model, input, gradients) cells peak above eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
