"""CUDA paths: every strategy, convert/fold, double backward, channels_last, autocast,
``torch.compile`` and a one-process NCCL group, each compared with eager PyTorch on the GPU.

Every test skips (per test) without a CUDA device, so the suite passes on CPU-only machines.
Float64 runs on the GPU compare at 1e-10 like the CPU grids; float32/fp16/bf16 runs compare
within the tolerance eager's own reduced precision allows (cuDNN picks different algorithms
for the fused and unfused convolutions).
"""
from __future__ import annotations

import copy
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import gradcheck, gradgradcheck
from torch.testing import assert_close

import convbn
from cuda_helpers import exact_cuda_numerics, one_process_nccl
from convbn.functional.conv import make_conv_spec
from convbn.functional.batchnorm import BNSpec
from convbn.functional.activations import get_activation
from convbn.autograd.dispatch import conv_bn_act_spec
from convbn.functional.conv_bn_call import ConvBNTensors
from convbn.nn.fused_conv_bn import FusedConvBN1d, FusedConvBN2d, FusedConvBN3d

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _exact_float32_and_deterministic_cudnn():
    """Compare like with like (cuda_helpers.exact_cuda_numerics: no TF32, deterministic cuDNN)."""
    with exact_cuda_numerics():
        yield
F64 = dict(rtol=1e-10, atol=1e-10)
FUSED = {1: FusedConvBN1d, 2: FusedConvBN2d, 3: FusedConvBN3d}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
ACTS = {"relu": nn.ReLU, "silu": nn.SiLU, "hardswish": nn.Hardswish, "none": nn.Identity}


def _eager_twin(fused: nn.Module, act: str) -> nn.Sequential:
    return nn.Sequential(copy.deepcopy(fused.conv), copy.deepcopy(fused.bn), ACTS[act]())


def _state(m: nn.Module) -> List[torch.Tensor]:
    return [b for b in m.buffers()] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("dims", (1, 2, 3))
@pytest.mark.parametrize("act", tuple(ACTS))
@pytest.mark.parametrize("strategy", ("recompute_conv", "recompute_bn", "frozen"))
def test_fused_layer_matches_eager_on_cuda_float64(dims, act, strategy):
    torch.manual_seed(0)
    fused = FUSED[dims](3, 5, 3, padding=1, activation=None if act == "none" else act, strategy=strategy,
                        device=CUDA, dtype=torch.float64)
    with torch.no_grad():
        fused.bn.weight.uniform_(0.5, 1.5)
        fused.bn.bias.uniform_(-0.5, 0.5)
        fused.bn.running_var.uniform_(0.5, 2.0)
    if strategy == "frozen":
        fused.bn.eval()
    eager = _eager_twin(fused, act)
    if strategy == "frozen":
        eager[1].eval()
    for _ in range(2):
        x = torch.randn(4, 3, *([6] * dims), device=CUDA, dtype=torch.float64, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        out, out_e = fused(x), eager(xe)
        g = torch.randn_like(out)
        out.backward(g)
        out_e.backward(g)
        assert_close(out, out_e, **F64)
        assert_close(x.grad, xe.grad, **F64)
        for a, b in zip(_state(fused), _state(eager)):
            assert_close(a, b, **F64)


@pytest.mark.parametrize("strategy", ("recompute_conv", "recompute_bn"))
def test_gradcheck_and_gradgradcheck_on_cuda(strategy):
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5, 5, device=CUDA, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, 3, 3, device=CUDA, dtype=torch.float64, requires_grad=True)
    g = torch.rand(4, device=CUDA, dtype=torch.float64).add_(0.5).requires_grad_()
    b = torch.randn(4, device=CUDA, dtype=torch.float64, requires_grad=True)
    conv = make_conv_spec(2, (3, 3), 1, 1, 1, 1)
    bn = BNSpec(1e-5, True, 0.1)

    def f(x, w, g, b):
        return conv_bn_act_spec(x, ConvBNTensors(w, None, g, b, None, None), conv, bn, get_activation("silu"), strategy)

    assert gradcheck(f, (x, w, g, b))
    assert gradgradcheck(f, (x, w, g, b))


def _net(dims: int = 2) -> nn.Sequential:
    c, b = CONV[dims], BN[dims]
    return nn.Sequential(
        c(3, 8, 3, padding=1), b(8), nn.ReLU(),
        c(8, 16, 3, padding=1, bias=False), b(16), nn.SiLU(),
        c(16, 8, 1), b(8, momentum=None), nn.Hardswish(),
    )


@pytest.mark.parametrize("dims", (2, 3))
@pytest.mark.parametrize("kw", ({"strategy": "auto"}, {"strategy": "recompute_bn"},
                                {"strategy": "recompute_conv"}, {"strategy": "recompute_conv", "chain": False}),
                         ids=("auto", "recompute_bn", "recompute_conv", "tutorial"))
def test_convert_matches_eager_on_cuda_float64(dims, kw):
    torch.manual_seed(0)
    eager = _net(dims).to(CUDA, torch.float64)
    model = copy.deepcopy(eager)
    x = torch.randn(4, 3, *([8] * dims), device=CUDA, dtype=torch.float64)
    conv = convbn.convert(model, example_inputs=x if kw["strategy"] == "auto" else None, **kw)
    assert len(conv.convbn_report.pairs) == 3
    opt, opt_e = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(3):
        out, out_e = conv(x), eager(x)
        g = torch.randn_like(out)
        out.backward(g)
        out_e.backward(g)
        assert_close(out, out_e, **F64)
        for a, b in zip(_state(model), _state(eager)):
            assert_close(a, b, **F64)
        opt.step()
        opt_e.step()
        opt.zero_grad()
        opt_e.zero_grad()


def test_channels_last_on_cuda_keeps_layout_and_values():
    torch.manual_seed(0)
    eager = _net().to(CUDA).to(memory_format=torch.channels_last)
    model = copy.deepcopy(eager)
    conv = convbn.convert(model)
    x = torch.randn(8, 3, 16, 16, device=CUDA).to(memory_format=torch.channels_last)
    out, out_e = conv(x), eager(x)
    assert out.is_contiguous(memory_format=torch.channels_last) == out_e.is_contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(out)
    out.backward(g)
    out_e.backward(g)
    assert_close(out, out_e, rtol=1e-4, atol=1e-4)
    for p, pe in zip(model.parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, rtol=1e-3, atol=1e-3 * max(1.0, pe.grad.abs().max().item()))


def test_autocast_bf16_on_cuda_outputs_match_eager_dtype_and_stats_stay_float32():
    torch.manual_seed(0)
    eager = _net().to(CUDA)
    model = copy.deepcopy(eager)
    conv = convbn.convert(model)
    x = torch.randn(4, 3, 16, 16, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, out_e = conv(x), eager(x)
    assert out.dtype == out_e.dtype
    out.float().square().mean().backward()
    out_e.float().square().mean().backward()
    for b, be in zip(model.buffers(), eager.buffers()):
        assert b.dtype == be.dtype
    assert_close(out.float(), out_e.float(), rtol=5e-2, atol=5e-2)


def test_compile_fullgraph_on_cuda_matches_eager():
    torch.manual_seed(0)
    torch._dynamo.reset()
    eager = _net().to(CUDA)
    model = copy.deepcopy(eager)
    conv = torch.compile(convbn.convert(model), fullgraph=True)
    x = torch.randn(4, 3, 16, 16, device=CUDA)
    out, out_e = conv(x), eager(x)
    g = torch.randn_like(out)
    out.backward(g)
    out_e.backward(g)
    assert_close(out, out_e, rtol=1e-3, atol=1e-3)
    for b, be in zip(model.buffers(), eager.buffers()):
        assert_close(b, be, rtol=1e-4, atol=1e-5)
    for p, pe in zip(model.parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, rtol=1e-2, atol=1e-3 * max(1.0, pe.grad.abs().max().item()))


def test_fold_on_cuda_matches_eval_model():
    torch.manual_seed(0)
    model = _net().to(CUDA)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    model.eval()
    x = torch.randn(4, 3, 16, 16, device=CUDA)
    folded = convbn.fold(model, example_inputs=x)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    assert_close(folded(x), model(x), rtol=1e-4, atol=1e-4)


def _cuda_step_peak(model: nn.Module, x: torch.Tensor) -> Tuple[int, int]:
    """(peak above the start, bytes held at the end of forward) of one training step."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = model(x)
    end_of_forward = torch.cuda.memory_allocated() - start
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    del out
    for p in model.parameters():
        p.grad = None
    return peak, end_of_forward


@pytest.mark.parametrize("kw", ({"strategy": "auto"}, {"strategy": "recompute_conv", "chain": False}),
                         ids=("auto", "tutorial"))
def test_cuda_fused_peak_and_end_of_forward_not_above_eager(kw):
    torch.manual_seed(0)
    eager = _net().to(CUDA)
    x = torch.randn(32, 3, 64, 64, device=CUDA)
    conv = convbn.convert(copy.deepcopy(eager), example_inputs=x if kw["strategy"] == "auto" else None, **kw)
    for m in (eager, conv):  # warm-up: cuDNN workspaces and allocator state
        _cuda_step_peak(m, x)
    peak_e, fwd_e = _cuda_step_peak(eager, x)
    peak, fwd = _cuda_step_peak(conv, x)
    assert fwd < fwd_e
    assert peak <= peak_e


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                    reason="needs NCCL")
def test_one_process_nccl_syncbatchnorm_ddp_matches_eager():
    with one_process_nccl(CUDA):
        torch.manual_seed(0)
        eager = _net().to(CUDA, torch.float64)
        sync = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(eager))
        conv = convbn.convert(sync)
        ddp = nn.parallel.DistributedDataParallel(conv, device_ids=[0])
        x = torch.randn(4, 3, 8, 8, device=CUDA, dtype=torch.float64)
        out, out_e = ddp(x), eager(x)
        g = torch.randn_like(out)
        out.backward(g)
        out_e.backward(g)
        assert_close(out, out_e, **F64)
        for p, pe in zip(sync.parameters(), eager.parameters()):
            assert_close(p.grad, pe.grad, **F64)
        for b, be in zip(sync.buffers(), eager.buffers()):
            assert_close(b, be, **F64)


def test_cuda_timeline_maximum_is_the_allocator_peak_of_the_step():
    torch.manual_seed(0)
    model = convbn.convert(_net().to(CUDA))
    x = torch.randn(16, 3, 32, 32, device=CUDA)

    def step() -> int:
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(x).float().mean().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    step()  # warm-up: cuDNN handles and workspaces
    peak = step()
    for p in model.parameters():
        p.grad = None
    tl = convbn.memory.timeline(model, x)
    assert tl.source == "cuda"
    assert tl.peak == peak


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                    reason="needs NCCL")
@pytest.mark.parametrize("order", ["convert-then-shard", "shard-then-convert-inplace"])
def test_one_process_nccl_fsdp2_matches_eager_fsdp2_fused(order: str) -> None:
    """FSDP2 over NCCL on one GPU (world size 1): a converted model sharded per block and at the
    root, in either order, trains like eager FSDP2 (outputs, gradients, running statistics)
    with the fused chains running."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (fully_shard)")
    from test_fsdp2 import Net, shard, train

    with one_process_nccl(CUDA):
        torch.manual_seed(0)
        base = Net().to(CUDA, torch.float64)
        xs = [torch.randn(4, 3, 6, 6, device=CUDA, dtype=torch.float64) for _ in range(3)]
        eager = train(shard(copy.deepcopy(base)), xs)
        if order == "convert-then-shard":
            model = shard(convbn.convert(copy.deepcopy(base)))
        else:
            model = convbn.convert(shard(copy.deepcopy(base)), inplace=True)
        fast = train(model, xs)
        for ye, yf in zip(eager["outs"], fast["outs"]):
            assert_close(yf, ye, **F64)
        for ge, gf in zip(eager["grads"], fast["grads"]):
            assert ge.keys() == gf.keys()
            for n in ge:
                assert_close(gf[n], ge[n], **F64)
        for n, b in eager["buffers"].items():
            assert_close(fast["buffers"][n], b, **F64)
        assert len(model.convbn_report.pairs) == 5, str(model.convbn_report)
        assert fast["chains"] >= 3, (fast["chains"], str(model.convbn_report))


def test_allocator_peak_on_cuda_counts_blocks_and_nests_over_a_peak_reset():
    """convbn.memory.allocator_peak(fn, "cuda") counts the caching allocator's blocks from the
    profiler's events: a 64 MiB tensor freed before a reset of the CUDA peak statistics (what
    convbn's CUDA timeline does per operator inside convert) still counts, where
    ``max_memory_allocated`` over the same block sees only what came after the reset."""
    from convbn.memory import allocator_peak

    n = 16 * 2**20  # 64 MiB of float32

    def block() -> None:
        big = torch.empty(n, device=CUDA)
        big.fill_(1.0)
        del big
        torch.cuda.reset_peak_memory_stats()
        small = torch.empty(n // 16, device=CUDA)
        small.fill_(1.0)
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peak = allocator_peak(block, "cuda")
    assert peak >= 4 * n, peak
    assert peak < 4 * n + 4 * n // 16 + 2**20, peak  # the big block, not both at once
    assert torch.cuda.max_memory_allocated() - start < 4 * n  # the reset hid the big block from the counter
