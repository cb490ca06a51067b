"""asteroid's Conv-TasNet (``TDConvNet`` blocks: Conv1d -> PReLU -> gLN / cLN -> depthwise Conv1d
-> PReLU -> norm -> two 1x1 convs) with the library's own hand-written norms, ``GlobLN`` (a global
LayerNorm) and ``ChanLN`` (a channel LayerNorm), each with its affine between ``transpose(1, -1)``s:
the norm before each depthwise conv and the bottleneck's fuse (heads of chains whose end is
``conv -> PReLU``), the last norm of each block (read by two convs) is left, and the model trains
as eager in float64 with and without ``example_inputs``. Skipped where asteroid is not installed
(``benchmarks/requirements-sweep.txt``); the same patterns without the library:
``tests/test_norm_hand_layer_norms.py``, ``tests/test_norm_chain_end_prelu.py``."""
from __future__ import annotations

import copy
import importlib.util
import sys
import types

import pytest
import torch

import convbn
from capture_helpers import assert_steps_match

pytestmark = pytest.mark.skipif(importlib.util.find_spec("asteroid") is None, reason="asteroid is not installed")


@pytest.fixture
def conv_tasnet(monkeypatch: pytest.MonkeyPatch) -> type:
    if importlib.util.find_spec("soundfile") is None:  # imported by asteroid's package, never called by these nets
        monkeypatch.setitem(sys.modules, "soundfile", types.ModuleType("soundfile"))
    from asteroid.models.conv_tasnet import ConvTasNet

    return ConvTasNet


@pytest.mark.parametrize("example", [True, False])
@pytest.mark.parametrize("norm_type", ["gLN", "cLN"])
def test_conv_tasnet_fuses_its_norms_before_convs_and_trains_as_eager(conv_tasnet: type, norm_type: str,
                                                                       example: bool) -> None:
    torch.manual_seed(0)
    eager = conv_tasnet(n_src=2, n_repeats=1, n_blocks=2, bn_chan=16, hid_chan=32, skip_chan=16, n_filters=32,
                        kernel_size=16, stride=8, norm_type=norm_type).double()
    with torch.no_grad():
        for p in eager.masker.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(2, 400, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn", example_inputs=(x,) if example else None)
    if not example:
        fast(x)  # captured whole on its first call (the root reads shapes in Python)
    outcomes = {o.batchnorm: o.result for o in fast.convbn_report.outcomes}
    assert outcomes == {"masker.bottleneck.0": "fused", "masker.TCN.0.shared_block.2": "fused",
                        "masker.TCN.1.shared_block.2": "fused", "masker.TCN.0.shared_block.5": "left",
                        "masker.TCN.1.shared_block.5": "left"}
    assert_steps_match(eager, fast, x, steps=2)
