"""How often a per-sample-norm chain's backward runs each convolution again (Note: [a conv run
once per rebuild] in autograd/norm_chain_memory.py): :func:`norm_conv_runs`, which the planner's
recompute cost reads (``ChainCost.recompute``), against the convolutions
:class:`NormChainFunction`'s backward really runs, counted per layer for every plan of a chain
with and without a pre-activation head. Counting calls, not time.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

import convbn.autograd.norm_chain as norm_chain
from convbn.autograd.norm_chain import NormChainFunction, NormLayerSpec
from convbn.autograd.norm_chain_memory import norm_conv_runs
from convbn.functional.activations import Activation
from convbn.functional.conv import conv_spec_from_module
from convbn.functional.norms import NormCall
from convbn.passes.plan.peak_model import ChainCost

#: (conv channels in -> out or None for a head, norm row or "", activation, its kind)
Layer = Tuple[Optional[Tuple[int, int]], str, str, str]
CHAINS: Dict[str, List[Layer]] = {
    # dwconv -> LayerNorm, 1x1 -> GELU, 1x1 (ConvNeXt), then a GroupNorm layer before the end
    "convnext": [((4, 4), "channel_layer_norm", "identity", "identity"), ((4, 8), "", "gelu", "smooth"),
                 ((8, 4), "group_norm", "silu", "smooth"), ((4, 2), "", "identity", "identity")],
    # GroupNorm -> SiLU -> conv -> GroupNorm -> SiLU -> conv (a diffusion ResBlock)
    "pre-activation": [(None, "group_norm", "silu", "smooth"), ((4, 4), "group_norm", "silu", "smooth"),
                       ((4, 4), "instance_norm", "relu", "output"), ((4, 2), "", "identity", "identity")],
    # the last layer has a norm: recomputed for its own norm's backward where not kept
    "norm-last": [((4, 4), "group_norm", "silu", "smooth"), ((4, 4), "group_norm", "silu", "smooth")],
}


def _norm(row: str, c: int) -> Optional[NormCall]:
    if not row:
        return None
    if row == "group_norm":
        return NormCall("group_norm", 1e-5, 2)
    if row == "instance_norm":
        return NormCall("instance_norm", 1e-5)
    return NormCall(row, 1e-5, normalized=(c,))


def _chain(layers: List[Layer], keep: Tuple[bool, ...], drop: bool = True
           ) -> Tuple[Tuple[NormLayerSpec, ...], List[torch.Tensor]]:
    specs, params = [], []
    c = 4
    for (io, row, act, _), k in zip(layers, keep):
        conv = None
        if io is not None:
            m = nn.Conv2d(io[0], io[1], 3, padding=1, groups=io[0] if io == (4, 4) and row == "channel_layer_norm" else 1)
            conv, c = conv_spec_from_module(m), io[1]
            params += [m.weight.detach().clone().requires_grad_(), m.bias.detach().clone().requires_grad_()]
        if row:
            params += [torch.rand(c, requires_grad=True), torch.randn(c, requires_grad=True)]
        specs.append(NormLayerSpec(conv, _norm(row, c), Activation(act), keep_y=k, may_drop=drop))
    return tuple(specs), params


def _backward_runs(layers: List[Layer], keep: Tuple[bool, ...], monkeypatch: pytest.MonkeyPatch,
                   drop: bool = True) -> Tuple[int, ...]:
    torch.manual_seed(0)
    specs, params = _chain(layers, keep, drop)
    weights = [p for p in params if p.dim() == 4]
    conv_layers = [i for i, (io, *_) in enumerate(layers) if io is not None]
    runs = [0] * len(layers)
    counting = [False]
    real = norm_chain.conv_forward

    def counted(x: torch.Tensor, w: torch.Tensor, *args: object) -> torch.Tensor:
        if counting[0]:
            runs[conv_layers[next(k for k, p in enumerate(weights) if p.shape == w.shape and torch.equal(p.detach(), w))]] += 1
        return real(x, w, *args)

    monkeypatch.setattr(norm_chain, "conv_forward", counted)
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    out = NormChainFunction.apply(x, *params, specs, ((None, None),) * len(specs))
    assert type(out.grad_fn).__name__ == "NormChainFunctionBackward"
    counting[0] = True
    out.sum().backward()
    return tuple(runs)


@pytest.mark.parametrize("drop", [True, False], ids=["may-drop", "no-drop"])
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_backward_runs_each_conv_as_often_as_the_model_says(name: str, drop: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    layers = CHAINS[name]
    kinds, norms = [l[3] for l in layers], [l[1] for l in layers]
    head = layers[0][0] is None
    for keep in itertools.product((False, True), repeat=len(layers)):
        measured = _backward_runs(layers, keep, monkeypatch, drop)
        assert norm_conv_runs(keep, kinds, norms, head, drops=[drop] * len(layers)) == measured, (name, keep)


def test_a_fully_recomputed_convnext_block_runs_its_depthwise_conv_twice() -> None:
    """The planner's cost counts each run: recomputing the depthwise conv of a ConvNeXt block
    costs twice its MACs unless its output is kept (Note: [a conv run once per rebuild]), or once
    where its 1x1 conv may not drop its rebuilt input (the LayerNorm's output rebuilt for the end
    conv kept for the 1x1 conv's backward: Note: [a norm before a dropped conv recomputed once]);
    after a norm with an activation, twice either way."""
    acts, norms = ("identity", "smooth", "identity"), ("channel_layer_norm", "", "")
    assert norm_conv_runs([False, False, False], acts, norms) == (2, 1, 0)
    assert norm_conv_runs([False, False, False], acts, norms, drops=[False] * 3) == (1, 1, 0)
    acted = ("smooth", "smooth", "identity")
    assert norm_conv_runs([False, False, False], acted, ("group_norm", "", ""), drops=[False] * 3) == (2, 1, 0)
    cost = ChainCost((4, 16, 4), (4, 4, 16), (10, 100, 100), acts, norms=norms, end=True)
    assert cost.recompute([False, False, False]) == 2 * 10 + 100
    assert cost.recompute([True, False, False]) == 100
    assert cost.recompute([False, True, False]) == 10
    batch = ChainCost((4, 16, 4), (4, 4, 16), (10, 100, 100), ("output", "output", "identity"), end=True)
    assert batch.recompute([False, False, False]) == 210  # a BatchNorm chain: once per layer, as before
