"""Python code on shapes, converted without ``example_inputs``: the module is captured with the
real inputs of its first call (TF-"SAME" padding, zip-over-shapes crop before a
ConvTranspose3d -> BatchNorm, inline drop-path) and runs fused from then on, exactly as eager."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convbn
from capture_helpers import TOL, assert_same_state, step, twins
from fusion_checks import assert_chain_ran, assert_fused
from test_capture_shapes import CASES, rand


def ran_fused(fast, eager, x, seed):
    for m in (eager, fast):  # both: their state stays equal
        torch.manual_seed(seed)
        out = m(x)
    assert_chain_ran(out)


@pytest.mark.parametrize("case", CASES)
def test_shape_code_is_captured_on_the_first_call(case):
    make, shape, bns = CASES[case]
    eager, twin = twins(make)
    fast = convbn.convert(twin)
    assert fast.convbn_report.untraced, fast.convbn_report  # not yet: captured on the first call
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the first-call check passes
        for s in range(3):
            x = rand(shape, s)
            torch.testing.assert_close(step(fast, x, seed=s), step(eager, x, seed=s), **TOL)
            assert_same_state(eager, fast)
            ran_fused(fast, eager, x, s)
        report = assert_fused(fast, pairs=bns)
        assert not report.untraced, report
        last = (shape[0] - 1, *shape[1:])  # a smaller last batch: a variant, fused too
        torch.testing.assert_close(step(fast, rand(last, 7), seed=7), step(eager, rand(last, 7), seed=7), **TOL)
        assert_same_state(eager, fast)
        ran_fused(fast, eager, rand(last, 8), 8)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x):
        y = self.block(x)
        return y * 2 if y.sum() > 0 else y


def test_a_module_that_does_not_capture_converts_its_children():
    eager, twin = twins(DataDependent)
    fast = convbn.convert(twin)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for s in range(2):
            x = rand((4, 3, 8, 8), s)
            torch.testing.assert_close(step(fast, x, seed=s), step(eager, x, seed=s), **TOL)
            assert_same_state(eager, fast)
    report = assert_fused(fast, pairs=1)
    assert [m for m, _ in report.untraced] == [""], report
    ran_fused(fast, eager, rand((4, 3, 8, 8), 5), 5)


class Descriptor(nn.Module):
    """A patch-descriptor style net: a rank check with ``len(x.shape)``, a branch on the dtype, a
    tensor constant made in ``forward`` and a parameter read in it."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, affine=False),
                                      nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(8, affine=False))
        self.tau = nn.Parameter(torch.full((1, 8, 1, 1), -0.5))

    def forward(self, x):
        if len(x.shape) != 4:
            raise ValueError(f"expected (B, 1, H, W), got {tuple(x.shape)}")
        y = torch.max(self.features(x), self.tau) * torch.tensor(2.0, dtype=x.dtype)
        if y.dtype in (torch.float16, torch.bfloat16):
            y = F.normalize(y.float(), dim=1).to(y.dtype)
        else:
            y = F.normalize(y, dim=1)
        return y.flatten(1)


@pytest.mark.parametrize("validated", [False, True], ids=["lazy", "example_inputs"])
def test_len_and_dtype_checks_capture_whole(validated):
    eager, twin = twins(Descriptor)
    shape = (4, 1, 8, 8)
    fast = convbn.convert(twin, example_inputs=rand(shape, 0) if validated else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for s in range(3):
            x = rand(shape, s)
            torch.testing.assert_close(step(fast, x, seed=s), step(eager, x, seed=s), **TOL)
            assert_same_state(eager, fast)
            ran_fused(fast, eager, x, s)
    report = assert_fused(fast, pairs=2)
    assert not report.untraced, report
