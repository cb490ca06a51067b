"""The per-sample-norm nets' step peaks by two meters side by side: ``convbn.memory.timeline``
(tensor bytes, what the planner predicts and the norm benchmarks report) and
``convbn.memory.allocator_peak`` (the CPU allocator's own events: also what kernels allocate
inside themselves, such as oneDNN's scratch, which no tensor meter sees).

Each net, eager and ``convbn.convert(example_inputs=x)`` with the default plan, runs the standard
loop (``zero_grad(set_to_none=True)``, forward, mean loss, backward, SGD step with momentum) once
untimed, then each meter reads one more step::

    python benchmarks/bm_norm_meters.py [--nets diffusion 3-D convnext basicunet]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
import bm_norm_peaks  # noqa: E402

import convbn  # noqa: E402
from convbn.memory import allocator_peak, timeline  # noqa: E402

__all__ = ["NETS", "meters", "main"]


def _basicunet() -> nn.Module:
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(16, 16, 32, 64, 128, 16))


#: label -> (builder, input shape): bm_norm_peaks' own nets and MONAI's BasicUNet 3-D (bm_norm_nets' unet3d)
NETS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]] = {
    **{name.split(" (")[0]: (make, shape) for name, make, shape, _ in bm_norm_peaks.MODELS},
    "MONAI BasicUNet 3-D": (_basicunet, (2, 1, 48, 48, 48)),
}


def meters(model: nn.Module, x: torch.Tensor) -> Tuple[int, int]:
    """``(timeline peak, allocator peak)`` of one standard-loop step after an untimed one."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        bm_norm_peaks._loss(model(x)).backward()
        opt.step()

    step()
    return timeline(model, x, loss_fn=bm_norm_peaks._loss, optimizer=opt).peak, allocator_peak(step)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="*", default=None, help="labels containing one of these strings")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| net | eager timeline / allocator MiB | convert timeline MiB (x eager) | convert allocator MiB (x eager) |")
    print("|---|---|---|---|")
    for label, (make, shape) in NETS.items():
        if args.nets and not any(n.lower() in label.lower() for n in args.nets):
            continue
        torch.manual_seed(0)
        base, x = make(), torch.randn(*shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fast = convbn.convert(copy.deepcopy(base), example_inputs=x)
        (et, ea), (ct, ca) = meters(copy.deepcopy(base), x), meters(fast, x)
        mib = 2.0 ** 20
        print(f"| {label} | {et / mib:.1f} / {ea / mib:.1f} | {ct / mib:.1f} ({ct / et:.3f}x) | "
              f"{ca / mib:.1f} ({ca / ea:.3f}x) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
