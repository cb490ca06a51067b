"""The default plan under the fixed price of a byte of peak alone and with the work share (Note: [a
byte of peak against the chains' work] in convbn/passes/plan/peak_planner.py), per model.

Each model is converted once with ``example_inputs`` (the default plan); the planner's inputs of that
conversion are recorded and both rules are run on them (the planner is pure: the same inputs give
the same plan), so the table says which models the work share moves, to which predicted peak, for
how much more recompute (MAC equivalents, :func:`convbn.functional.conv.recompute_cost`). Predicted
peaks are exact on these models (BENCHMARKS.md, "## Issue 24"); ``bm_step_peak.py`` measures them.

    python benchmarks/bm_peak_price.py                          # bm_step_peak.py's models
    python benchmarks/bm_peak_price.py --norm-nets              # bm_norm_nets.py's three networks
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from bm_step_peak import MODELS, _build  # noqa: E402
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402
from convbn.passes.plan import auto_plan  # noqa: E402
from convbn.passes.plan.peak_model import step_peak  # noqa: E402
from convbn.passes.plan.peak_planner import chain_options, lowest_peak, peak_byte_cost, plan_for_peak  # noqa: E402


def recorded_inputs(model: torch.nn.Module, x: Tuple[torch.Tensor, ...]) -> Dict[str, Any]:
    """The arguments ``convert``'s default plan was made from, and eager's measured step peak."""
    seen: Dict[str, Any] = {}

    def spy(costs, floor, extra, **kw):  # type: ignore[no-untyped-def]
        seen.update(costs=costs, floor=floor, extra=extra, gaps=kw.get("gaps"))
        return plan_for_peak(costs, floor, extra, **kw)

    with mock.patch.object(auto_plan, "plan_for_peak", spy), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = convbn.convert(model, example_inputs=x)
    seen["eager_peak"] = converted.convbn_report.eager_peak_bytes
    return seen


def row(label: str, rec: Dict[str, Any]) -> str:
    """One table row: both rules' predicted peaks and recompute on the recorded inputs."""
    costs, floor, extra, gaps = rec["costs"], rec["floor"], rec["extra"], rec["gaps"]
    low = lowest_peak(costs, [chain_options(c) for c in costs], floor, extra, gaps)
    old = plan_for_peak(costs, floor, extra, gaps=gaps, work_share=0)
    new = plan_for_peak(costs, floor, extra, gaps=gaps)
    mib, eager = 2.0**20, rec["eager_peak"]

    def peak(keeps: List[List[bool]]) -> int:
        return step_peak(costs, keeps, floor, gaps=gaps)[0]

    def work(keeps: List[List[bool]]) -> float:
        return sum(c.recompute(k) for c, k in zip(costs, keeps)) / 1e9

    return (f"| {label} | {peak(old) / mib:.2f} MiB ({peak(old) / eager:.3f}) | {peak(new) / mib:.2f} MiB "
            f"({peak(new) / eager:.3f}) | {low / mib:.2f} MiB ({low / eager:.3f}) | {work(old):.3f} -> {work(new):.3f} | "
            f"{peak_byte_cost(costs, low):.1f} | {'same' if old == new else 'moved'} |")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None, help="bm_step_peak.py's labels (default: all)")
    parser.add_argument("--norm-nets", action="store_true", help="bm_norm_nets.py's diffusion, unet3d, convnext")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import_torchvision_without_fake_kernels()
    print("| model | fixed price alone | with the work share | lowest | recompute G MAC-eq | price / byte | plan |")
    print("|---|---:|---:|---:|---:|---:|---|")
    if args.norm_nets:
        from bm_norm_nets import NETS

        for name in ("diffusion", "unet3d", "convnext"):
            make, batch, label = NETS[name]
            torch.manual_seed(0)
            model, x, _ = make(batch)
            print(row(label, recorded_inputs(model, x)), flush=True)
        return 0
    for label, spec, shape in MODELS:
        if args.models is not None and label not in args.models:
            continue
        torch.manual_seed(0)
        print(row(f"{label} ({'x'.join(map(str, shape))})", recorded_inputs(_build(spec), (torch.randn(*shape),))),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
