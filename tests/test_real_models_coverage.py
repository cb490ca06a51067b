"""Real third-party models: ``convbn.convert`` fuses their BatchNorms (tails, pre-activation
heads, chain ends) and trains exactly as eager.

Default run (tiny inputs, a few seconds each): MONAI DenseNet121 (2-D; pre-activation heads
after concatenations), MONAI UNet (batch norm, dropout 0.1, PReLU: BN -> Dropout -> PReLU
tails) and MONAI BasicUNet (batch norm, dropout 0.1). ``CONVBN_ZOO_ALL=1`` adds timm
(pre-activation ResNetV2, EfficientNet) and torchvision models where they import here.

Each model: two training steps with random upstream gradients under the same seed (the
dropout masks are eager's), compared in float32 (relative to each tensor's scale): outputs,
input and every parameter gradient (PReLU weights included), running statistics and
``num_batches_tracked``; and the report's structure (how many BatchNorms fused, which tails,
how many heads and ends), so a shape that silently stops fusing fails.
"""
from __future__ import annotations

import copy
import os
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn
from convbn import FusedChain

ALL = os.environ.get("CONVBN_ZOO_ALL") == "1"
RTOL = 2e-4

monai_nets = pytest.importorskip("monai.networks.nets")


def _timm(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from zoo import timm_or_skip

        return timm_or_skip().create_model(name, pretrained=False, num_classes=4)
    return make


def _tv(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from zoo import torchvision_or_skip

        return getattr(torchvision_or_skip().models, name)(weights=None, num_classes=4)
    return make


Case = Tuple[Callable[[], nn.Module], Tuple[int, ...], float, int, int, str, str]
# name: (factory, input shape, expectations: min share of BNs fused, heads >=, ends >=, a tail that must
# appear, words every skip reason contains)
MODELS: Dict[str, Case] = {
    # the last BN (norm5) reads a concatenation and feeds pooling: nothing to fuse it with
    "monai-densenet121": (lambda: monai_nets.DenseNet121(spatial_dims=2, in_channels=1, out_channels=2),
                          (2, 1, 32, 32), 0.98, 61, 61, "relu", "'class_layers.pool' reads the value, not a convolution"),
    "monai-unet-dropout-prelu": (lambda: monai_nets.UNet(spatial_dims=2, in_channels=1, out_channels=2,
                                                         channels=(4, 8, 16), strides=(2, 2), num_res_units=2,
                                                         norm="batch", dropout=0.1),
                                 (2, 1, 16, 16), 0.7, 0, 0, "dropout(0.1) -> prelu", "transposed"),
    "monai-basicunet-dropout": (lambda: monai_nets.BasicUNet(spatial_dims=2, in_channels=1, out_channels=2,
                                                             features=(4, 4, 8, 8, 16, 4), norm="batch", dropout=0.1),
                                (2, 1, 32, 32), 0.99, 0, 0, "dropout(0.1) -> leaky_relu(0.1)", ""),
}
# timm's BatchNormAct2d layers are fused once BN subclasses are traced into: no minimum here
EXTRA: Dict[str, Case] = {
    "timm-resnetv2_50-preact": (_timm("resnetv2_50"), (2, 3, 32, 32), 0.0, 0, 0, "", ""),
    "timm-efficientnet_b0": (_timm("efficientnet_b0"), (2, 3, 32, 32), 0.0, 0, 0, "", ""),
    "tv-densenet121": (_tv("densenet121"), (2, 3, 32, 32), 0.98, 61, 61, "relu", "reads the value, not a convolution"),
    "tv-mobilenet_v3_small": (_tv("mobilenet_v3_small"), (2, 3, 32, 32), 0.99, 0, 0, "hardswish", ""),
}
if ALL:
    MODELS.update(EXTRA)


def _init(model: nn.Module) -> nn.Module:
    """Non-trivial BatchNorm parameters and statistics, PReLU slopes away from their init."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.weight is not None:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
            if isinstance(m, nn.PReLU):
                m.weight.uniform_(0.1, 0.4)
    return model


def _step(model: nn.Module, x: Tensor, seed: int) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # dropout draws from here: the same masks for eager and converted
    out = model(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100)))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def _close(actual: Tensor, expected: Tensor, what: str, floor: float = 0.0) -> None:
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), what
        return
    scale = max(float(expected.abs().max()) if expected.numel() else 0.0, floor)
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_fuses_and_trains_as_eager(name: str) -> None:
    factory, shape, min_share, heads, ends, tail, why = MODELS[name]
    torch.manual_seed(0)
    eager = _init(factory()).train()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    report = fast.convbn_report
    bns = [n for n, m in eager.named_modules() if isinstance(m, _BatchNorm)]
    fused = [p.bn for p in report.pairs if p.bn]
    assert sorted(fused + [s.bn for s in report.skipped]) == sorted(bns), report  # every BN once
    assert len(fused) >= min_share * len(bns), report
    assert sum(p.kind == "head" for p in report.pairs) >= heads, report
    assert sum(p.kind == "end" for p in report.pairs) >= ends, report
    if tail:
        assert any(p.activation == tail for p in report.pairs), report
    assert all(why in s.reason for s in report.skipped), report  # nothing else is left unfused
    assert any(isinstance(m, FusedChain) for _, m in convbn.fused_modules(fast)) == bool(report.pairs)

    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for s in range(2):
        oe, ge, pe = _step(eager, x, s)
        of, gf, pf = _step(fast, x, s)
        _close(of, oe, f"step {s} output")
        _close(gf, ge, f"step {s} input grad")
        assert pf.keys() == pe.keys()
        floor = 1e-3 * max(float(g.abs().max()) for g in pe.values())
        for n in pe:
            _close(pf[n], pe[n], f"step {s} grad {n}", floor=floor)
        be, bf = dict(eager.named_buffers()), dict(fast.named_buffers())
        assert be.keys() == bf.keys()
        for n in be:
            _close(bf[n], be[n], f"step {s} buffer {n}")
