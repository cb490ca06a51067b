"""A norm over the channels written with ``movedim`` instead of ``permute`` (``passes/bn/norm_sites.py``,
``_channels_to_last``): diffusers' video autoencoders (LTX-Video's shortcut norm,
``norm(x.movedim(1, -1)).movedim(-1, 1)`` with an ``nn.LayerNorm``; AutoencoderDC's and LTX's RMSNorms are
written the same way). ``movedim(1, -1)`` is the permute ``(0, 2, ..., 1)`` at every rank, in values and
strides, so a LayerNorm (or ``nn.RMSNorm``) between it and ``movedim(-1, 1)`` is a channel norm of the
table: it fuses with the convolution before it (or starts a pre-activation chain) and trains as eager in
float64, on 4-D and on 5-D tensors. A ``movedim`` that puts another dimension last is left as written."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

import convbn
from capture_helpers import assert_steps_match, perturbed_twins
from fusion_checks import fused_chains
from convbn.functional.norms import channel_layer_norm, channel_rms_norm
from convbn.nn.norm_chain import FusedNormChain
from convbn.passes.bn.norm_sites import channel_layer_norms


class PostNorm3d(nn.Module):
    """Conv3d, ``x.movedim(1, -1)``, LayerNorm, ``.movedim(-1, 1)``, SiLU, Conv3d (a video VAE's block)."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv3d(3, c, 3, padding=1), nn.LayerNorm(c), nn.Conv3d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.nn.functional.silu(self.norm(self.conv1(x).movedim(1, -1)).movedim(-1, 1)))


class ShortcutNorm(nn.Module):
    """LTX-Video's shortcut: the block's input normalised over its channels (``torch.movedim``), then a 1x1
    conv (a pre-norm head: no convolution before the norm)."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.norm, self.conv = nn.LayerNorm(c, eps=1e-6), nn.Conv2d(c, 2 * c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.movedim(self.norm(torch.movedim(x, 1, -1)), -1, 1))


class RMSNormMoveaxis(nn.Module):
    """Conv2d, ``nn.RMSNorm`` between ``moveaxis(1, -1)`` and ``moveaxis(-1, 1)``, GELU, Conv2d."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(3, c, 3, padding=1), nn.RMSNorm(c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.nn.functional.gelu(self.norm(self.conv1(x).moveaxis(1, -1)).moveaxis(-1, 1)))


MODELS = {"post-norm-3d": (PostNorm3d, (2, 3, 3, 5, 5), channel_layer_norm),
          "shortcut-pre-norm": (ShortcutNorm, (2, 6, 5, 5), channel_layer_norm),
          "rms-moveaxis": (RMSNormMoveaxis, (2, 3, 6, 6), channel_rms_norm)}


@pytest.mark.parametrize("example", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_movedim_channel_norm_fuses_and_trains_as_eager(name: str, example: bool) -> None:
    make, shape, _ = MODELS[name]
    eager, work = perturbed_twins(make)
    x = torch.randn(shape, dtype=torch.float64)
    fast = convbn.convert(work, strategy="recompute_conv", example_inputs=(x,) if example else None)
    assert [(o.batchnorm, o.result) for o in fast.convbn_report.outcomes] == [("norm", "fused")]
    assert fused_chains(fast) and all(isinstance(c, FusedNormChain) for c in fused_chains(fast))
    assert_steps_match(eager, fast, x, steps=2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_movedims_and_the_norm_become_one_node(name: str) -> None:
    make, shape, fn = MODELS[name]
    model = make().double()
    gm = fx.symbolic_trace(model)
    assert channel_layer_norms(gm) == 1
    assert len([n for n in gm.graph.nodes if n.target is fn]) == 1
    assert not any(n.op == "call_module" and n.target == "norm" for n in gm.graph.nodes)
    assert not any(n.target in ("movedim", "moveaxis", torch.movedim, torch.moveaxis) for n in gm.graph.nodes)
    x = torch.randn(shape, dtype=torch.float64)
    out, ref = gm(x), model(x)
    assert torch.equal(out, ref) and out.stride() == ref.stride()


class HeightLast(nn.Module):
    """``movedim(2, -1)`` puts the height last (a LayerNorm over the height); ``movedim(1, 2)`` keeps the
    channels inside: neither is a channel norm."""

    def __init__(self, source: int, destination: int) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 6, 3, padding=1), nn.LayerNorm(6)
        self.move = (source, destination)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.move
        return self.norm(self.conv(x).movedim(a, b)).movedim(b, a)


@pytest.mark.expect_unfused("a LayerNorm over the height: nothing to fuse")
@pytest.mark.parametrize("move", [(2, -1), (1, 2)])
def test_a_movedim_of_another_dimension_is_left_as_written(move: tuple) -> None:
    model = HeightLast(*move).double()
    assert channel_layer_norms(fx.symbolic_trace(model)) == 0
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)  # height 6 == channels: it runs, over another axis
    fast = convbn.convert(copy.deepcopy(model))
    assert not fast.convbn_report.pairs
    assert torch.equal(fast(x), model(x))
