"""The opt-in fused element-wise kernels of a chain layer (autograd/chain_kernels.py, issue 25).

The pure functions (functional/bn_act.py) equal the ATen path's maths in float64; compiled
and wired into a converted model they match eager within float32 rounding, and the fused
path is what ran (it is switched on here; off, the same model takes the ATen path).
"""
import copy
import shutil

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import convbn
from convbn.autograd import chain_kernels
from convbn.functional.activations import Activation
from convbn.functional.batchnorm import BNSpec, bn_apply, bn_backward, bn_forward
from convbn.functional.bn_act import bn_act_backward, bn_act_forward


@pytest.mark.parametrize("act", ["relu", "silu", "identity"])
@pytest.mark.parametrize("affine", [True, False])
def test_pure_functions_equal_aten_path_in_float64(act, affine):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64)
    grad = torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64)
    w, b = (torch.rand(4, generator=g, dtype=torch.float64) + 0.5, torch.randn(4, generator=g, dtype=torch.float64)) if affine else (None, None)
    a, spec = Activation(act), BNSpec(1e-5, True, 0.0)
    z, mean, invstd = bn_forward(y, w, b, None, None, spec)
    out_ref = a(z)
    out, m, i = bn_act_forward(y, w, b, 1e-5, a)
    assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    assert_close((m, i), (mean, invstd), rtol=1e-12, atol=1e-12)
    gz = a.backward(grad, bn_apply(y, mean, invstd, w, b))
    ref = bn_backward(gz, y, w, mean, invstd, spec, (True, True, True))
    got = bn_act_backward(grad, y, w, b, mean, invstd, a)
    assert_close(got[0], ref[0], rtol=1e-10, atol=1e-12)
    if affine:
        assert_close(got[1:], ref[1:], rtol=1e-10, atol=1e-12)


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor's CPU kernels need a C++ compiler")
def test_fused_kernels_in_a_converted_model_match_eager(monkeypatch):
    torch.manual_seed(0)
    eager = _net()
    fused = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv")
    warm = torch.randn(4, 3, 6, 6)
    for m in (fused, eager):  # the first step (and its one-time gradient check) before counting
        m(warm).sum().backward()
    runs = []
    real_run = chain_kernels._run

    def counted(name, *a):
        out = real_run(name, *a)
        runs.append((name, out is not None))
        return out
    monkeypatch.setattr(chain_kernels, "_run", counted)
    with convbn.fused_kernels(True):
        x = torch.randn(4, 3, 6, 6)
        xe = x.clone().requires_grad_()
        x.requires_grad_()
        for n in (4, 2):  # another batch size: the same (dynamic-shape) kernels
            out, out_e = fused(x[:n]), eager(xe[:n])
            grad = torch.randn_like(out)
            out.backward(grad)
            out_e.backward(grad)
    assert len(fused.convbn_report.pairs) == 2
    # every layer's forward and backward ran the fused kernels, two steps
    assert runs == [("fwd", True)] * 2 + [("bwd", True)] * 2 + [("fwd", True)] * 2 + [("bwd", True)] * 2
    assert_close(out, out_e, rtol=1e-4, atol=1e-5)
    assert_close(x.grad, xe.grad, rtol=1e-4, atol=1e-5)
    for p, pe in zip(fused.parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, rtol=1e-4, atol=1e-4 * max(1.0, pe.grad.abs().max().item()))
    for b, be in zip(fused.buffers(), eager.buffers()):
        assert_close(b, be, rtol=1e-5, atol=1e-6)


def test_fused_kernels_rejects_non_bool():
    with pytest.raises(TypeError, match="bool"):
        convbn.fused_kernels("yes")


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor's CPU kernels need a C++ compiler")
def test_fused_kernels_peak_is_the_aten_paths_at_the_allocator_and_in_the_timeline():
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(3) for m in (nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())])
    fused = convbn.convert(net, strategy="recompute_conv")
    x = torch.randn(8, 16, 24, 24)

    def step():
        for p in fused.parameters():
            p.grad = None
        fused(x).sum().backward()

    peaks = {}
    for on in (False, True):
        with convbn.fused_kernels(on):
            step()  # compiled and warm
            peaks[on] = (convbn.memory.allocator_peak(step), convbn.memory.timeline(fused, x).peak)
    # the kernels hold no tensor-sized temporary the ATen path does not (per-channel buffers aside)
    assert peaks[True][0] <= peaks[False][0] + 16 * 1024, peaks
    # and the timeline, whose dispatch mode would make Dynamo run the kernels' pure functions
    # op by op, reports the ATen path's peak for them: the same bytes
    assert peaks[True][1] == peaks[False][1], peaks
