"""The per-sample norm table is the one place a norm is described (issue 39).

A row deleted from :data:`convbn.functional.norms.NORMS` is recognised nowhere (convert leaves
the model as it was and reports nothing about it); a row added for a norm convbn never heard
of (a toy "RMS over channels" module) fuses with no other edit, exact against eager.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import convbn
import convbn.functional.norms as norms
from capture_helpers import assert_steps_match
from fusion_checks import assert_fused
from convbn.functional.norms import NORMS, NormCall, NormRow


def _model(norm: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm, nn.SiLU(), nn.Conv2d(4, 4, 1)).double()


@pytest.mark.expect_unfused("the GroupNorm row is deleted: nothing to fuse")
@pytest.mark.parametrize("row, norm", [("group_norm", lambda: nn.GroupNorm(2, 4)),
                                       ("instance_norm", lambda: nn.InstanceNorm2d(4, affine=True))])
def test_deleted_row_is_recognised_nowhere(monkeypatch: pytest.MonkeyPatch, row: str, norm) -> None:
    model = _model(norm())
    monkeypatch.setattr(norms, "NORMS", [r for r in NORMS if r.name != row])
    fast = convbn.convert(copy.deepcopy(model))
    assert not fast.convbn_report.pairs
    assert all(o.batchnorm != "1" for o in fast.convbn_report.outcomes)
    assert not list(convbn.fused_modules(fast))


class ChannelRMS(nn.Module):
    """A norm convbn has no code for: ``y / sqrt(mean_c(y^2) + eps) * weight`` per sample and position."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(channels) + 0.5), eps

    def forward(self, y: Tensor) -> Tensor:
        return _rms(y, NormCall("channel_rms", self.eps), self.weight, None, None, None)


def _rms(y: Tensor, call: NormCall, w, b, rm, rv) -> Tensor:
    out = y * torch.rsqrt(y.pow(2).mean(1, keepdim=True) + call.eps)
    return out * w.view(1, -1, *([1] * (y.dim() - 2))) if w is not None else out


TOY = NormRow("channel_rms", "per sample and position, over the channels (root mean square)", _rms,
              lambda m: NormCall("channel_rms", float(m.eps)) if isinstance(m, ChannelRMS) else None,
              lambda a: "never called functionally", modules=(ChannelRMS,), standard_forwards=(ChannelRMS.forward,))


def test_added_row_fuses_with_no_other_edit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(norms, "NORMS", [*NORMS, TOY])
    torch.manual_seed(0)
    eager = _model(ChannelRMS(4))
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    report = assert_fused(fast, pairs=2)
    assert [(p.conv, p.bn, p.activation) for p in report.pairs][0] == ("0", "1", "silu")
    assert_steps_match(eager, fast, torch.randn(2, 3, 6, 6, dtype=torch.float64))
