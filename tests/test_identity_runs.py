"""A run of ``nn.Identity`` calls between a norm and the convolution that reads it.

timm's ``LayerNormAct2d`` without an activation calls ``self.drop`` and ``self.act``, both
``nn.Identity``, and ViTamin's MbConv block then calls ``self.down`` (another one) before its 1x1
convolution: three identity calls between the pre-activation norm and the conv. A convolution
absorbed one identity (as it absorbs a zero padding), so the norm was left ("module '...drop'
reads the value, not a convolution"): 6 of ``vitamin_small_224``'s 8 channel LayerNorms. Now it
absorbs the run, in a pre-activation head and between two layers of a chain alike; float64 equal
to eager over two steps (outputs, every gradient, running statistics).
"""
from __future__ import annotations

import torch
from torch import nn

import convbn
from capture_helpers import assert_steps_match, perturbed_twins, randomise_batchnorms
from fusion_checks import assert_fused


def _pre_norm() -> nn.Module:
    """GroupNorm -> Identity x 3 -> Conv -> GroupNorm -> ReLU -> Conv (a pre-activation head)."""
    return nn.Sequential(nn.GroupNorm(2, 6), nn.Identity(), nn.Identity(), nn.Identity(),
                         nn.Conv2d(6, 8, 1), nn.GroupNorm(4, 8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))


def _between_layers() -> nn.Module:
    """Conv -> BN -> Identity x 2 -> Conv -> BN -> ReLU: one chain of two layers."""
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.Identity(), nn.Identity(),
                         nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())


def test_norm_before_a_run_of_identities_heads_a_chain() -> None:
    eager, work = perturbed_twins(_pre_norm)
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fast = convbn.convert(work, example_inputs=x)
    report = assert_fused(fast, chains=1, skipped=0)
    assert {o.batchnorm for o in report.outcomes if o.result == "fused"} == {"0", "5"}, report
    assert_steps_match(eager, fast, x)


def test_layers_linked_through_a_run_of_identities_chain() -> None:
    eager, work = perturbed_twins(_between_layers)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fast = convbn.convert(work, example_inputs=x)
    assert_fused(fast, pairs=2, chains=1, skipped=0)
    assert_steps_match(eager, fast, x)


def _bn_before_identities() -> nn.Module:
    """Conv -> ReLU -> BN -> Identity x 2 -> 1x1 Conv: the BN folds only into the conv after it."""
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(6), nn.Identity(), nn.Identity(),
                         nn.Conv2d(6, 8, 1))


def test_fold_into_the_conv_past_a_run_of_identities() -> None:
    """timm MaxViT's MbConv ``pre_norm`` (a BatchNormAct2d whose act is an identity) -> ``down`` (an
    identity) -> conv1_1x1 was left by fold ("activation Identity sits between it and ...")."""
    model = randomise_batchnorms(_bn_before_identities()).eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    folded = convbn.fold(model)
    (o,) = folded.convbn_report.outcomes
    assert o.result == "folded" and o.direction == "following" and o.layer == "5", o
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    torch.testing.assert_close(folded(x), model(x), rtol=1e-12, atol=1e-12)
