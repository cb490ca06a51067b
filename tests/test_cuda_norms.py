"""Per-sample norm chains (GroupNorm, InstanceNorm, channel LayerNorm) on CUDA, each compared with
eager PyTorch on the GPU: float64 training steps, the chain Function's gradcheck, inductor with
bf16 autocast and channels_last, the step's allocator peak, and one-process NCCL DDP / FSDP2.

Every test skips without a CUDA device, so the suite passes on CPU-only machines
(tests/test_norm_chains.py and tests/test_norm_distributed.py are the CPU counterparts).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

import convbn
from bench_modules import load_benchmark
from capture_helpers import perturbed_twins
from cuda_helpers import exact_cuda_numerics, one_process_nccl
from fusion_checks import assert_chain_ran, assert_fused, chain_nodes, fused_chains
from test_norm_chains import MODELS, _layer_specs
from convbn.autograd.norm_chain import NormChainFunction
from convbn.nn.norm_chain import FusedNormChain

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = torch.device("cuda", 0)
F64 = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def _no_tf32_deterministic_cudnn():
    """Like with like (cuda_helpers.exact_cuda_numerics: no TF32, deterministic cuDNN)."""
    with exact_cuda_numerics():
        yield


def _cuda_twins(make: Any, dtype: torch.dtype = torch.float64) -> tuple:
    """``capture_helpers.perturbed_twins`` (every parameter moved by 0.1 * N(0, 1)) on the GPU in ``dtype``."""
    return tuple(m.to(CUDA, dtype) for m in perturbed_twins(make))


def _two_steps(eager: nn.Module, fast: nn.Module, x: Tensor, tol: Dict[str, float], fused: bool = True) -> None:
    """Two training steps of both: outputs, input and parameter gradients, buffers equal."""
    for k in range(2):
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_f = eager(xe), fast(xf)
        if fused:
            assert_chain_ran(out_f)
        g = torch.randn(out_e.shape, dtype=out_e.dtype, device=CUDA, generator=torch.Generator(CUDA).manual_seed(k))
        out_e.backward(g)
        out_f.backward(g)
        assert_close(out_f, out_e, **tol)
        assert_close(xf.grad, xe.grad, **tol)
        for (name, p), q in zip(eager.named_parameters(), fast.parameters()):
            assert_close(q.grad, p.grad, **tol, msg=f"gradient of {name}")
        for (name, b), c in zip(eager.named_buffers(), fast.buffers()):
            assert_close(c, b, **tol, msg=f"buffer {name}")
        eager.zero_grad(set_to_none=True)
        fast.zero_grad(set_to_none=True)


CASES = ["groupnorm-silu", "instancenorm2d-affine-stats", "instancenorm3d-stats-momentum-none", "layernorm2d-subclass",
         "channels-last-layernorm", "pre-activation", "convnext-1x1-mlp", "functional-group-norm"]


@pytest.mark.parametrize("strategy", ["recompute_bn", "recompute_conv", "auto"])
@pytest.mark.parametrize("name", CASES)
def test_norm_chain_matches_eager_on_cuda_float64(name: str, strategy: str) -> None:
    make, shape, pairs = MODELS[name]
    eager, work = _cuda_twins(make)
    x = torch.randn(shape, dtype=torch.float64, device=CUDA)
    fast = convbn.convert(work, strategy=strategy)
    assert_fused(fast, pairs=pairs)
    assert all(isinstance(c, FusedNormChain) for c in fused_chains(fast))
    _two_steps(eager, fast, x, F64)


@pytest.mark.parametrize("keep", [(True, True), (False, False)])
def test_norm_chain_function_gradcheck_and_gradgradcheck_on_cuda(keep: tuple) -> None:
    specs = _layer_specs(keep)
    g = torch.Generator(CUDA).manual_seed(0)

    def t(*shape: int) -> Tensor:
        return torch.randn(*shape, dtype=torch.float64, device=CUDA, generator=g).requires_grad_()

    params = [t(4, 3, 3, 3), t(4), t(4), t(4), t(4, 4, 3, 3), t(4), t(4), t(4), t(2, 4, 1, 1), t(2)]
    x = t(2, 3, 5, 5)

    def f(x: Tensor, *ps: Tensor) -> Tensor:
        return NormChainFunction.apply(x, *ps, specs, ((None, None),) * 3)

    assert torch.autograd.gradcheck(f, (x, *params))
    assert torch.autograd.gradgradcheck(f, (x, *params))


class ResBlock(nn.Module):
    """A diffusion ResBlock: GroupNorm -> SiLU -> Conv, twice, plus the skip."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))


class SmallUNetish(nn.Module):
    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(c), ResBlock(c))
        self.out = nn.Sequential(nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.blocks(self.stem(x)))


def test_inductor_bf16_autocast_channels_last_norm_chains_on_cuda() -> None:
    """torch.compile (inductor, fullgraph) of the converted net under bf16 autocast, channels_last
    input: outputs and gradients as compiled eager's within bf16's rounding, and the compiled
    forward keeps less for backward than compiled eager."""
    eager, work = _cuda_twins(SmallUNetish, torch.float32)
    x = torch.randn(4, 3, 32, 32, device=CUDA).to(memory_format=torch.channels_last)
    fast = convbn.convert(work, example_inputs=x)
    assert_fused(fast)
    ce = torch.compile(eager, fullgraph=True)
    cf = torch.compile(fast, fullgraph=True)
    outs = []
    for m in (ce, cf):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)
        assert y.dtype == torch.bfloat16
        y.float().square().mean().backward()
        outs.append(y.float())
    assert_close(outs[1], outs[0], rtol=0.05, atol=0.05)
    for (name, p), q in zip(eager.named_parameters(), fast.parameters()):
        scale = p.grad.abs().max().item() + 1e-6
        assert (q.grad - p.grad).abs().max().item() <= 0.1 * scale, name
    with torch.autocast("cuda", dtype=torch.bfloat16):
        saved_e = convbn.memory.saved_bytes(ce, x).total
        saved_f = convbn.memory.saved_bytes(cf, x).total
    assert saved_f < saved_e, (saved_f, saved_e)


def _step_peak(model: nn.Module, x: Tensor) -> int:
    """The allocator's peak of one standard step (zero_grad, forward, mean loss, backward, SGD)
    above what was allocated before it."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model(x).float().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    opt.zero_grad(set_to_none=True)
    return peak


@pytest.mark.parametrize("net, shape", [("DiffusionUNet", (8, 3, 64, 64)), ("InstanceUNet3d", (2, 1, 32, 32, 32)),
                                        ("ConvNeXtNet", (16, 3, 64, 64))])
def test_cuda_norm_net_step_peak_not_above_eager(net: str, shape: tuple) -> None:
    """The benchmark's nets on the GPU: the converted step's allocator peak at most eager's."""
    bm = load_benchmark("bm_norm_peaks")
    torch.manual_seed(0)
    model = getattr(bm, net)().to(CUDA)
    x = torch.randn(shape, device=CUDA)
    fast = convbn.convert(copy.deepcopy(model), example_inputs=x)
    assert fused_chains(fast) and all(isinstance(c, FusedNormChain) for c in fused_chains(fast))
    for m in (model, fast):  # warm-up: cuDNN handles and workspaces
        _step_peak(m, x)
    eager_peak, fast_peak = _step_peak(model, x), _step_peak(fast, x)
    print(f"{net}: converted peak {fast_peak / eager_peak:.3f}x of eager's ({fast_peak} / {eager_peak} bytes)")
    assert fast_peak <= eager_peak, (fast_peak / eager_peak, fast.convbn_report)


def _train(model: nn.Module, xs: List[Tensor]) -> Dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, grads, chains = [], [], 0
    for x in xs:
        out = model(x)
        chains += len(chain_nodes(out))
        out.square().mean().backward()
        outs.append(out.detach().clone())
        grads.append({n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                      for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return dict(outs=outs, grads=grads, buffers={n: b.clone() for n, b in model.named_buffers()}, chains=chains)


def _assert_trained_alike(eager: Dict[str, Any], fast: Dict[str, Any]) -> None:
    for ye, yf in zip(eager["outs"], fast["outs"]):
        assert_close(yf, ye, **F64)
    for ge, gf in zip(eager["grads"], fast["grads"]):
        assert ge.keys() == gf.keys()
        for n in ge:
            assert_close(gf[n], ge[n], **F64, msg=n)
    for n, b in eager["buffers"].items():
        assert_close(fast["buffers"][n], b, **F64, msg=n)


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                    reason="needs NCCL")
def test_one_process_nccl_ddp_trains_a_converted_norm_net_like_eager() -> None:
    from test_norm_distributed import Net

    with one_process_nccl(CUDA):
        torch.manual_seed(0)
        base = Net().to(CUDA, torch.float64)
        xs = [torch.randn(4, 3, 8, 8, device=CUDA, dtype=torch.float64) for _ in range(3)]
        ddp = nn.parallel.DistributedDataParallel
        eager = _train(ddp(copy.deepcopy(base), device_ids=[0]), xs)
        fast = convbn.convert(copy.deepcopy(base))
        assert_fused(fast)
        result = _train(ddp(fast, device_ids=[0]), xs)
        _assert_trained_alike(eager, result)
        assert eager["chains"] == 0 and result["chains"] >= len(xs), result["chains"]


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                    reason="needs NCCL")
def test_one_process_nccl_fsdp2_trains_a_converted_norm_net_like_eager() -> None:
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (fully_shard)")
    from torch.distributed.device_mesh import init_device_mesh

    from test_norm_distributed import Net

    with one_process_nccl(CUDA):
        mesh = init_device_mesh("cuda", (1,))

        def shard(model: nn.Module) -> nn.Module:
            for block in model.blocks:
                fsdp.fully_shard(block, mesh=mesh)
            fsdp.fully_shard(model, mesh=mesh)
            return model

        torch.manual_seed(0)
        base = Net().to(CUDA, torch.float64)
        xs = [torch.randn(4, 3, 8, 8, device=CUDA, dtype=torch.float64) for _ in range(3)]
        eager = _train(shard(copy.deepcopy(base)), xs)
        fast = shard(convbn.convert(copy.deepcopy(base)))
        assert_fused(fast)
        result = _train(fast, xs)
        _assert_trained_alike(eager, result)
        assert eager["chains"] == 0 and result["chains"] >= len(xs), result["chains"]
