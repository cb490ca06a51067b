"""convert as a pipeline of values (issue 32): the canonicalising rewrites are one declared list
the pipeline runs before matching (matching itself changes no node); each chain's plan is one
frozen value, made once and taken whole; the custom op's structure table holds a chain's
structure only while a chain owns it."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch import nn

import convbn
from convbn.autograd.chain_plan import ChainPlan, LazyPlan
from convbn.autograd.chain_structure import structure_of
from convbn.nn.chain import FusedChain
from convbn.passes.convert.match import find_layers
from convbn.passes.convert.pipeline import CANONICALISE, canonicalise
from convbn.passes.tracing.trace import LayerTracer, trace
from convbn.passes.report.convert_report import ConvertReport
from fusion_checks import assert_fused


class _Tokens(nn.Module):
    """``bn(linear(t).transpose(1, 2))``: BatchNorm1d over tokens, and a nested concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.fc(t).transpose(1, 2))
        return torch.cat([torch.cat([y, y], 1), y], 1)


def _chains(model: nn.Module):
    return [m for _, m in convbn.fused_modules(model) if isinstance(m, FusedChain)]


def test_canonicalising_rewrites_are_one_declared_list():
    assert [r.name for r in CANONICALISE] == [
        "zero-width pads read by concatenations", "flatten nested concatenations", "token BatchNorms on rows", "no-op flattens before a BatchNorm1d",
        "casts to a value's own dtype", "reduction dims from the end made absolute",
        "channel LayerNorms as one node", "channels-last LayerNorms read by a Linear as a norm and a 1x1 convolution",
        "hand-written channel LayerNorms as one node",
        "hand-written channel RMSNorms as one node", "additions of zero", "float32 round trips around a norm",
        "crops of a convolution's output as padding",
        "BatchNorms of a concatenation per piece", "shared pre-activation heads per conv"]
    assert [r.chains_only for r in CANONICALISE] == [False] * 7 + [True] + [False] * 6 + [True]


def test_matching_changes_no_node_the_pipeline_canonicalises_first():
    model = _Tokens()
    gm = trace(model, LayerTracer, training=True).gm
    before = str(gm.graph)
    assert find_layers(gm, model, "", ConvertReport(strategy="auto")) == []  # a token BN matches nothing as traced
    assert str(gm.graph) == before
    canonicalise(gm, model, "", chain=True)
    after = str(gm.graph)
    assert after != before  # one cat of the leaves, the BN on rows
    layers = find_layers(gm, model, "", ConvertReport(strategy="auto"))
    assert [l.bn_name for l in layers] == ["bn"] and str(gm.graph) == after


def test_each_chain_plan_is_one_frozen_value():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                        nn.ReLU())
    x = torch.randn(2, 3, 12, 12)
    planned = convbn.convert(net, example_inputs=x)
    assert_fused(planned, pairs=2, chains=1)
    (chain,) = _chains(planned)
    assert isinstance(chain.plan, ChainPlan) and chain.plan.modes == tuple(l.mode for l in chain.layers)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chain.plan.keep = (False, False)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        chain.eager = True  # eager modules only through a plan that says so
    with pytest.raises(AttributeError, match="apply_plan"):  # a layer's mode is its chain's plan's record
        chain.layers[0].mode = "recompute_conv"
    lazy = convbn.convert(net)
    (chain,) = _chains(lazy)
    assert isinstance(chain.plan, LazyPlan) and chain.plan_on_first_call is not None
    lazy(x).sum().backward()
    assert isinstance(chain.plan, ChainPlan) and chain.plan_on_first_call is None
    assert chain.plan.modes == tuple(l.mode for l in chain.layers)


def test_the_op_structure_lives_with_its_chains():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 7, 3), nn.BatchNorm2d(7, eps=1.5e-5), nn.SiLU())
    fast = convbn.convert(net, strategy="recompute_conv")
    (chain,) = _chains(fast)
    key = chain.op_key
    assert structure_of(key) is chain.op_structure
    copied = __import__("copy").deepcopy(fast)  # a copy shares the structure (and compiled kernels)
    assert _chains(copied)[0].op_structure is chain.op_structure
    del fast, chain, copied
    gc.collect()
    with pytest.raises(KeyError, match="no live convbn chain"):
        structure_of(key)
