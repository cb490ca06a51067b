"""A check's random-number comparison where an operator asks for a generator and draws nothing.

CPU attention (``aten._scaled_dot_product_flash_attention_for_cpu``) is tagged random (its
dropout); with ``dropout_p=0`` it draws nothing, yet the check's private RNG made a generator for
it. Which attention kernel runs depends on grad mode: with a mask that requires grad (a learned
relative-position bias, timm's MaxViT / CoAtNet), the step with autograd runs the composite one,
which asks for no generator, while the eager reference's outputs are taken without autograd
(Note: [the eager reference within a training step's peak]) by the fused kernel. The two runs
listed different generators though neither drew a number, and ``convert(example_inputs=...)``
refused the whole model ("the global RNG state after the step differs"): a Conv -> BN beside
such attention in one forward stayed unfused. A generator that drew nothing is no state now
(Note: [a generator that drew nothing is no state]); one that drew still is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import convbn
from capture_helpers import assert_steps_match, twins
from convbn.functional.private_rng import private_rng
from fusion_checks import assert_fused


class ConvAttention(nn.Module):
    """Conv -> BN -> ReLU, its pixels as tokens attending to each other under a learned bias read
    from a table by an index buffer (a relative-position bias: the mask requires grad only where
    autograd records)."""

    def __init__(self, channels: int = 8, size: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        tokens = size * size
        self.table = nn.Parameter(torch.randn(2 * tokens - 1))
        index = torch.arange(tokens)
        self.register_buffer("index", index[:, None] - index[None, :] + tokens - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)))
        tokens = y.flatten(2).transpose(1, 2).unsqueeze(1).contiguous()  # unit stride: the fused kernel may run
        mask = self.table[self.index][None, None]
        return F.scaled_dot_product_attention(tokens, tokens, tokens, attn_mask=mask, dropout_p=0.0)


def _x() -> torch.Tensor:
    return torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_attention_drawing_nothing_lists_no_generator() -> None:
    q = torch.randn(2, 1, 4, 8)
    with torch.no_grad(), private_rng(0) as drawn:
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 4, 4), dropout_p=0.0)
    assert drawn.states() == []


def test_a_generator_that_drew_is_listed() -> None:
    with private_rng(0) as drawn:
        torch.rand(3)
    assert len(drawn.states()) == 1
    assert not torch.equal(drawn.states()[0], torch.Generator().manual_seed(0).get_state())


def test_conv_bn_beside_attention_with_a_learned_bias_fuses() -> None:
    eager, fast = twins(ConvAttention)
    x = _x()
    fast = convbn.convert(fast, example_inputs=x)
    report = assert_fused(fast, chains=1, skipped=0)
    assert not report.untraced, report
    assert_steps_match(eager, fast, x)
