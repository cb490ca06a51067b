"""Per-sample-norm chains (GroupNorm, InstanceNorm, channel LayerNorm) under ``torch.compile``
and bf16 autocast: the fused path runs there (Note: [a norm chain under torch.compile] in
``convbn/autograd/norm_chain_compiled.py``; Note: [a norm chain under autocast] in
``convbn/autograd/norm_chain.py``), with eager's values and less saved than eager keeps.

Each test compares one converted model with its eager twin run the same way (compiled with the
same backend, or under the same autocast): outputs, the input's and every parameter's gradient,
running statistics. That the fused path ran is asserted by what it saves (the plan's set, below
the eager model's) or by its autograd node. Graph semantics use ``aot_eager``; one inductor
compile (module-scoped) compares what inductor's graphs keep.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

import convbn
from convbn.autograd.chain_plan import ChainPlan
from convbn.memory import saved_bytes
from fusion_checks import assert_fused, fused_chains
from peak_helpers import step_peak

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: LayerNorm over the channels of ``(N, C, H, W)``."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


class Net(nn.Module):
    """Conv -> GroupNorm -> SiLU, Conv -> InstanceNorm (running stats) -> LeakyReLU, Conv ->
    channel LayerNorm -> GELU, then a diffusion ResBlock's pre-activation GroupNorm -> SiLU -> Conv."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
            nn.LeakyReLU(0.01),
            nn.Conv2d(8, 8, 3, padding=1), LayerNorm2d(8), nn.GELU())
        self.norm, self.conv = nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)
        return h + self.conv(F.silu(self.norm(h)))


def _twins(dtype: torch.dtype = torch.float64) -> Tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = Net().to(dtype)
    with torch.no_grad():
        for m in eager.modules():
            if isinstance(m, (nn.GroupNorm, nn.InstanceNorm2d, nn.LayerNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return eager, convbn.convert(copy.deepcopy(eager))


def _input(seed: int, dtype: torch.dtype = torch.float64, n: int = 4, size: int = 12) -> Tensor:
    x = torch.randn(n, 3, size, size, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    return x.to(memory_format=torch.channels_last)


def _step(model: nn.Module, x: Tensor, g: Tensor, amp: bool = False) -> Tuple[Tensor, Tensor]:
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    out.backward(g)
    return out.detach(), x.grad  # type: ignore[return-value]


def _assert_like(eager: nn.Module, run_eager: nn.Module, fast: nn.Module, run_fast: nn.Module, *, steps: int = 2,
                 amp: bool = False, tol: Dict[str, float] = dict(rtol=1e-12, atol=1e-12)) -> None:
    """``steps`` training steps of each: outputs, input and parameter gradients, buffers (running
    statistics, num_batches_tracked) within ``tol``."""
    dtype = next(eager.parameters()).dtype
    for s in range(steps):
        x = _input(s + 1, dtype)
        for m in (eager, fast):
            m.zero_grad(set_to_none=True)
        g = torch.randn(x.shape[0], 8, 12, 12, dtype=torch.bfloat16 if amp else dtype,
                        generator=torch.Generator().manual_seed(99 + s))
        (oe, gxe), (of, gxf) = _step(run_eager, x, g, amp), _step(run_fast, x, g, amp)
        assert_close(of, oe, **tol, msg=lambda m: f"step {s} output: {m}")
        assert_close(gxf, gxe, **tol, msg=lambda m: f"step {s} input gradient: {m}")
        for (n, pe), pf in zip(eager.named_parameters(), fast.parameters()):
            assert_close(pf.grad, pe.grad, **tol, msg=lambda m: f"step {s} grad {n}: {m}")
        for (n, be), bf in zip(eager.named_buffers(), fast.buffers()):
            assert_close(bf, be, **tol, msg=lambda m: f"step {s} buffer {n}: {m}")


def _activation_bytes(model: nn.Module, x: Tensor) -> int:
    """Bytes of the batch-sized storages a training forward of ``model`` keeps for backward."""
    return sum(b for _, shape, _, b in saved_bytes(model, x).shapes if len(shape) > 1 and shape[0] == x.shape[0])


def _chains_run_fused(fast: nn.Module) -> None:
    assert_fused(fast)
    assert len(fused_chains(fast)) == 2  # the body's three layers; the pre-activation head and its conv


def test_compiled_norm_chains_match_compiled_eager_in_float64_and_save_the_plans_set():
    eager, fast = _twins()
    _chains_run_fused(fast)
    ce = torch.compile(eager, backend="aot_eager", fullgraph=True)
    cf = torch.compile(fast, backend="aot_eager", fullgraph=True)
    _assert_like(eager, ce, fast, cf)
    x = _input(7)
    kept_fused, kept_compiled = _activation_bytes(fast, x), _activation_bytes(cf, x)
    # the compiled chain keeps what the fused eager chain keeps (the plan's set), not eager's
    assert kept_compiled <= kept_fused + 2 * x.shape[0] * 8 * 8, (kept_compiled, kept_fused)
    assert kept_compiled < 0.6 * _activation_bytes(ce, x), (kept_compiled, _activation_bytes(ce, x))


def test_compiled_norm_chain_recomputes_the_convolutions_its_plan_recomputes():
    eager, fast = _twins()
    body = fused_chains(fast)[0]
    body.apply_plan(ChainPlan.of_modes(["recompute_conv"] * len(body.layers)))
    cf = torch.compile(fast, backend="aot_eager", fullgraph=True)
    _assert_like(eager, eager, fast, cf, steps=1)  # aot_eager runs eager's ops: eager's values exactly
    x = _input(3)
    shapes = [shape for _, shape, _, _ in saved_bytes(cf, x).shapes if len(shape) > 1 and shape[0] == x.shape[0]]
    # the body keeps only its input (3 channels), none of its three conv outputs; the head chain
    # its input (the body's output); its conv's output is the chain's, which nothing reads
    assert sorted(shapes) == [(4, 3, 12, 12), (4, 8, 12, 12)], shapes


def test_compiled_norm_chains_forward_without_grad():
    eager, fast = _twins()
    eager.eval()
    fast.eval()
    x = _input(5)
    with torch.no_grad():
        assert_close(torch.compile(fast, backend="aot_eager", fullgraph=True)(x), eager(x), rtol=1e-12, atol=1e-12)


def test_norm_chains_under_bf16_autocast_match_eager_autocast_and_run_fused():
    eager, fast = _twins(torch.float32)
    _assert_like(eager, eager, fast, fast, amp=True, tol=dict(rtol=0, atol=0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast(_input(3, torch.float32).requires_grad_())
    assert out.dtype == torch.bfloat16
    assert type(out.grad_fn).__name__ == "AddBackward0"
    nodes = [type(n).__name__ for n, _ in out.grad_fn.next_functions]
    assert "NormChainFunctionBackward" in nodes, nodes


class _Autocast(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x)


def test_norm_chains_step_peak_under_bf16_autocast_is_below_eager_autocasts():
    eager, fast = _twins(torch.float32)
    x = _input(1, torch.float32, n=4, size=32)
    peak_e, peak_f = step_peak(_Autocast(eager), x), step_peak(_Autocast(fast), x)
    assert peak_f < 0.8 * peak_e, (peak_f, peak_e)


def test_compiled_norm_chains_under_bf16_autocast_match_compiled_eager():
    eager, fast = _twins(torch.float32)
    ce = torch.compile(eager, backend="aot_eager", fullgraph=True)
    cf = torch.compile(fast, backend="aot_eager", fullgraph=True)
    _assert_like(eager, ce, fast, cf, steps=1, amp=True, tol=dict(rtol=0, atol=0))
    x = _input(4, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept_e, kept_f = _activation_bytes(ce, x), _activation_bytes(cf, x)
    assert kept_f < 0.6 * kept_e, (kept_f, kept_e)


@pytest.fixture(scope="module")
def inductor_fast() -> Tuple[nn.Module, nn.Module, nn.Module]:
    """The one inductor compile of this module: the converted twin (float32)."""
    eager, fast = _twins(torch.float32)
    return eager, fast, torch.compile(fast, fullgraph=True)


def test_inductor_compiled_norm_chains_match_eager_and_keep_the_plans_set(inductor_fast: Tuple[nn.Module, ...]):
    eager, fast, cf = inductor_fast
    _assert_like(eager, eager, fast, cf, steps=1, tol=dict(rtol=1e-4, atol=1e-4))
    x = _input(6, torch.float32)
    kept_e, kept_fused, kept_f = _activation_bytes(eager, x), _activation_bytes(fast, x), _activation_bytes(cf, x)
    # inductor's graph keeps the plan's set (as the fused eager chain), well below eager's maps
    # (compile of the eager model keeps at least each convolution's output: BENCHMARKS.md)
    assert kept_f <= kept_fused + 2 * x.shape[0] * 8 * 4, (kept_f, kept_fused)
    assert kept_f < 0.6 * kept_e, (kept_f, kept_e)


def test_compiled_3d_instance_norm_chain_follows_new_shapes():
    """A second input shape (Dynamo recompiles with dynamic sizes): eager's values."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True), nn.LeakyReLU(0.01),
                          nn.Conv3d(4, 4, 3, padding=1), nn.InstanceNorm3d(4, track_running_stats=True),
                          nn.LeakyReLU(0.01), nn.Conv3d(4, 2, 1)).double()
    fast = convbn.convert(copy.deepcopy(eager))
    assert_fused(fast)
    cf = torch.compile(fast, backend="aot_eager", fullgraph=True)
    for shape in ((2, 1, 6, 6, 6), (3, 1, 5, 7, 6)):
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(shape)))
        for m in (eager, fast):
            m.zero_grad(set_to_none=True)
        (oe, gxe), (of, gxf) = _step(eager, x, torch.ones(shape[0], 2, *shape[2:], dtype=torch.float64)), \
            _step(cf, x, torch.ones(shape[0], 2, *shape[2:], dtype=torch.float64))
        assert_close(of, oe, rtol=1e-12, atol=1e-12)
        assert_close(gxf, gxe, rtol=1e-12, atol=1e-12)
        for pe, pf in zip(eager.parameters(), fast.parameters()):
            assert_close(pf.grad, pe.grad, rtol=1e-12, atol=1e-12)
        for be, bf in zip(eager.buffers(), fast.buffers()):
            assert_close(bf, be, rtol=1e-12, atol=1e-12)
    assert _activation_bytes(cf, x) < 0.7 * _activation_bytes(eager, x)


def test_norm_chain_with_prelu_under_bf16_autocast_recomputes_under_autocast():
    """autocast casts PReLU's weight (a lower-precision op on the CPU): the backward's recompute,
    called outside autocast, runs under the forward's autocast state (Note: [a norm chain under
    autocast]); eager autocast's values exactly."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.PReLU(8),
                          nn.Conv2d(8, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True), nn.PReLU(),
                          nn.Conv2d(8, 4, 1))
    fast = convbn.convert(copy.deepcopy(eager))
    assert_fused(fast)
    x = torch.randn(2, 3, 8, 8)
    g = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16)
    (oe, gxe), (of, gxf) = _step(eager, x, g, amp=True), _step(fast, x, g, amp=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(fast(x.requires_grad_()).grad_fn).__name__ == "NormChainFunctionBackward"
    assert_close(of, oe, rtol=0, atol=0)
    assert_close(gxf, gxe, rtol=0, atol=0)
    for (n, pe), pf in zip(eager.named_parameters(), fast.parameters()):
        assert_close(pf.grad, pe.grad, rtol=0, atol=0, msg=n)


def test_inductor_compiled_norm_chains_save_no_copy_of_a_conv_weight(inductor_fast: Tuple[nn.Module, ...]):
    """Note: [a conv inductor cannot re-layout] in ``convbn/autograd/conv_op.py``: on the CPU the
    norm chains' region calls its convolutions as ``convbn::conv``, so inductor's layout
    optimisation saves no channels_last copy of a conv weight for backward (the parameter itself
    is kept), and the compiled model keeps exactly the activations the uncompiled converted one does."""
    eager, fast, cf = inductor_fast
    x = _input(8, torch.float32)
    fast.zero_grad(set_to_none=True)
    cf(x.clone().requires_grad_()).sum().backward()  # compiles here when this test runs alone
    fast.zero_grad(set_to_none=True)
    saved, uncompiled = saved_bytes(cf, x), saved_bytes(fast, x)
    weights = {tuple(m.weight.shape) for m in fast.modules() if isinstance(m, nn.Conv2d)}
    copies = [(s, n) for (_, s, _, n), p in zip(saved.shapes, saved.is_param) if not p and s in weights]
    assert copies == [], copies
    assert saved.activation_bytes == uncompiled.activation_bytes, (saved.activation_bytes, uncompiled.activation_bytes)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cf(x).sum().backward()
    fast.zero_grad(set_to_none=True)
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("convbn::")}
    # the compiled regions ran (only they call the opaque op): the body's three convolutions and the head's
    assert ops.get("convbn::conv", 0) >= 4, ops
