"""A training step's peak under the old and the new definition (issue 24), eager and ``convert``.

* **new** (everywhere since issue 24, Note: [a step's peak] in convbn/memory/timelines.py):
  the standard loop (``zero_grad(set_to_none=True)``, forward, loss, backward,
  ``optimizer.step()``), above what is live after ``zero_grad`` (parameters, buffers,
  optimizer state), weight gradients counted: :func:`convbn.memory.timeline`.
* **old** (``convbn bench`` before): the same step measured from *before* ``zero_grad``
  with the previous step's gradients alive, so the gradients the step makes again do not
  count: torch's own ``MemTracker`` (``tensor_peak(..., hooks=True)``).

Loss: the mean of the output; SGD (lr 1e-3, no momentum); one warm-up step first.

    python benchmarks/bm_step_peak.py [--models SPEC ...]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import List, Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402
from convbn.bench.models import build_model  # noqa: E402
from convbn.memory import tensor_peak, timeline  # noqa: E402

#: (label, spec, input shape with batch)
MODELS: List[Tuple[str, str, Tuple[int, ...]]] = [
    ("torchvision-style ResNet-50", "tv:resnet50", (8, 3, 224, 224)),
    ("MONAI ResNet-50", "monai:resnet50(spatial_dims=2,n_input_channels=3,conv1_t_stride=2)", (8, 3, 224, 224)),
    ("EfficientNet-B0", "efficientnet:b0", (8, 3, 224, 224)),
    # its swish as x * sigmoid(x) (``set_swish(memory_efficient=False)``) instead of the library's
    # default autograd Function, which saves its input (the BatchNorm's output) whatever convbn does
    ("EfficientNet-B0, plain swish", "efficientnet:b0+plain-swish", (8, 3, 224, 224)),
    ("MONAI DenseNet-121", "monai:DenseNet121", (8, 3, 128, 128)),
    ("MONAI 3-D UNet", "monai:UNet", (2, 1, 64, 64, 64)),
    ("tutorial MNIST", "mnist", (512, 1, 28, 28)),
    ("MONAI ResNet-18", "monai:resnet18(spatial_dims=2,n_input_channels=3)", (8, 3, 112, 112)),
]


def _build(spec: str) -> nn.Module:
    if spec.startswith("tv:"):
        return getattr(import_torchvision_without_fake_kernels().models, spec[3:])()
    if spec.endswith("+plain-swish"):
        model = build_model(spec[: -len("+plain-swish")])[0]
        model.set_swish(memory_efficient=False)
        return model
    return build_model(spec)[0]


def _loss(out: object) -> torch.Tensor:
    return out.float().mean() if isinstance(out, torch.Tensor) else out[0].float().mean()  # type: ignore[index]


def peaks(model: nn.Module, x: torch.Tensor) -> Tuple[int, int]:
    """``(old, new)`` peaks of one step of ``model`` on ``x``."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(model(x)).backward()
        opt.step()

    torch.manual_seed(0)
    step()  # warm-up: gradients exist, as the old meter assumed
    with tensor_peak(model, opt, hooks=True) as old:
        step()
    new = timeline(model, x, loss_fn=_loss, optimizer=opt).peak
    return old.result.peak, new


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[m[0] for m in MODELS])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    mib = 2.0**20
    print("| model (input) | eager old / new | convbn old / new | ratio old | ratio new | predicted new |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, spec, shape in MODELS:
        if label not in args.models:
            continue
        torch.manual_seed(0)
        model = _build(spec)
        x = torch.randn(*shape)
        conv = convbn.convert(copy.deepcopy(model), example_inputs=x)
        pred = conv.convbn_report.predicted_peak_bytes
        eo, en = peaks(model, x)
        co, cn = peaks(conv, x)
        print(f"| {label} ({'x'.join(map(str, shape))}) | {eo / mib:.1f} / {en / mib:.1f} MiB | {co / mib:.1f} / "
              f"{cn / mib:.1f} MiB | {co / eo:.3f} | **{cn / en:.3f}** | "
              f"{'-' if pred is None else f'{pred / mib:.1f} MiB'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
