"""fold -> ONNX -> ONNX Runtime on real models, one export with a dynamic batch, run at batch 1 and 7.

For each model: BatchNorm statistics and affine parameters set away from identity (seeded),
``convbn.fold`` on a batch of 2, :func:`convbn.deploy.save_onnx`, then ONNX Runtime at batch
1 and 7 against the *unfolded* model: max |ort - model| / max |model|. Also prints how many
BatchNorms were folded, how many BatchNormalization / ConvTranspose nodes the ONNX graph has,
how many files the export wrote (1: self-contained) and their size, and the seconds each
stage took (the export dominates: torch's decompositions). With ``--dynamic-axes
batch,spatial`` the spatial sizes are dynamic too and the second run (batch 7) is at a
larger spatial size (each size plus its largest power-of-two factor).

    python benchmarks/bm_onnx_export.py                                   # every model
    python benchmarks/bm_onnx_export.py unet3d                            # some
    python benchmarks/bm_onnx_export.py --dynamic-axes batch,spatial unet2d
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Callable, Dict, Tuple

import torch
from torch import nn

import convbn
from convbn import deploy
from convbn.bench.models import MNISTNet
from convbn.cli_fold import other_size


def _randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.2)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            if m.weight is not None:
                m.weight.data.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
    return model


def _models() -> Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]]:
    from efficientnet_pytorch import EfficientNet
    from monai.networks import nets

    return {
        "mnist": (MNISTNet, (1, 28, 28)),
        "resnet18": (lambda: nets.resnet18(spatial_dims=2, n_input_channels=3, num_classes=10), (3, 64, 64)),
        "densenet121": (lambda: nets.DenseNet121(spatial_dims=2, in_channels=3, out_channels=10), (3, 64, 64)),
        "efficientnet-b0": (lambda: EfficientNet.from_name("efficientnet-b0", num_classes=10), (3, 64, 64)),
        "unet2d": (lambda: nets.UNet(2, 1, 2, channels=(8, 16, 32), strides=(2, 2), norm="batch"), (1, 32, 32)),
        "unet3d": (lambda: nets.UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), norm="batch"), (1, 16, 16, 16)),
        "basicunet": (lambda: nets.BasicUNet(2, 1, 2, features=(4, 4, 8, 8, 16, 4), norm="batch"), (1, 32, 32)),
    }


def main() -> None:
    models = _models()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", choices=[[]] + list(models), default=[], metavar="MODEL",
                        help=f"models to run (default: all of {', '.join(models)})")
    parser.add_argument("--dynamic-axes", default="batch", help="batch (default), spatial, batch,spatial or none")
    args = parser.parse_args()
    axes = deploy.dynamic_axes_arg(args.dynamic_axes)
    import onnx

    print(f"{'model':<16} {'BN folded':>9} {'ONNX BN':>7} {'ConvT':>5} {'files':>5} {'MB':>6} {'fold s':>6} "
          f"{'export s':>8} {'rel err b=1':>11} {'rel err b=7':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names or list(models):
            build, shape = models[name]
            torch.manual_seed(0)
            model = _randomize_bn(build().eval())
            x = torch.randn(2, *shape)
            t0 = time.perf_counter()
            folded = convbn.fold(model, example_inputs=x)
            t1 = time.perf_counter()
            path = os.path.join(tmp, f"{name}.onnx")
            files = deploy.save_onnx(folded, x, path, dynamic_axes=axes)
            t2 = time.perf_counter()
            second = (shape[0], *map(other_size, shape[1:])) if "spatial" in axes else shape
            errors = deploy.check_onnx(path, model, [torch.randn(1, *shape), torch.randn(7, *second)])
            megabytes = sum(os.path.getsize(f) for f in files) / 2**20
            ops = [n.op_type for n in onnx.load(path).graph.node]
            n_folded = sum(o.result == "folded" for o in folded.convbn_report.outcomes)
            print(f"{name:<16} {n_folded:>9} {ops.count('BatchNormalization'):>7} {ops.count('ConvTranspose'):>5} "
                  f"{len(files):>5} {megabytes:>6.1f} {t1 - t0:>6.1f} {t2 - t1:>8.1f} {errors[0]:>11.1e} {errors[1]:>11.1e}", flush=True)


if __name__ == "__main__":
    main()
