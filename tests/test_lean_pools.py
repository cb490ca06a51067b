"""Lean pooling: max/average pooling that keeps its indices, not its input, for backward
(functional/pool.py, autograd/pool.py, nn/pool.py, passes/convert/pools.py)."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import convbn
from convbn.autograd.pool import LeanPoolFunction, lean_pool
from convbn.functional.pool import PoolSpec
from convbn.memory import saved_bytes, timeline
from convbn.nn.pool import lean_avg_pool2d, lean_avg_pool3d, lean_max_pool2d, lean_max_pool3d, pool_module_call

LEAN = {("max", 2): lean_max_pool2d, ("max", 3): lean_max_pool3d, ("avg", 2): lean_avg_pool2d, ("avg", 3): lean_avg_pool3d}
EAGER = {("max", 2): F.max_pool2d, ("max", 3): F.max_pool3d, ("avg", 2): F.avg_pool2d, ("avg", 3): F.avg_pool3d}


def _saved_bytes(fn, x):
    """Bytes autograd saves for ``fn(x)`` (each storage once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


def _compare(kind, dims, x, args, upstream):
    """Outputs and input gradients of the lean call and of eager's, bit for bit (and layout)."""
    a = x.detach().clone().requires_grad_()
    b = x.detach().clone().requires_grad_()
    ya, yb = LEAN[(kind, dims)](a, *args), EAGER[(kind, dims)](b, *args)
    assert torch.equal(ya, yb)
    g = torch.randn_like(yb) if upstream == "random" else None
    (ya.backward(g) if g is not None else ya.sum().backward())
    (yb.backward(g) if g is not None else yb.sum().backward())
    assert torch.equal(a.grad, b.grad)
    assert a.grad.stride() == b.grad.stride()


# (kernel, stride, padding, ceil_mode, then max: dilation / avg: count_include_pad, divisor_override)
MAX_ARGS = [(2, None, 0, False, 1), (3, 2, 1, False, 1), (3, 2, 1, True, 1), (3, 1, 1, False, 2), (2, (1, 2), 0, True, 1)]
AVG_ARGS = [(2, None, 0, False, True, None), (3, 2, 1, True, False, None), (3, 2, 1, False, True, 4), (2, 1, 1, True, True, None)]


@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("upstream", ["random", "sum"])
@pytest.mark.parametrize("args", MAX_ARGS, ids=str)
def test_max_pool_matches_eager_bit_for_bit(dims, upstream, args):
    torch.manual_seed(0)
    k, s, p, ceil, d = args
    if dims == 3 and isinstance(s, tuple):
        s = s + (1,)
    x = torch.randn((2, 3) + (9,) * dims)
    x[0, 0].fill_(1.0)  # ties: the first maximum of a window gets the gradient, as in eager
    _compare("max", dims, x, (k, s, p, d, ceil), upstream)


@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("upstream", ["random", "sum"])
@pytest.mark.parametrize("args", AVG_ARGS, ids=str)
def test_avg_pool_matches_eager_bit_for_bit(dims, upstream, args):
    torch.manual_seed(1)
    k, s, p, ceil, cip, div = args
    _compare("avg", dims, torch.randn((2, 3) + (8,) * dims), (k, s, p, ceil, cip, div), upstream)


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_channels_last_input_keeps_the_input_and_eager_gradient_layout(kind):
    x = torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last)
    _compare(kind, 2, x, (2,), "random")
    spec = PoolSpec.make(kind, 2, 2)
    want = x.numel() * 4 + (x.numel() // 4 * 4 if kind == "max" else 0)  # the input, and int32 indices
    assert _saved_bytes(lambda t: lean_pool(t, spec), x.requires_grad_()) == want


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_keeps_the_indices_not_the_input(kind):
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    spec = PoolSpec.make(kind, 2, 2)
    eager = _saved_bytes(lambda t: EAGER[(kind, 2)](t, 2), x)
    lean = _saved_bytes(lambda t: lean_pool(t, spec), x)
    outputs = x.numel() // 4
    assert eager == x.numel() * 4 + (outputs * 8 if kind == "max" else 0)  # the input and int64 indices
    # one int32 per output element (Note: [max-pool indices in half the bytes])
    assert lean == (outputs * 4 if kind == "max" else 0)


def test_unbatched_input():
    _compare("max", 2, torch.randn(3, 7, 7), (3, 2, 1), "random")
    _compare("avg", 2, torch.randn(3, 7, 7), (3, 2, 1), "random")


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("dims", [2, 3])
def test_gradcheck_and_gradgradcheck_float64(kind, dims):
    torch.manual_seed(2)
    x = torch.randn((2, 2) + (5,) * dims, dtype=torch.float64, requires_grad=True)
    spec = PoolSpec.make(kind, dims, 3, 2, 1, ceil_mode=True)
    assert torch.autograd.gradcheck(lambda t: lean_pool(t, spec), (x,))
    assert torch.autograd.gradgradcheck(lambda t: lean_pool(t, spec), (x,))


def test_double_backward_equals_eager():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    out = []
    for fn in (lean_max_pool2d, F.max_pool2d):
        (gx,) = torch.autograd.grad(fn(x, 2), x, g, create_graph=True)
        out.append(torch.autograd.grad((gx * gx.detach().cos()).sum(), g)[0])
    assert torch.equal(*out)


def test_no_grad_forward_records_nothing_and_matches():
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        y = lean_max_pool2d(x, 2)
    assert y.grad_fn is None and torch.equal(y, F.max_pool2d(x, 2))


def test_return_indices_runs_eager():
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    y, idx = lean_max_pool2d(x, 2, return_indices=True)
    y0, idx0 = F.max_pool2d(x, 2, return_indices=True)
    assert torch.equal(y, y0) and torch.equal(idx, idx0) and "LeanPool" not in type(y.grad_fn).__name__


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["max", "avg"]), k=st.integers(1, 3), s=st.integers(1, 3), ceil=st.booleans(),
       size=st.integers(3, 9), batch=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_property_lean_equals_eager(kind, k, s, ceil, size, batch, seed):
    torch.manual_seed(seed)
    p = k // 2
    _compare(kind, 2, torch.randn(batch, 2, size, size + 1), (k, s, p) + ((1, ceil) if kind == "max" else (ceil,)),
             "random")


# --------------------------------------------------------------------------- convert


class StemNet(nn.Module):
    """A ResNet-like stem: Conv -> BN -> ReLU -> pool -> Conv -> BN -> ReLU -> pool -> head."""

    def __init__(self, pool: str = "module"):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 4)
        self.kind = pool

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.pool(x) if self.kind == "module" else F.max_pool2d(x, 3, 2, 1)
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.avg_pool2d(x, 2)
        return self.fc(x.mean((2, 3)))


def _step_grads(model, x, g):
    for p in model.parameters():
        p.grad = None
    model(x).backward(g)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("pool", ["module", "functional"])
def test_convert_pools_lean_and_exact(pool):
    torch.manual_seed(4)
    model = StemNet(pool)
    x = torch.randn(4, 3, 16, 16)
    conv = convbn.convert(copy.deepcopy(model), example_inputs=x)
    names = conv.convbn_report.lean_pools
    assert names == (["pool", "avg_pool2d"] if pool == "module" else ["max_pool2d", "avg_pool2d"])
    assert "pooling keeping indices, not inputs: 2" in str(conv.convbn_report)
    g = torch.randn(4, 4)
    assert all(torch.equal(a, b) for a, b in zip(_step_grads(model, x, g), _step_grads(conv, x, g)))
    for a, b in zip(model.buffers(), conv.buffers()):
        assert torch.equal(a, b)
    assert conv.state_dict().keys() == model.state_dict().keys()


def test_saved_bytes_fall_by_exactly_the_pool_inputs():
    """The two pools' inputs (the chains' outputs) are no longer kept: 8x16x16 and 16x8x8
    floats per sample, and the max pool's indices take half the bytes. A hooked pool module is left as eager runs it (and keeps its input)."""
    torch.manual_seed(5)
    x = torch.randn(4, 3, 16, 16)
    lean = convbn.convert(StemNet(), strategy="recompute_conv", example_inputs=x)
    kept = StemNet()
    kept.pool.register_forward_hook(lambda m, i, o: None)
    kept = convbn.convert(kept, strategy="recompute_conv", example_inputs=x)
    assert kept.convbn_report.lean_pools == ["avg_pool2d"]
    pool_input = 4 * 8 * 16 * 16 * 4
    half_indices = 4 * 8 * 8 * 8 * 4  # int32, not int64 (Note: [max-pool indices in half the bytes])
    assert saved_bytes(kept, x).activation_bytes - saved_bytes(lean, x).activation_bytes == pool_input + half_indices


def test_step_peak_falls_and_the_forward_ends_lower_by_the_pool_input():
    """Exact live-tensor timelines of one step: forward ends holding exactly the max-pool's
    input less (8x8x32x32 floats) and half its indices' bytes, and the step's peak is lower (one fixed plan, so only the
    pool differs); ``auto``'s predicted peak equals its measured one with and without it."""
    torch.manual_seed(6)
    x = torch.randn(8, 3, 32, 32)
    ends, peaks = [], []
    for hooked in (False, True):
        model = StemNet()
        if hooked:
            model.pool.register_forward_pre_hook(lambda m, i: None)
        report = convbn.explain(model, x)
        conv = convbn.convert(model, strategy="recompute_conv", example_inputs=x)
        tl = timeline(conv, x)
        ends.append([p.bytes for p in tl.points if p.phase == "forward"][-1])
        peaks.append(tl.peak)
        assert report.measured_peak_bytes == report.predicted_peak_bytes
    assert ends[1] - ends[0] == 8 * 8 * 32 * 32 * 4 + 8 * 8 * 16 * 16 * 4  # and int32 indices, not int64
    assert peaks[0] < peaks[1]


def test_hooks_registered_after_convert_run_and_settings_are_read_at_call_time():
    torch.manual_seed(7)
    model = StemNet()
    x = torch.randn(2, 3, 16, 16)
    conv = convbn.convert(copy.deepcopy(model), example_inputs=x)
    seen = []
    handle = conv.pool.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert torch.equal(conv(x), model(x)) and seen == [torch.Size([2, 8, 8, 8])]
    handle.remove()
    conv.pool.kernel_size = model.pool.kernel_size = 2
    conv.pool.padding = model.pool.padding = 0
    assert torch.equal(conv(x), model(x))


def test_pool_module_call_leaves_what_it_cannot_run():
    class OwnForward(nn.MaxPool2d):
        def forward(self, x):
            return super().forward(x) * 2

    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    for m in (OwnForward(2), nn.MaxPool2d(2, return_indices=True)):
        out = pool_module_call(m, x)
        ref = m(x)
        assert all(torch.equal(a, b) for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (out, ref))))
    y = pool_module_call(nn.AvgPool2d(2), x)
    assert type(y.grad_fn).__name__ == "LeanPoolFunctionBackward"


def test_no_state_and_module_identity():
    model = StemNet()
    conv = convbn.convert(model, example_inputs=torch.randn(2, 3, 16, 16), inplace=True)
    assert conv is model  # rewritten in place: the user's own objects
    assert conv.get_submodule("pool") is model.pool


def test_lean_pool_under_torch_compile_is_the_plain_call():
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    fn = torch.compile(lambda t: lean_max_pool2d(t, 2).sum(), backend="aot_eager", fullgraph=True)
    fn(x).backward()
    ref = x.detach().clone().requires_grad_()
    F.max_pool2d(ref, 2).sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="kernel_size must be an int or 2 ints"):
        PoolSpec.make("max", 2, (1, 2, 3))
    with pytest.raises(ValueError, match="kind must be 'max' or 'avg'"):
        PoolSpec.make("min", 2, 2)
    with pytest.raises(ValueError, match="dims must be 2 or 3"):
        PoolSpec.make("max", 1, 2)


def test_function_saves_no_input_for_a_contiguous_one():
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    y = LeanPoolFunction.apply(x, PoolSpec.make("avg", 2, 2))
    assert y.grad_fn.saved_tensors == ()


def test_int32_indices_kept_for_a_retained_graph_and_let_go_otherwise():
    """Note: [max-pool indices in half the bytes]: a second backward through a retained graph
    reads the int32 indices again (eager's gradient both times); without ``retain_graph`` their
    storage is let go in the backward."""
    torch.manual_seed(9)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    spec = PoolSpec.make("max", 2, 2)
    g = torch.randn(2, 3, 4, 4)
    want = torch.autograd.grad(F.max_pool2d(x, 2), x, g)[0]
    y = lean_pool(x, spec)
    assert y.grad_fn.saved_tensors[-1].dtype == torch.int32
    for _ in range(2):
        assert torch.equal(torch.autograd.grad(y, x, g, retain_graph=True)[0], want)
    held = y.grad_fn.saved_tensors[-1]  # the same storage as the saved slot's
    assert held.untyped_storage().nbytes() == held.numel() * 4
    assert torch.equal(torch.autograd.grad(y, x, g)[0], want)
    assert held.untyped_storage().nbytes() == 0
