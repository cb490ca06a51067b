"""Converted models and fused layers under autocast, channels_last and torch.compile."""
import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import convbn
from convbn.memory import saved_bytes, track_saved


STRATEGIES = ["auto", "recompute_bn", "recompute_conv"]


def _net(dims: int = 2) -> nn.Module:
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
    return nn.Sequential(
        conv(3, 8, 3, padding=1), bn(8), nn.ReLU(),
        conv(8, 16, 3, padding=1, bias=False), bn(16), nn.SiLU(),
        conv(16, 8, 1), bn(8, momentum=None),
    )


def _input(dims: int, n: int = 4, s: int = 8) -> torch.Tensor:
    return torch.randn(n, 3, *([s] * dims))


def _step_both(model: nn.Module, eager: nn.Module, x: torch.Tensor) -> None:
    """One forward + backward of both with the same random upstream gradient; outputs compared."""
    out, out_e = model(x), eager(x)
    g = torch.randn_like(out)
    out.backward(g)
    out_e.backward(g)
    assert_close(out, out_e, rtol=1e-4, atol=1e-5)


def _assert_grads_close(model: nn.Module, eager: nn.Module) -> None:
    for p, pe in zip(model.parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, rtol=1e-3, atol=1e-4 * max(1.0, pe.grad.abs().max().item()))


def _grads(m: nn.Module):
    return [p.grad.float() for p in m.parameters()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_autocast_bf16_cpu_matches_eager_within_eagers_own_error(strategy):
    torch.manual_seed(0)
    ref32 = _net()
    eager, fused = copy.deepcopy(ref32), copy.deepcopy(ref32)
    conv = convbn.convert(fused, strategy=strategy)
    x = _input(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_e = conv(x), eager(x)
    out32 = ref32(x)
    assert out.dtype == out_e.dtype == torch.bfloat16
    g = torch.randn_like(out32)
    out.backward(g.to(out.dtype))
    out_e.backward(g.to(out_e.dtype))
    out32.backward(g)
    assert_close(out.float(), out_e.float(), rtol=0, atol=0)  # same kernels in the same order
    for p, pe, p32 in zip(fused.parameters(), eager.parameters(), ref32.parameters()):
        assert p.grad.dtype == torch.float32  # gradients reach the float32 parameters
        eager_err = (pe.grad - p32.grad).abs().max()
        scale = p32.grad.abs().max()
        # element-wise recompute in bf16 rounds in a different order: stay within what
        # eager's own bf16 error is (plus a margin relative to the gradient's scale)
        assert (p.grad - pe.grad).abs().max() <= 2 * eager_err + 2e-2 * scale
    for b, be in zip(fused.buffers(), eager.buffers()):
        assert b.dtype == be.dtype  # running stats stay float32
        assert_close(b, be, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv", "frozen"])
def test_fused_module_autocast_keeps_float32_stats(strategy):
    torch.manual_seed(0)
    m = convbn.FusedConvBN2d(3, 8, 3, padding=1, activation="relu", strategy=strategy)
    if strategy == "frozen":
        m.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(4, 3, 8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    assert m.conv.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert m.bn.running_mean.dtype == torch.float32


@pytest.mark.parametrize("dims,fmt", [(2, torch.channels_last), (3, torch.channels_last_3d)])
@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv"])
def test_channels_last_preserved_and_no_extra_copies(dims, fmt, strategy):
    torch.manual_seed(0)
    eager = _net(dims).to(memory_format=fmt)
    fused = copy.deepcopy(eager)
    conv = convbn.convert(fused, strategy=strategy)
    x = _input(dims).to(memory_format=fmt).requires_grad_()
    xe = x.detach().clone().requires_grad_()
    with track_saved() as rec:
        out = conv(x)
    out_e = eager(xe)
    # the same layout as eager (whose kernels choose it: e.g. a CPU 1x1 Conv3d may
    # return contiguous) -- convbn never converts on its own
    assert out.stride() == out_e.stride()
    g = torch.randn_like(out)
    out.backward(g)
    out_e.backward(g)
    assert x.grad.is_contiguous(memory_format=fmt)
    assert x.grad.stride() == xe.grad.stride()
    assert_close(out, out_e)
    assert_close(x.grad, xe.grad, rtol=1e-4, atol=1e-5)
    # activations kept: the chain input plus kept conv outputs, each exactly once and
    # each in channels_last (a contiguous copy would add a second storage of the same size)
    act = [(shape, nb) for _, shape, _, nb in rec.result.shapes if len(shape) == dims + 2]
    layers = conv.convbn_chain0.layers
    expected = [tuple(x.shape)] + [l.y_shape for l in layers if l.mode == "recompute_bn"]
    assert sorted(s for s, _ in act) == sorted(expected)
    for shape, nb in act:
        numel = 1
        for s in shape:
            numel *= s
        assert nb == numel * 4


def test_channels_last_fused_module_matches_eager():
    torch.manual_seed(0)
    m = convbn.FusedConvBN2d(3, 8, 3, padding=1, activation="relu").to(memory_format=torch.channels_last)
    ref = nn.Sequential(copy.deepcopy(m.conv), copy.deepcopy(m.bn), nn.ReLU())
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    out = m(x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, ref(x))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto"])
def test_torch_compile_fullgraph_matches_eager_and_keeps_no_more(strategy):
    torch.manual_seed(0)
    eager = _net()
    eager[4].eval()  # a frozen BN inside a training model
    fused = copy.deepcopy(eager)
    conv = convbn.convert(fused, strategy=strategy)
    compiled = torch.compile(conv, fullgraph=True)  # fullgraph: any graph break raises
    x = _input(2)
    for _ in range(2):  # momentum=None: the cumulative factor changes every step
        _step_both(compiled, eager, x)
    _assert_grads_close(fused, eager)
    for b, be in zip(fused.buffers(), eager.buffers()):
        assert_close(b, be, rtol=1e-4, atol=1e-6)
    conv.eval()
    eager.eval()
    with torch.no_grad():
        assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
    conv.train()
    eager.train()
    # compile adds no saved activations over the uncompiled converted model
    # (measuring runs training forwards: running stats move, so this comes last)
    compiled_act = saved_bytes(compiled, x).activation_bytes
    plain_act = saved_bytes(conv, x).activation_bytes
    assert compiled_act <= plain_act
    assert plain_act < saved_bytes(eager, x).activation_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_amp_fp16_with_grad_scaler(strategy):
    torch.manual_seed(0)
    eager = _net().cuda()
    fused = copy.deepcopy(eager)
    conv = convbn.convert(fused, strategy=strategy)
    x = _input(2).cuda()
    outs = []
    for model in (conv, eager):
        params = list(fused.parameters()) if model is conv else list(eager.parameters())
        opt = torch.optim.SGD(params, lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        assert out.dtype == torch.float16
        scaler.scale(out.float().square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        outs.append(out.float())
    assert_close(outs[0], outs[1], rtol=1e-2, atol=1e-2)
    for p, pe in zip(fused.parameters(), eager.parameters()):
        assert_close(p, pe, rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_matches_eager(strategy):
    torch.manual_seed(0)
    eager = _net().cuda()
    fused = copy.deepcopy(eager)
    conv = convbn.convert(fused, strategy=strategy)
    x = _input(2).cuda()
    out, out_e = conv(x), eager(x)
    g = torch.randn_like(out)
    out.backward(g)
    out_e.backward(g)
    assert_close(out, out_e, rtol=1e-4, atol=1e-4)
    for p, pe in zip(fused.parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, rtol=1e-3, atol=1e-3 * max(1.0, pe.grad.abs().max().item()))


def test_torch_compile_dynamic_shapes_plans_auto_on_first_call():
    """``auto`` without example inputs plans on the first call; under ``dynamic=True`` the
    sizes it plans on are SymInts (also what Dynamo's automatic dynamic shapes give once a
    chain's code saw two shapes), which the planner must read as concrete sizes."""
    torch.manual_seed(0)
    eager = _net()
    conv = convbn.convert(copy.deepcopy(eager), strategy="auto")
    compiled = torch.compile(conv, fullgraph=True, dynamic=True)
    for s in (8, 10):
        _step_both(compiled, eager, _input(2, s=s))
    _assert_grads_close(conv, eager)
    modes = [l.mode for _, m in convbn.fused_modules(conv) if isinstance(m, convbn.FusedChain) for l in m.layers]
    assert modes and set(modes) <= {"recompute_bn", "recompute_conv"}
