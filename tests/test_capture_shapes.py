"""Python code on shapes, with ``example_inputs``: the trace carries the real shapes, so
TF-"SAME" padding (``if in_h % stride == 0``), odd-size padding (``zip(skip.shape[2:],
x.shape[2:])``) and inline drop-path (``torch.rand(x.shape[0], 1, 1, 1)``) take eager's branch
and fuse; the graph is guarded on the input shapes (another shape captures a variant for it;
a scripted fold refuses it)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convbn
from capture_helpers import TOL, assert_same_state, twins
from fusion_checks import assert_chain_ran, assert_fused


class SamePad(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int) -> None:
        super().__init__()
        self.conv, self.bn, self.k, self.stride = nn.Conv2d(cin, cout, k, stride), nn.BatchNorm2d(cout), k, stride

    def forward(self, x):
        in_h = x.shape[2]
        if in_h % self.stride == 0:
            pad = max(self.k - self.stride, 0)
        else:
            pad = max(self.k - in_h % self.stride, 0)
        x = F.pad(x, [pad // 2, pad - pad // 2, pad // 2, pad - pad // 2])
        return F.relu(self.bn(self.conv(x)))


class MobileLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(SamePad(3, 8, 3, 2), SamePad(8, 8, 3, 1), SamePad(8, 16, 3, 2))

    def forward(self, x):
        return self.layers(x)


class UpSkip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down, self.up, self.bn = nn.Conv3d(2, 8, 3, 2, 1), nn.ConvTranspose3d(8, 4, 2, 2), nn.BatchNorm3d(4)

    def forward(self, skip):
        x = torch.relu(self.bn(self.up(self.down(skip))))
        pads = []
        for s, t in zip(skip.shape[2:], x.shape[2:]):
            pads = [0, s - t] + pads
        return torch.cat([F.pad(x, pads), skip], 1)


class DropPath(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        x = self.stem(x)
        y = torch.relu(self.bn(self.conv(x)))
        if self.training:
            mask = torch.rand(x.shape[0], 1, 1, 1, device=x.device, dtype=x.dtype) < 0.8
            y = y * mask / 0.8
        return x + y


CASES = {"same_padding": (MobileLike, (4, 3, 15, 15), 3), "odd_size_padding": (UpSkip, (2, 2, 7, 9, 7), 1),
         "inline_drop_path": (DropPath, (4, 3, 8, 8), 2)}


def rand(shape, seed):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def train_step(model, x, s):
    torch.manual_seed(s)
    out = model(x)
    out.backward(rand(out.shape, 100 + s))
    return out.detach()


@pytest.mark.parametrize("case", CASES)
def test_shape_code_fuses_with_example_inputs(case):
    make, shape, bns = CASES[case]
    eager, twin = twins(make)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # same shapes: no guard fails, no check falls back
        fast = convbn.convert(twin, example_inputs=rand(shape, 0))
        report = assert_fused(fast, pairs=bns)
        assert not report.untraced, report
        for s in range(3):
            x = rand(shape, s)
            torch.testing.assert_close(train_step(fast, x, s), train_step(eager, x, s), **TOL)
            assert_same_state(eager, fast)
    torch.manual_seed(0)
    assert_chain_ran(fast(rand(shape, 0)))


@pytest.mark.parametrize("case", CASES)
def test_other_shapes_run_a_variant(case):
    make, shape, _ = CASES[case]
    eager, twin = twins(make)
    fast = convbn.convert(twin, example_inputs=rand(shape, 0))
    other = (shape[0] * 2, *shape[1:-1], shape[-1] + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # captured for those shapes, checked on its first call
        out = train_step(fast, rand(other, 1), 1)
    assert "input shapes" in fast.convbn_report.variants[0], fast.convbn_report
    torch.testing.assert_close(out, train_step(eager, rand(other, 1), 1), **TOL)
    assert_same_state(eager, fast)
    torch.manual_seed(0)
    assert_chain_ran(fast(rand(shape, 0)))  # the traced shapes still run fused


@pytest.mark.parametrize("case", ["same_padding", "odd_size_padding"])  # drop-path: no shape code in eval
def test_shape_code_folds_with_example_inputs(case):
    make, shape, bns = CASES[case]
    eager, twin = twins(make)
    for m in (eager, twin):  # statistics to fold
        train_step(m, rand(shape, 3), 3)
        m.eval()
    folded = convbn.fold(twin, example_inputs=rand(shape, 0))
    report = folded.convbn_report
    assert sum(o.result == "folded" for o in report.outcomes) == bns, report
    assert report.check.passed, report
    with torch.no_grad():
        for fwd in [m.forward for m in folded.modules() if "forward" in m.__dict__]:
            fwd.original = None  # the traced shapes must run the folded graphs
        torch.testing.assert_close(folded(rand(shape, 1)), eager(rand(shape, 1)), **TOL)
        for m in folded.modules():
            m.__dict__.get("forward", m).__dict__.pop("original", None)
        other = (shape[0] * 2, *shape[1:-1], shape[-1] + 1)
        with pytest.warns(RuntimeWarning, match="input shapes"):
            torch.testing.assert_close(folded(rand(other, 2)), eager(rand(other, 2)), **TOL)


def test_a_scripted_fold_refuses_other_shapes():
    """TorchScript runs the graph without the Python guard: it checks the traced shapes itself
    (an error, never padding computed for other sizes)."""
    eager, twin = twins(MobileLike)
    for m in (eager, twin):
        train_step(m, rand((4, 3, 15, 15), 3), 3)
        m.eval()
    scripted = torch.jit.script(convbn.fold(twin, example_inputs=rand((4, 3, 15, 15), 0)))
    with torch.no_grad():
        torch.testing.assert_close(scripted(rand((4, 3, 15, 15), 1)), eager(rand((4, 3, 15, 15), 1)), **TOL)
        with pytest.raises((RuntimeError, torch.jit.Error), match="traced for inputs of shape"):
            scripted(rand((4, 3, 16, 16), 1))
