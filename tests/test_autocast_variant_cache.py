"""A module captured again for a call under autocast (a variant), in a model converted with
float32 ``example_inputs``: the capture's fake run casts the real weights under a fake-tensor mode,
and autocast keeps each parameter's cast until its region ends (Note: [fake casts left in
autocast's cache] in passes/graph/shape_capture.py). The steps under bf16 autocast must be eager
autocast's, with real tensors out, the rewrite kept (no fallback warning) and the chains running.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import convbn
from fusion_checks import assert_chain_ran

pytest.importorskip("monai")


class UNetStage(nn.Module):
    """MONAI BasicUNet's last stage: a TwoConv, then an UpCat (deconv upsample, the skip, TwoConv)."""

    def __init__(self) -> None:
        super().__init__()
        from monai.networks.nets.basic_unet import TwoConv, UpCat

        act = ("LeakyReLU", {"negative_slope": 0.1, "inplace": True})
        norm = ("instance", {"affine": True})
        self.down = TwoConv(3, 1, 8, act, norm, True, 0.0)
        self.up = UpCat(3, 8, 8, 8, act, norm, True, 0.0, "deconv")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x)
        return self.up(torch.nn.functional.max_pool3d(h, 2), h)


def test_steps_under_autocast_after_a_float32_convert_are_eager_autocasts() -> None:
    torch.manual_seed(0)
    eager = UNetStage()
    x = torch.randn(2, 1, 16, 16, 16)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    for step in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a rewrite set aside on its first call warns
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out_f = fast(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_e = eager(x)
        assert type(out_f) is torch.Tensor and out_f.dtype == torch.bfloat16, type(out_f)
        assert_chain_ran(out_f)
        torch.testing.assert_close(out_f, out_e, rtol=0, atol=0, msg=f"step {step}")
        g = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(step)).to(out_e.dtype)
        out_f.backward(g)
        out_e.backward(g)
        for (name, p), q in zip(eager.named_parameters(), fast.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=f"gradient of {name}, step {step}")
        for (name, b), c in zip(eager.named_buffers(), fast.buffers()):
            torch.testing.assert_close(c, b, rtol=0, atol=0, msg=f"buffer {name}, step {step}")
        eager.zero_grad(set_to_none=True)
        fast.zero_grad(set_to_none=True)
