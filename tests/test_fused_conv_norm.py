"""convbn.nn's GroupNorm / InstanceNorm counterparts of FusedConvBN*d (issue 39): exact against the
eager modules in float64 (outputs, every gradient, running statistics), the fused Function ran,
nn conventions (state_dict keys, Sequential checkpoints, from_modules sharing, errors)."""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from convbn.nn import (FusedConvGroupNorm1d, FusedConvGroupNorm2d, FusedConvGroupNorm3d, FusedConvInstanceNorm1d,
                       FusedConvInstanceNorm2d, FusedConvInstanceNorm3d)

CASES = [
    (FusedConvGroupNorm1d, dict(num_groups=2), (2, 3, 9)),
    (FusedConvGroupNorm2d, dict(num_groups=4), (2, 3, 7, 7)),
    (FusedConvGroupNorm3d, dict(num_groups=1, affine=False), (2, 3, 4, 5, 4)),
    (FusedConvInstanceNorm1d, dict(affine=True), (2, 3, 9)),
    (FusedConvInstanceNorm2d, dict(affine=True, track_running_stats=True), (2, 3, 7, 7)),
    (FusedConvInstanceNorm3d, dict(track_running_stats=True, momentum=None), (2, 3, 4, 5, 4)),
]


@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv"])
@pytest.mark.parametrize("cls, kw, shape", CASES)
def test_matches_eager_modules(cls, kw, shape, strategy: str) -> None:
    torch.manual_seed(0)
    fused = cls(3, 8, 3, padding=1, activation="silu", strategy=strategy, dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    eager = nn.Sequential(OrderedDict(conv=copy.deepcopy(fused.conv), norm=copy.deepcopy(fused.norm), act=nn.SiLU()))
    assert list(fused.state_dict()) == [k for k in eager.state_dict()]
    for _ in range(2):
        x = torch.randn(shape, dtype=torch.float64)
        xf, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_f, out_e = fused(xf), eager(xe)
        assert type(out_f.grad_fn).__name__ == "NormChainFunctionBackward"
        g = torch.randn_like(out_e)
        out_f.backward(g)
        out_e.backward(g)
        torch.testing.assert_close(out_f, out_e, rtol=0, atol=1e-12)
        torch.testing.assert_close(xf.grad, xe.grad, rtol=0, atol=1e-12)
        for (n, p), q in zip(eager.named_parameters(), fused.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12, msg=n)
        for (n, b), c in zip(eager.named_buffers(), fused.buffers()):
            torch.testing.assert_close(c, b, rtol=0, atol=0, msg=n)


def test_conventions() -> None:
    conv, gn = nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8)
    m = FusedConvGroupNorm2d.from_modules(conv, gn, "relu")
    assert m.conv.weight is conv.weight and m.norm is gn
    assert "activation=relu" in repr(m)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8))
    m.load_state_dict(plain.state_dict())
    assert torch.equal(m.conv.weight, plain[0].weight)
    with pytest.raises(ValueError, match="out_channels=8"):
        FusedConvGroupNorm2d.from_modules(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 6))
    with pytest.raises(TypeError, match="InstanceNorm2d"):
        FusedConvInstanceNorm2d.from_modules(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8))
    with pytest.raises(ValueError, match="strategy"):
        FusedConvGroupNorm2d(3, 8, 3, num_groups=2, strategy="frozen")
