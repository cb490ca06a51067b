"""Peak live-tensor memory of a training step: converted models never peak above eager.

``convbn.memory.tensor_peak`` counts tensor storages exactly (no allocator caching, no
sampling), so these comparisons are deterministic on CPU.
"""
import copy

import pytest
import torch
import torch.nn as nn

import convbn
from convbn.memory import tensor_peak



def _step_peak(model: nn.Module, x: torch.Tensor) -> int:
    def step() -> None:
        model(x).float().square().mean().backward()

    step()  # gradients exist from here on, as in real training
    with tensor_peak(model) as tp:
        step()
    return tp.result.peak


def _mnist():
    from convbn.demo import MnistNet

    return MnistNet(fused=False), torch.randn(64, 1, 28, 28)


# Sizes where activations, not weights, dominate memory (the case convbn is for). At
# tiny batches of weight-heavy layers a chain's weight-gradient buffers, released
# together when the chain's backward returns rather than layer by layer, can outweigh
# the activations saved (see the README's limitations).
def _resnet():
    monai = pytest.importorskip("monai")
    return monai.networks.nets.resnet18(spatial_dims=2, n_input_channels=3, num_classes=10), torch.randn(8, 3, 96, 96)


def _effnet():
    effnet = pytest.importorskip("efficientnet_pytorch")
    return effnet.EfficientNet.from_name("efficientnet-b0", num_classes=10), torch.randn(4, 3, 96, 96)


@pytest.mark.parametrize("make", [_mnist, _resnet, _effnet], ids=["mnist", "monai-resnet18", "efficientnet-b0"])
def test_auto_never_peaks_above_eager(make):
    torch.manual_seed(0)
    model, x = make()
    eager = copy.deepcopy(model)
    auto = convbn.convert(copy.deepcopy(model), example_inputs=x)
    torch.manual_seed(1)
    peak_eager = _step_peak(eager, x)
    torch.manual_seed(1)
    peak_auto = _step_peak(auto, x)
    # Equal up to per-channel statistics: a fused layer keeps its batch mean / invstd
    # (2 x C floats) from forward to backward, and at tiny batches the peak can fall on a
    # moment where those few KiB are alive in one model and not the other.
    stats = sum(2 * m.num_features * 4 for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    assert peak_auto <= peak_eager + stats


def test_tensor_peak_counts_a_known_allocation():
    with tensor_peak() as tp:
        a = torch.empty(1 << 20, dtype=torch.float32)  # 4 MiB
        del a
        b = torch.empty(1 << 18, dtype=torch.float32)  # 1 MiB, alive at the end
    assert tp.result.peak == 4 << 20
    assert tp.result.end == 1 << 20
    assert tp.result.source == "tensors"
    del b
