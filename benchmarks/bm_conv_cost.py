"""Time every convolution of real models one by one and fit the planner's recompute cost.

The planner ranks which convolutions to run again in backward by
``convbn.functional.conv.recompute_cost`` (MACs + bytes moved + a fixed cost per call, in
MAC equivalents; Note: [what a recompute costs]). This script is where its constants come
from: it records each conv's input in one forward of each model, times the conv's forward
alone (median of ``--repeats``), fits ``t = a * MACs + b * bytes + c`` by non-negative least
squares on relative error, and prints the fit beside a MACs-only fit, per model.

    python benchmarks/bm_conv_cost.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Dict, List, Tuple

import numpy as np
import torch
from scipy.optimize import nnls
from torch import nn

from convbn.bench.models import build_model
from convbn.functional.conv import COST_PER_BYTE, COST_PER_CALL, conv_flops, conv_spec_from_module

MODELS: List[Tuple[str, int, int]] = [
    ("efficientnet:b0", 8, 224),
    ("monai:resnet50(spatial_dims=2,n_input_channels=3,conv1_t_stride=2)", 8, 224),
    ("monai:resnet18(spatial_dims=2,n_input_channels=3)", 8, 112),
    ("monai:DenseNet121", 8, 128),
    ("monai:UNet", 2, 64),
    ("mnist", 512, 28),
]
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def time_convs(spec: str, batch: int, size: int, repeats: int) -> List[Dict[str, float]]:
    """One row per conv call of one forward: MACs, input and output bytes, median seconds."""
    model, shape = build_model(spec)
    x = torch.randn(batch, shape[0], *([size] * (len(shape) - 1)))
    calls: List[Tuple[nn.Module, torch.Tensor, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda m, a, out: calls.append((m, a[0].detach().clone(), out.detach())))
             for m in model.modules() if isinstance(m, CONVS)]
    with torch.no_grad():
        model.train()(x)
    for h in hooks:
        h.remove()
    rows = []
    for mod, inp, out in calls:
        macs = conv_flops(out.shape, mod.weight.shape, conv_spec_from_module(mod), inp.shape)
        times = []
        with torch.no_grad():
            for i in range(repeats + 2):
                t = time.perf_counter()
                mod(inp)
                if i >= 2:  # two warm-up calls
                    times.append(time.perf_counter() - t)
        rows.append({"model": spec.split("(")[0], "macs": macs, "bytes": (inp.numel() + out.numel()) * inp.element_size(),
                     "t": statistics.median(times)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [r for spec, b, s in MODELS for r in time_convs(spec, b, s, args.repeats)]
    t = np.array([r["t"] for r in rows])
    w = 1 / t  # relative error: every layer counts, not only the largest
    x_full = np.array([[r["macs"], r["bytes"], 1.0] for r in rows])
    fits = {"MACs alone": x_full[:, :1], "MACs + bytes + call": x_full}
    preds = {}
    print(f"{len(rows)} convolutions, {args.threads} thread(s), median of {args.repeats}\n")
    for name, x in fits.items():
        coef, _ = nnls(x * w[:, None], t * w)
        preds[name] = x @ coef
        terms = f"{coef[0] * 1e12:.2f} ps/MAC"
        if len(coef) > 1:
            terms += (f", {coef[1] * 1e12:.1f} ps/byte ({coef[1] / coef[0]:.1f} MAC/byte), "
                      f"{coef[2] * 1e6:.0f} us/call ({coef[2] / coef[0]:.2e} MAC/call)")
        print(f"{name}: {terms}")
    print(f"convbn's constants: COST_PER_BYTE = {COST_PER_BYTE} MAC/byte, COST_PER_CALL = {COST_PER_CALL:.1e} MAC\n")
    print("| model | convs | measured ms | " + " | ".join(f"{n}: mean rel. error" for n in fits) + " |")
    print("|---|---:|---:|" + "---:|" * len(fits))
    for model in dict.fromkeys(r["model"] for r in rows):
        sel = np.array([r["model"] == model for r in rows])
        errs = " | ".join(f"{np.mean(np.abs(p[sel] - t[sel]) / t[sel]):.2f}" for p in preds.values())
        print(f"| {model} | {sel.sum()} | {t[sel].sum() * 1e3:.1f} | {errs} |")


if __name__ == "__main__":
    main()
