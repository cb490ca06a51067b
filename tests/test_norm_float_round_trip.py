"""``norm(x.float()).type(x.dtype)`` (guided-diffusion's ``GroupNorm32``, torchcfm's U-Net) fuses
as the norm it computes (Note: [a norm's float32 round trip] in ``passes/bn/norm_casts.py``)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import assert_steps_match
from convbn.passes.bn.norm_casts import norm_float_round_trips
from convbn.passes.tracing.trace import LayerTracer
from fusion_checks import assert_fused

#: float32 steps: the fused chain and eager's norm round differently (no float64 here: eager's
#: ``GroupNorm32`` itself refuses a float64 model, its input cast to float32 and its weight not)
FLOAT32 = dict(rtol=1e-4, atol=1e-5)


class GroupNorm32(nn.GroupNorm):
    """OpenAI guided-diffusion's norm: computed in float32, cast back to the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).type(x.dtype)


class GroupNormTo32(nn.GroupNorm):
    """The same round trip spelled with ``.to``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(torch.float32)).to(x.dtype)


def _net(norm: type) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), norm(4, 16), nn.SiLU(), nn.Conv2d(16, 16, 3, padding=1),
                         norm(4, 16), nn.SiLU(), nn.Conv2d(16, 4, 3, padding=1))


@pytest.mark.parametrize("norm", [GroupNorm32, GroupNormTo32])
@pytest.mark.parametrize("with_inputs", [True, False])
def test_float32_round_trip_norms_fuse_and_match_eager(norm: type, with_inputs: bool) -> None:
    torch.manual_seed(0)
    eager = _net(norm)
    x = torch.randn(2, 3, 16, 16)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x if with_inputs else None, strategy="recompute_bn")
    report = assert_fused(fast, pairs=3, chains=1)  # two norm layers and the chain's end conv
    assert [(o.batchnorm, o.result) for o in report.outcomes] == [("1", "fused"), ("4", "fused")], report
    assert_steps_match(eager, fast, x, steps=2, tol=FLOAT32)


class ShapeBranch(nn.Module):
    """Python on the input's shape (guided-diffusion's ``while len(emb.shape) < len(h.shape)``):
    traced with real shapes, where ``x.dtype`` is a constant of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _net(GroupNorm32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2 == 0:
            x = x * 2
        return self.body(x)


def test_round_trip_in_a_graph_traced_with_real_shapes_fuses() -> None:
    torch.manual_seed(0)
    eager = ShapeBranch()
    x = torch.randn(2, 3, 16, 16)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x, strategy="recompute_bn")
    report = assert_fused(fast, pairs=3, chains=1)
    assert [(o.batchnorm, o.result) for o in report.outcomes] == [("body.1", "fused"), ("body.4", "fused")], report
    assert_steps_match(eager, fast, x, steps=2, tol=FLOAT32)


def test_only_a_cast_back_to_the_same_tensor_s_dtype_is_removed() -> None:
    class CastElsewhere(nn.Module):  # the cast back reads another tensor's dtype: left as it is
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.norm = nn.GroupNorm(2, 8)

        def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
            return self.norm(self.conv(x).float()).type(other.dtype)

    root = CastElsewhere()
    gm = torch.fx.GraphModule(root, LayerTracer().trace(root))
    assert norm_float_round_trips(gm) == 0
    net = _net(GroupNorm32)
    gm = torch.fx.GraphModule(net, LayerTracer().trace(net))
    assert norm_float_round_trips(gm) == 2
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("float", "type")]
