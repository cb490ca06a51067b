"""``Traced.descend``: the leaves a caller works inside on its own (opaque and hooked),
outermost first; a leaf inside another leaf is reached through the outer one."""
from __future__ import annotations

import torch.fx as fx
from torch import nn

from convbn.passes.tracing.trace import LayerTracer, Traced, trace


def test_a_leaf_inside_a_hooked_leaf_is_reached_through_it() -> None:
    model = nn.Sequential(nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1)), nn.ReLU())
    model[0].register_forward_hook(lambda *args: None)
    traced = trace(model, LayerTracer, leaves=["0.0"])
    assert "0" in traced.hooked and traced.opaque == {"0.0": "asked to be a leaf"}
    assert traced.descend() == {"0": traced.hooked["0"]}


def test_descend_is_outermost_first_and_tells_prefixes_from_parents() -> None:
    gm = fx.symbolic_trace(nn.Identity())
    traced = Traced(gm, gm.graph, opaque={"x.y": "failed", "a.b": "failed", "": "the root"},
                    hooked={"a.b.c": "hook", "a": "hook", "ab": "hook"})
    found = traced.descend()
    # "ab" is not inside "a"; "a.b" and "a.b.c" are; the root itself is never descended into
    assert sorted(found) == ["a", "ab", "x.y"] and found["x.y"] == "failed"
    depths = [name.count(".") for name in found]
    assert depths == sorted(depths)  # outermost first
