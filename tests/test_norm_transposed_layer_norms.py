"""A LayerNorm over the channels written with ``transpose`` instead of ``permute``
(``passes/bn/norm_sites.py``, ``_channels_to_last``): vocos' ConvNeXt block
(``dwconv(x).transpose(1, 2)`` -> ``nn.LayerNorm`` -> Linear MLP -> ``transpose(1, 2)``) and
its stem (``transpose(-1, 1)`` spelled with ``torch.transpose`` here), and transformers' speech
feature encoders (``transpose(-2, -1)``), on the 3-D output of a Conv1d. Both fuse with the convolution before them and train as eager (float64); on a 4-D tensor
a transpose reorders the positions (or, ``transpose(1, 2)``, normalises the height) and is left
as written."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn
import torch.nn.functional as F

import convbn
from capture_helpers import assert_steps_match, perturbed_twins
from fusion_checks import fused_chains
from convbn.functional.norms import channel_layer_norm
from convbn.nn.norm_chain import FusedNormChain
from convbn.passes.bn.norm_sites import channel_layer_norms


class VocosBlock(nn.Module):
    """vocos' ConvNeXtBlock: depthwise Conv1d, ``transpose(1, 2)``, LayerNorm, Linear MLP, back."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.dw, self.norm = nn.Conv1d(c, c, 7, padding=3, groups=c), nn.LayerNorm(c, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dw(x).transpose(1, 2))
        return x + self.fc2(F.gelu(self.fc1(h))).transpose(1, 2)


class StemLN(nn.Module):
    """vocos' stem: Conv1d, ``norm(x.transpose(1, 2)).transpose(1, 2)``, then a conv reads it
    (here spelled ``torch.transpose(x, -1, 1)``)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.embed, self.norm, self.conv = nn.Conv1d(3, c, 7, padding=3), nn.LayerNorm(c), nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.transpose(self.norm(torch.transpose(self.embed(x), -1, 1)), 1, -1)
        return self.conv(F.gelu(y))


class SpeechConvLN(nn.Module):
    """transformers' ``Wav2Vec2LayerNormConvLayer`` (WavLM, Data2VecAudio, SEW-D alike): Conv1d,
    ``transpose(-2, -1)``, LayerNorm, ``transpose(-2, -1)``, GELU; two of them, as its feature encoder."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv0, self.norm0 = nn.Conv1d(1, c, 10, stride=5, bias=False), nn.LayerNorm(c)
        self.conv1, self.norm = nn.Conv1d(c, c, 3, stride=2, bias=False), nn.LayerNorm(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm0(self.conv0(x).transpose(-2, -1)).transpose(-2, -1))
        return F.gelu(self.norm(self.conv1(h).transpose(-2, -1)).transpose(-2, -1))


MODELS = {"vocos-block": (VocosBlock, (2, 8, 20)), "stem": (StemLN, (2, 3, 20))}
SPEECH = (SpeechConvLN, (2, 1, 80))


@pytest.mark.parametrize("example", [True, False])
def test_a_speech_encoders_negative_transposes_fuse_and_train_as_eager(example: bool) -> None:
    make, shape = SPEECH
    eager, work = perturbed_twins(make)
    x = torch.randn(shape, dtype=torch.float64)
    fast = convbn.convert(work, strategy="recompute_conv", example_inputs=(x,) if example else None)
    assert sorted((o.batchnorm, o.result) for o in fast.convbn_report.outcomes) == [("norm", "fused"),
                                                                                    ("norm0", "fused")]
    assert fused_chains(fast) and all(isinstance(c, FusedNormChain) for c in fused_chains(fast))
    assert_steps_match(eager, fast, x, steps=2)
    gm = fx.symbolic_trace(make().double())
    assert channel_layer_norms(gm) == 2
    assert not any(n.target == "transpose" for n in gm.graph.nodes)


@pytest.mark.parametrize("example", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_transposed_channel_layer_norm_fuses_and_trains_as_eager(name: str, example: bool) -> None:
    make, shape = MODELS[name]
    eager, work = perturbed_twins(make)
    x = torch.randn(shape, dtype=torch.float64)
    fast = convbn.convert(work, strategy="recompute_conv", example_inputs=(x,) if example else None)
    assert [(o.batchnorm, o.result) for o in fast.convbn_report.outcomes] == [("norm", "fused")]
    assert all(isinstance(c, FusedNormChain) for c in fused_chains(fast))
    assert_steps_match(eager, fast, x, steps=2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_transposes_and_the_layer_norm_become_one_node(name: str) -> None:
    make, shape = MODELS[name]
    model = make().double()
    gm = fx.symbolic_trace(model)
    assert channel_layer_norms(gm) == 1
    calls = [n for n in gm.graph.nodes if n.target is channel_layer_norm]
    assert len(calls) == 1
    assert not any(n.op == "call_module" and n.target == "norm" for n in gm.graph.nodes)
    x = torch.randn(shape, dtype=torch.float64)
    out, ref = gm(x), model(x)
    assert torch.equal(out, ref) and out.stride() == ref.stride()


class HeightLN(nn.Module):
    """``transpose(1, 2)`` of a 4-D tensor puts the height last: a LayerNorm over the height;
    ``transpose(1, -1)`` (``last``) normalises the channels but reorders the positions."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.conv, self.norm, self.dim = nn.Conv2d(3, 6, 3, padding=1), nn.LayerNorm(6), -1 if last else 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x).transpose(1, self.dim)).transpose(1, self.dim)


@pytest.mark.expect_unfused("a LayerNorm over the height / a 4-D transpose: nothing to fuse")
@pytest.mark.parametrize("last", [False, True])
def test_a_4d_transpose_is_left_as_written(last: bool) -> None:
    model = HeightLN(last).double()
    assert channel_layer_norms(fx.symbolic_trace(model)) == 0
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)  # height 6 == channels: it runs, over the wrong axis
    fast = convbn.convert(copy.deepcopy(model))
    assert not fast.convbn_report.pairs
    assert torch.equal(fast(x), model(x))
