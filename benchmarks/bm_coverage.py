"""Coverage on real third-party models: how many BatchNorms convert fuses and fold folds.

For each model (torchvision, timm, MONAI, efficientnet_pytorch; small inputs, float32, CPU):

* ``BNs``: BatchNorm modules in the model;
* ``convert``: BatchNorms fused by :func:`convbn.convert` (default ``strategy="auto"``,
  validated on the example input), and chain ends (convs with no BN fused into a chain);
* ``fold``: BatchNorms folded by :func:`convbn.fold` (eval mode, checked);
* ``fx fuse``: BatchNorms removed by ``torch.fx.experimental.optimization.fuse``, the
  reference (``n/a``: the model does not trace whole);
* ``saved``: saved activation bytes of one training forward, converted / eager
  (:func:`convbn.memory.saved_bytes`, deterministic);
* ``peak``: exact peak of live tensor bytes over one training step, converted / eager
  (:func:`convbn.memory.timeline`, loss = mean output; deterministic on CPU);
* the most frequent reason a BatchNorm was left unfused.

No timings: the figures are counts and bytes, identical on every run.

Run::

    python benchmarks/bm_coverage.py                     # every model, markdown table to stdout
    python benchmarks/bm_coverage.py --models tv:resnet18 monai:unet --batch-size 2
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from zoo import import_timm, import_torchvision_without_fake_kernels  # noqa: E402

__all__ = ["MODELS", "Row", "measure", "main"]

Factory = Callable[[], Tuple[nn.Module, Tuple[int, ...]]]


def _tv(name: str, size: int = 64, **kw: object) -> Factory:
    def make() -> Tuple[nn.Module, Tuple[int, ...]]:
        tv = import_torchvision_without_fake_kernels()
        return getattr(tv.models, name)(weights=None, num_classes=10, **kw), (3, size, size)
    return make


def _timm(name: str, size: int = 64) -> Factory:
    def make() -> Tuple[nn.Module, Tuple[int, ...]]:
        return import_timm().create_model(name, pretrained=False, num_classes=10), (3, size, size)
    return make


def _monai(name: str, shape: Tuple[int, ...], **kw: object) -> Factory:
    def make() -> Tuple[nn.Module, Tuple[int, ...]]:
        from monai.networks import nets

        return getattr(nets, name)(**kw), shape
    return make


def _effnet(name: str, size: int = 64) -> Factory:
    def make() -> Tuple[nn.Module, Tuple[int, ...]]:
        from efficientnet_pytorch import EfficientNet

        return EfficientNet.from_name(name, num_classes=10), (3, size, size)
    return make


#: model label -> factory returning (model, input shape without batch)
MODELS: Dict[str, Factory] = {
    "tv:resnet18": _tv("resnet18"),
    "tv:densenet121": _tv("densenet121"),
    "tv:mobilenet_v3_small": _tv("mobilenet_v3_small"),
    "tv:efficientnet_b0": _tv("efficientnet_b0"),
    "tv:regnet_x_400mf": _tv("regnet_x_400mf"),
    "tv:shufflenet_v2_x0_5": _tv("shufflenet_v2_x0_5"),
    "timm:efficientnet_b0": _timm("efficientnet_b0"),
    "timm:mobilenetv3_small_050": _timm("mobilenetv3_small_050"),
    "timm:regnetx_002": _timm("regnetx_002"),
    "timm:rexnet_100": _timm("rexnet_100"),
    "timm:dla34": _timm("dla34"),
    "timm:cspresnet50": _timm("cspresnet50"),
    "timm:ese_vovnet19b_dw": _timm("ese_vovnet19b_dw"),
    "timm:resnetv2_50 (pre-act)": _timm("resnetv2_50"),
    "monai:DenseNet121 (2-D)": _monai("DenseNet121", (1, 64, 64), spatial_dims=2, in_channels=1, out_channels=2),
    "monai:UNet (BN, dropout 0.1, PReLU)": _monai(
        "UNet", (1, 64, 64), spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32, 64),
        strides=(2, 2, 2), num_res_units=2, norm="batch", dropout=0.1),
    "monai:BasicUNet (BN, dropout 0.1)": _monai(
        "BasicUNet", (1, 64, 64), spatial_dims=2, in_channels=1, out_channels=2, features=(8, 8, 16, 32, 64, 8),
        norm="batch", dropout=0.1),
    "monai:resnet18 (2-D)": _monai("resnet18", (3, 64, 64), spatial_dims=2, n_input_channels=3, num_classes=10),
    "efficientnet_pytorch:b0": _effnet("efficientnet-b0"),
}


@dataclass
class Row:
    model: str
    bns: int
    fused: int
    ends: int
    folded: int
    fx_fused: Optional[int]
    saved_ratio: float
    peak_ratio: float
    top_reason: str


def _count_bns(model: nn.Module) -> int:
    return sum(isinstance(m, _BatchNorm) for m in model.modules())


def _fx_fuse_count(model: nn.Module, total: int) -> Optional[int]:
    """BatchNorms ``torch.fx.experimental.optimization.fuse`` removes (``None``: does not trace)."""
    from torch.fx.experimental.optimization import fuse

    try:
        fused = fuse(copy.deepcopy(model).eval())
    except Exception:  # noqa: BLE001 - the reference traces the whole model or nothing
        return None
    left = sum(1 for n in fused.graph.nodes if n.op == "call_module"
               and isinstance(fused.get_submodule(str(n.target)), _BatchNorm))
    return total - left


def _shorten(reason: str) -> str:
    reason = re.sub(r"'[^']*'", "'…'", reason)
    return reason.split(";")[0][:90]


def measure(label: str, factory: Factory, batch: int) -> Row:
    torch.manual_seed(0)
    model, shape = factory()
    model.train()
    x = torch.randn((batch, *shape), generator=torch.Generator().manual_seed(1))
    total = _count_bns(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = convbn.explain(model, x)
        folded = convbn.fold(copy.deepcopy(model).eval(), example_inputs=x)
    fused_bns = len({p.bn for p in report.pairs if p.bn})
    ends = sum(1 for p in report.pairs if not p.bn)
    reasons = collections.Counter(_shorten(s.reason) for s in report.skipped)
    top = f"{reasons.most_common(1)[0][1]}x {reasons.most_common(1)[0][0]}" if reasons else ""
    return Row(label, total, fused_bns, ends, len(folded.convbn_report.folded), _fx_fuse_count(model, total),
               report.saved_bytes / report.eager_saved_bytes if report.eager_saved_bytes else 1.0,
               report.measured_peak_bytes / report.eager_peak_bytes if report.eager_peak_bytes else 1.0, top)


def markdown(rows: List[Row], command: str) -> str:
    lines = [f"Command: `{command}`", "",
             "| model | BNs | convert fused | chain ends | fold() folded | fx `fuse` | saved / eager | peak / eager | "
             "most frequent reason left unfused |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fx_text = "n/a" if r.fx_fused is None else str(r.fx_fused)
        lines.append(f"| {r.model} | {r.bns} | {r.fused} | {r.ends} | {r.folded} | {fx_text} | {r.saved_ratio:.2f}x | "
                     f"{r.peak_ratio:.2f}x | {r.top_reason} |")
    tot = sum(r.bns for r in rows)
    if tot:
        fused, folded = sum(r.fused for r in rows), sum(r.folded for r in rows)
        fx_total = sum(r.fx_fused or 0 for r in rows)  # a model that does not trace counts 0
        lines.append(f"| **all** | {tot} | {fused} ({fused / tot:.0%}) | {sum(r.ends for r in rows)} | "
                     f"{folded} ({folded / tot:.0%}) | {fx_total} ({fx_total / tot:.0%}) | | | |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), help=f"labels from: {', '.join(MODELS)}")
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for label in args.models:
        if label not in MODELS:
            raise ValueError(f"unknown model {label!r}; choose from {list(MODELS)}")
        try:
            rows.append(measure(label, MODELS[label], args.batch_size))
        except ImportError as exc:
            print(f"skipped {label}: {exc}", file=sys.stderr)
            continue
        print(f"done {label}", file=sys.stderr, flush=True)
    command = "python benchmarks/bm_coverage.py" + ("" if args.models == list(MODELS) else " --models " + " ".join(
        repr(m) for m in args.models)) + ("" if args.batch_size == 2 else f" --batch-size {args.batch_size}")
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
