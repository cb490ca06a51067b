"""pytorch3dunet's ``UNet3D`` in small (its ``DoubleConv`` with the library's default layer order
``gcr``: GroupNorm -> Conv -> ReLU before each convolution), converted with ``example_inputs``:
on the engine of 2026-11-28 morning its default plan measured above eager's peak (1.03x on the
library's net) and every GroupNorm ran unfused (Note: [never above eager] in
``passes/plan/auto_plan.py``); the planner on main since plans it within eager's peak. A
regression test of that: every GroupNorm fused, the step's peak not above eager's."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import convbn
from capture_helpers import assert_steps_match
from convbn.memory import timeline
from fusion_checks import assert_fused


def _double(cin: int, cout: int, groups: int = 4) -> nn.Sequential:
    """pytorch3dunet's ``DoubleConv`` in the encoder's shape, layer order ``gcr``."""
    mid = max(cout // 2, cin) if cin < cout else cout
    return nn.Sequential(nn.GroupNorm(1 if cin < groups else groups, cin), nn.Conv3d(cin, mid, 3, padding=1, bias=False),
                         nn.ReLU(), nn.GroupNorm(groups, mid), nn.Conv3d(mid, cout, 3, padding=1, bias=False), nn.ReLU())


class PreNormUNet3D(nn.Module):
    def __init__(self, f: tuple = (8, 16, 32)) -> None:
        super().__init__()
        self.enc = nn.ModuleList([_double(1, f[0]), _double(f[0], f[1]), _double(f[1], f[2])])
        self.dec = nn.ModuleList([_double(f[2] + f[1], f[1]), _double(f[1] + f[0], f[0])])
        self.out = nn.Conv3d(f[0], 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, enc in enumerate(self.enc):
            x = enc(F.max_pool3d(x, 2) if i else x)
            skips.append(x)
        for dec, skip in zip(self.dec, skips[-2::-1]):
            x = dec(torch.cat([skip, F.interpolate(x, size=skip.shape[2:], mode="nearest")], 1))
        return self.out(x)


def test_prenorm_unet_fuses_every_groupnorm_within_eager_peak() -> None:
    torch.manual_seed(0)
    eager = PreNormUNet3D().double()
    x = torch.randn(2, 1, 16, 16, 16, dtype=torch.float64)
    eager_peak = timeline(copy.deepcopy(eager), x).peak
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    report = assert_fused(fast, chains=10)  # a pre-activation head (the GroupNorm) and its conv each
    assert not report.eager_fallback, report
    assert [o.result for o in report.outcomes] == ["fused"] * 10, report
    assert timeline(fast, x).peak <= eager_peak  # exact peaks on CPU, the standard step
    fast.zero_grad(set_to_none=True)
    assert_steps_match(eager, fast, x, steps=2)
