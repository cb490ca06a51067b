"""Issue 22 check: third-party models convert and fold in place, fused where the maths allows.

segmentation_models_pytorch architectures (resnet18 encoder, no weights), ultralytics YOLO
detection models built from their yaml configs (no weights) and a few pytorchcv nets:
``convert`` (with example_inputs) and ``fold`` must not raise; the converted model's step
(outputs, gradients, buffers) is compared with eager's, and BatchNorms fused / folded counted.

Run: ``PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/check_inplace_third_party.py``
"""
from __future__ import annotations

import copy
import sys
import time
import warnings
from typing import Any, Callable, List, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

sys.path.insert(0, "tests")
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402


def leaves(out: Any) -> List[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def step(model: nn.Module, x: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    torch.manual_seed(0)
    outs = leaves(model(x))
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs if o.is_floating_point())
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [o.detach() for o in outs], [g for g in grads if g is not None]


def rel(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b)) if a else 0.0


def check(name: str, factory: Callable[[], nn.Module], shape: Tuple[int, ...]) -> None:
    if ONLY and not any(o in name for o in ONLY):
        return
    torch.manual_seed(0)
    model = factory().train()
    x = torch.randn(*shape)
    n_bn = sum(isinstance(m, _BatchNorm) for m in model.modules())
    t0 = time.perf_counter()
    row = [name, str(n_bn)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fast = convbn.convert(copy.deepcopy(model), example_inputs=x)
        fused = sum(o.result == "fused" for o in fast.convbn_report.outcomes)
        eager = copy.deepcopy(model)
        oe, ge = step(eager, x)
        of, gf = step(fast, x)
        buf = max(((a - b).abs().max()).item() for a, b in zip(fast.buffers(), eager.buffers())
                  if a.is_floating_point()) if n_bn else 0.0
        left = sorted({o.reason[:70] for o in fast.convbn_report.outcomes if o.result != "fused"})
        row += [f"{fused}" + (f" (left: {'; '.join(left[:2])})" if left else ""),
                f"out {rel(of, oe):.1e} grad {rel(gf, ge):.1e} buf {buf:.1e}", type(fast).__name__]
    except Exception as exc:  # noqa: BLE001 - report, go on
        row += ["RAISE", f"{type(exc).__name__}: {str(exc)[:90]}", ""]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            folded = convbn.fold(copy.deepcopy(model).eval(), example_inputs=x)
        row.append(str(len(folded.convbn_report.folded)))
    except Exception as exc:  # noqa: BLE001
        row.append(f"RAISE {type(exc).__name__}: {str(exc)[:80]}")
    row.append(f"{time.perf_counter() - t0:.1f}s")
    print(" | ".join(row), flush=True)


ONLY: List[str] = []


def main() -> None:
    ONLY[:] = sys.argv[1:]
    import_torchvision_without_fake_kernels()
    import segmentation_models_pytorch as smp  # noqa: E402
    print("model | BNs | fused | step vs eager (max rel) | class | folded | time")
    for arch in ("Unet", "UnetPlusPlus", "FPN", "PSPNet", "DeepLabV3", "DeepLabV3Plus", "Linknet", "MAnet", "PAN",
                 "UPerNet"):
        check(f"smp.{arch}", lambda arch=arch: smp.create_model(arch, encoder_name="resnet18", encoder_weights=None,
                                                                  classes=2), (2, 3, 128 if arch == "PAN" else 64, 128 if arch == "PAN" else 64))
    from ultralytics.nn.tasks import DetectionModel  # noqa: E402

    for cfg in ("yolov8n.yaml", "yolov5n.yaml", "yolo11n.yaml"):
        check(f"ultralytics.{cfg}", lambda cfg=cfg: DetectionModel(cfg, verbose=False), (1, 3, 64, 64))
    from pytorchcv.model_provider import get_model  # noqa: E402

    for net in ("resnet18", "mobilenetv2_w1", "shufflenetv2_w1"):
        check(f"pytorchcv.{net}", lambda net=net: get_model(net, pretrained=False), (2, 3, 224, 224))


if __name__ == "__main__":
    main()
