"""A LayerNorm over the channels of a channels-last map (``(N, H, W, C)``, or ``(B, T, C)``) read by
a Linear fuses with it: ``LN -> [act] -> Linear`` is a per-sample norm chain's pre-activation head
and a 1x1 convolution (Note: [a channels-last LayerNorm before a Linear] in
``passes/convert/norm_linears.py``; Note: [a Linear on a channels-last map is a 1x1 convolution]
in ``functional/conv.py``). Compared with eager PyTorch in float64 (outputs, every gradient,
two steps), the fused Function asserted to run, its float64 gradcheck / gradgradcheck, the
report's lines for the LayerNorms that stay, and the standard step's exact CPU peak."""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import convbn
from capture_helpers import assert_steps_match, perturbed_twins
from fusion_checks import assert_chain_ran, fused_chains
from norm_chain_checks import assert_chain_function_checks
from convbn.autograd.norm_chain import NormLayerSpec
from convbn.functional.activations import Activation
from convbn.functional.conv import channel_linear, conv_backward, conv_forward, make_channel_linear_spec
from convbn.functional.norms import NormCall, channel_layer_norm
from convbn.memory import saved_bytes, timeline
from convbn.nn.norm_chain import FusedNormChain
from convbn.passes.convert.norm_linears import norm_linears

ACTS: dict = {"none": nn.Identity, "gelu": nn.GELU, "silu": nn.SiLU}


class NHWCBlock(nn.Module):
    """A conv stem, then a residual MLP over a channels-last map (MambaOut / MaxViT's ``norm2 ->
    mlp``): ``x + fc2(fc(act(norm(x))))``; ``rank`` 4 (``(N, H, W, C)``) or 3 (``(N, L, C)``)."""

    def __init__(self, c: int = 6, act: str = "gelu", affine: bool = True, bias: bool = True, rank: int = 4) -> None:
        super().__init__()
        self.rank = rank
        self.conv = (nn.Conv2d if rank == 4 else nn.Conv1d)(3, c, 3, padding=1)
        self.norm, self.act = nn.LayerNorm(c, elementwise_affine=affine), ACTS[act]()
        self.fc, self.fc2 = nn.Linear(c, 2 * c, bias=bias), nn.Linear(2 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = x.permute(0, 2, 3, 1) if self.rank == 4 else x.transpose(1, 2)
        x = x + self.fc2(self.fc(self.act(self.norm(x))))
        return x.permute(0, 3, 1, 2) if self.rank == 4 else x.transpose(1, 2)


class FunctionalBlock(NHWCBlock):
    """The same block spelled ``F.layer_norm`` / ``F.silu`` / ``F.linear`` on the modules' tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).permute(0, 2, 3, 1)
        h = F.layer_norm(x, (6,), self.norm.weight, self.norm.bias, 1e-5)
        x = x + self.fc2(F.linear(F.silu(h), self.fc.weight, self.fc.bias))
        return x.permute(0, 3, 1, 2)


def _input(rank: int) -> torch.Tensor:
    return torch.randn((2, 3, 5, 4) if rank == 4 else (2, 3, 7), dtype=torch.float64)


def _assert_norm_fused(fast: nn.Module) -> None:
    # a LayerNorm without affine tensors is named by its call (no module owns a tensor of it)
    norm = "norm" if fast.norm.weight is not None else "channel_layer_norm() call 'channel_layer_norm' in <root>"
    assert [(o.batchnorm, o.result, o.layer) for o in fast.convbn_report.outcomes] == [(norm, "fused", "fc")]
    chains = fused_chains(fast)
    assert len(chains) == 1 and isinstance(chains[0], FusedNormChain)
    assert chains[0].layers[1].conv.channel_linear  # the Linear as a 1x1 convolution


@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_layer_norm_then_linear_fuses_and_trains_as_eager(act: str, affine: bool, bias: bool, rank: int) -> None:
    eager, work = perturbed_twins(lambda: NHWCBlock(act=act, affine=affine, bias=bias, rank=rank))
    fast = convbn.convert(work, strategy="recompute_conv")
    x = _input(rank)
    assert_steps_match(eager, fast, x, steps=2, tol=dict(rtol=0, atol=0))  # twice: the guards pass
    _assert_norm_fused(fast)


def test_the_functional_spelling_fuses_with_example_inputs() -> None:
    eager, work = perturbed_twins(FunctionalBlock)
    x = _input(4)
    fast = convbn.convert(work, example_inputs=x)  # the auto planner, the whole-step check
    assert [(o.result, o.layer) for o in fast.convbn_report.outcomes] == [("fused", "fc")]
    assert_steps_match(eager, fast, x, steps=2, tol=dict(rtol=0, atol=0))


def test_an_rms_norm_on_the_last_dim_fuses_too() -> None:
    """``nn.RMSNorm`` (the norm table's other last-dim spelling) before a Linear: the same chain;
    its composite backward rounds in another order through the permutes (float64, 1e-10)."""
    def make() -> nn.Module:
        m = NHWCBlock()
        m.norm = nn.RMSNorm(6)
        return m

    eager, work = perturbed_twins(make)
    fast = convbn.convert(work, strategy="recompute_conv")
    assert_steps_match(eager, fast, _input(4), steps=2)
    _assert_norm_fused(fast)


def test_the_rewrite_computes_the_same_values_in_the_same_strides() -> None:
    model = NHWCBlock().double()
    gm = fx.symbolic_trace(model)
    assert norm_linears(gm, model, "") == 1
    targets = [n.target for n in gm.graph.nodes]
    assert channel_layer_norm in targets and channel_linear in targets and "norm" not in targets
    assert "fc" not in targets and "fc2" in targets  # the second Linear reads the map channels-last
    x = _input(4)
    out, ref = gm(x), model(x)
    assert torch.equal(out, ref) and out.stride() == ref.stride()


@pytest.mark.parametrize("bias", [True, False])
def test_channel_linear_is_the_linear_layer_bit_for_bit(bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, 3, requires_grad=True)
    w, b = torch.randn(6, 3, requires_grad=True), torch.randn(6, requires_grad=True) if bias else None
    y = F.linear(x, w, b)
    g = torch.randn_like(y)
    want = torch.autograd.grad(y, [x, w] + ([b] if bias else []), g)
    spec = make_channel_linear_spec(2)
    xp = x.detach().permute(0, 3, 1, 2)
    assert torch.equal(conv_forward(xp, w.detach(), None if b is None else b.detach(), spec).permute(0, 2, 3, 1), y)
    gx, gw, gb = conv_backward(g.permute(0, 3, 1, 2), xp, w.detach(), spec, (True, True, bias), weight_first=True)
    assert torch.equal(gx.permute(0, 2, 3, 1), want[0]) and torch.equal(gw, want[1])
    assert not bias or torch.equal(gb, want[2])


@pytest.mark.parametrize("act", ["gelu", "identity"])
def test_the_chain_function_gradchecks_with_a_linear_on_the_channels(act: str) -> None:
    torch.manual_seed(0)
    c = 3
    x = torch.randn(2, 4, 3, c, dtype=torch.float64).permute(0, 3, 1, 2).requires_grad_()
    g, beta = torch.randn(c, dtype=torch.float64, requires_grad=True), torch.randn(c, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(5, c, dtype=torch.float64, requires_grad=True), torch.randn(5, dtype=torch.float64, requires_grad=True)
    specs = [NormLayerSpec(None, NormCall("channel_layer_norm", 1e-5, normalized=(c,)), Activation(act)),
             NormLayerSpec(make_channel_linear_spec(2), None, Activation("identity"))]
    assert_chain_function_checks(x, [g, beta, w, b], specs)


class TwoReaders(nn.Module):
    """Channels-last LayerNorms that stay: one read twice, one read by a reshape that merges the
    channels with the width, one whose Linear has a hook, one with a hook of its own, one before no
    Linear."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, c, 1)
        self.n1, self.n2, self.n3, self.n4, self.n5 = (nn.LayerNorm(c) for _ in range(5))
        self.f1, self.f2, self.f3, self.f5 = nn.Linear(c, c), nn.Linear(4 * c, 4 * c), nn.Linear(c, c), nn.Linear(c, c)
        self.calls = {"f3": 0, "n5": 0}
        self.f3.register_forward_hook(lambda m, i, o: self.calls.__setitem__("f3", self.calls["f3"] + 1))
        self.n5.register_forward_hook(lambda m, i, o: self.calls.__setitem__("n5", self.calls["n5"] + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).permute(0, 2, 3, 1)
        h = self.n1(x)
        x = x + self.f1(h) + h
        x = x + self.f2(self.n2(x).reshape(x.shape[0], x.shape[1], -1)).reshape(x.shape)  # rows of W * C
        x = x + self.f3(self.n3(x))
        x = x + self.f5(self.n5(x))
        return (self.n4(x) * 2).permute(0, 3, 1, 2)


@pytest.mark.expect_unfused("every LayerNorm here stays, each reported with why")
@pytest.mark.parametrize("chain", [True, False])
def test_channels_last_layer_norms_that_stay_are_reported(chain: bool) -> None:
    model = TwoReaders().double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    ref = model(x)
    fast = convbn.convert(copy.deepcopy(model), chain=chain)
    why = {o.batchnorm: o.reason for o in fast.convbn_report.outcomes}
    assert sorted(why) == ["n1", "n2", "n3", "n4", "n5"] and {o.result for o in fast.convbn_report.outcomes} == {"left"}
    assert "hook" in why["n5"]
    if chain:
        assert "read by module 'f1', function add" in why["n1"]
        assert "method .reshape()" in why["n2"]
        assert "hook" in why["n3"]
        assert "function mul reads it, not a Linear" in why["n4"]
    else:
        assert all("chain=True" in w or "not a Linear" in w or "read by" in w or "hook" in w for w in why.values())
    model.calls.update(f3=0, n5=0)
    assert torch.equal(fast(x), ref) and model.calls == {"f3": 1, "n5": 1}  # the hooks ran, once each


class Downsample(nn.Module):
    """MambaOut's stage entry: a channels-last map's LayerNorm, moved channels-first for a strided
    convolution (``norm(x).permute(0, 3, 1, 2) -> conv``), and back."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem, self.norm, self.conv = nn.Conv2d(3, c, 1), nn.LayerNorm(c), nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).permute(0, 2, 3, 1)
        return self.conv(self.norm(x + 1).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


def test_a_layer_norm_moved_channels_first_for_a_conv_is_its_chain_head() -> None:
    eager, work = perturbed_twins(Downsample)
    fast = convbn.convert(work, strategy="recompute_conv")
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    assert_steps_match(eager, fast, x, steps=2, tol=dict(rtol=0, atol=0))
    assert [(o.batchnorm, o.result, o.layer) for o in fast.convbn_report.outcomes] == [("norm", "fused", "conv")]


def _peak(model: nn.Module, x: torch.Tensor) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.square().mean()  # noqa: E731
    timeline(model, x, loss_fn=loss, optimizer=opt)  # gradients exist from the first step on
    return timeline(model, x, loss_fn=loss, optimizer=opt).peak


@pytest.mark.parametrize("act", ["gelu", "none"])
@pytest.mark.parametrize("strategy", ["auto", "recompute_conv"])
def test_the_step_peaks_lower_than_eager_by_the_maps_it_does_not_keep(strategy: str, act: str) -> None:
    """Eager keeps the LayerNorm's output (the activation's input) and the activation's output (the
    Linear's input); the chain keeps neither: the step peaks lower by those maps (exact CPU bytes)."""
    torch.manual_seed(0)
    eager = NHWCBlock(c=16, act=act).double()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy=strategy, example_inputs=x if strategy == "auto" else None)
    fast(x)  # a lazy plan resolves on the first call
    _assert_norm_fused(fast)
    one_map = 4 * 16 * 16 * 16 * 8
    maps = 2 if act != "none" else 1
    assert _peak(fast, x) <= _peak(eager, x) - maps * one_map


def test_double_backward_matches_eager() -> None:
    eager, work = perturbed_twins(NHWCBlock)
    fast = convbn.convert(work, strategy="recompute_conv")
    x = _input(4)
    outs = []
    for m in (eager, fast):
        xi = x.clone().requires_grad_()
        gx, = torch.autograd.grad(m(xi).square().sum(), xi, create_graph=True)
        gx.square().sum().backward()
        outs.append([gx.detach(), *(p.grad for p in m.parameters())])
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_state_dict_and_parameters_stay_the_models() -> None:
    model = NHWCBlock().double()
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    fast = convbn.convert(model, strategy="recompute_conv")
    assert list(fast.state_dict()) == keys and [id(p) for p in fast.parameters()] == params
    assert type(fast.fc) is nn.Linear and type(fast.norm) is nn.LayerNorm


def test_a_parametrized_linear_fuses_and_trains_as_eager() -> None:
    """A Linear whose weight is a parametrization (``torch.nn.utils.parametrize``) is read through it
    at every call: gradients reach the original weight as eager's."""
    class Twice(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    def make() -> nn.Module:
        m = NHWCBlock()
        parametrize.register_parametrization(m.fc, "weight", Twice())
        return m

    eager, work = perturbed_twins(make)
    fast = convbn.convert(work, strategy="recompute_conv")
    assert_steps_match(eager, fast, _input(4), steps=2, tol=dict(rtol=0, atol=0))
    _assert_norm_fused(fast)
    assert list(fast.state_dict()) == list(eager.state_dict())


def test_bf16_autocast_runs_the_chain_close_to_eager() -> None:
    torch.manual_seed(0)
    eager = NHWCBlock(c=8)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv")
    x = torch.randn(2, 3, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, out = eager(x), fast(x)
    assert_chain_ran(out)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_torch_compile_fullgraph_keeps_what_the_chain_keeps() -> None:
    """Under ``torch.compile`` the chain is its eager ops in a selective checkpoint (Note: [a norm
    chain under torch.compile]): ``aot_eager`` runs eager's ops, so eager's values; and what the
    compiled step keeps for backward is the chain's (no LayerNorm or activation output)."""
    eager, work = perturbed_twins(lambda: NHWCBlock(c=8))
    fast = convbn.convert(work, strategy="recompute_conv")
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    assert_steps_match(eager, fast, x, steps=1)
    ce = torch.compile(eager, backend="aot_eager", fullgraph=True)
    cf = torch.compile(fast, backend="aot_eager", fullgraph=True)
    assert_steps_match(ce, cf, x, steps=2, fused=False)
    assert torch.equal(cf(x), eager(x))

    def maps(model: nn.Module) -> int:  # saved tensors of the block's 8- and 16-channel maps
        return sum(b for _, shape, _, b in saved_bytes(model, x).shapes if len(shape) == 4 and shape[1:3] == (6, 6))

    one_map = 2 * 6 * 6 * 8 * 8
    assert maps(cf) <= maps(ce) - 2 * one_map, (maps(cf), maps(ce))


class WindowBlock(nn.Module):
    """MaxViT / GCViT's attention entry: ``norm1`` over a channels-last map, partitioned into
    windows (``B, H, W, C = x.shape; view -> permute -> contiguous -> view``), then the
    attention's ``qkv`` Linear, whose output is put back."""

    def __init__(self, c: int = 4, ws: int = 2) -> None:
        super().__init__()
        self.stem, self.norm1, self.qkv, self.ws = nn.Conv2d(3, c, 1), nn.LayerNorm(c), nn.Linear(c, 3 * c), ws

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).permute(0, 2, 3, 1)
        h = self.norm1(x)
        B, H, W, C = h.shape
        ws = self.ws
        win = h.view(B, H // ws, ws, W // ws, ws, C).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, C)
        q = self.qkv(win)
        back = q.view(B, H // ws, W // ws, ws, ws, -1).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, -1)
        return x.repeat(1, 1, 1, 3) + back


def test_a_norm_before_a_window_partition_fuses_with_the_attention_linear() -> None:
    eager, work = perturbed_twins(WindowBlock)
    fast = convbn.convert(work, strategy="recompute_conv")
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    assert_steps_match(eager, fast, x, steps=2)  # the norm's affine gradients sum in the windows' order
    assert [(o.batchnorm, o.result, o.layer) for o in fast.convbn_report.outcomes] == [("norm1", "fused", "qkv")]


def test_the_window_block_step_peaks_lower_by_the_map_it_does_not_keep() -> None:
    """Eager keeps the norm's input and the windows of its output (the Linear's input); the chain
    the windows of its input and the statistics: one map less at the step's peak."""
    torch.manual_seed(0)
    eager = WindowBlock(c=16, ws=4).double()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv")
    fast(x)
    assert _peak(fast, x) <= _peak(eager, x) - 4 * 16 * 16 * 16 * 8


class FunctionalWindowBlock(WindowBlock):
    """The same, the norm spelled ``F.layer_norm(x, shape, weight=..., bias=..., eps=...)`` (timm's
    ``LayerNorm`` forward, keywords and all)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).permute(0, 2, 3, 1) + 1  # a residual stream, not a LayerNorm2d after the stem
        h = F.layer_norm(x, (4,), weight=self.norm1.weight, bias=self.norm1.bias, eps=1e-6)
        B, H, W, C = h.shape
        win = h.view(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 2, 2, C)
        return self.qkv(win)


class ChannelsMoved(WindowBlock):
    """A permute that moves the channels away from last before the Linear (``(B, H, C, W)``, W == C):
    the Linear mixes positions, not channels; nothing may move past it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).permute(0, 2, 3, 1) + 1
        return self.qkv(self.norm1(x).permute(0, 1, 3, 2).contiguous())


def test_a_functional_norm_with_keywords_before_a_window_partition_fuses() -> None:
    eager, work = perturbed_twins(FunctionalWindowBlock)
    fast = convbn.convert(work, strategy="recompute_conv")
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    assert_steps_match(eager, fast, x, steps=2)
    assert [(o.result, o.layer) for o in fast.convbn_report.outcomes] == [("fused", "qkv")]


@pytest.mark.expect_unfused("the permute moves the channels: the norm stays before it")
def test_a_permute_that_moves_the_channels_keeps_the_norm_where_it_is() -> None:
    eager, work = perturbed_twins(ChannelsMoved)
    fast = convbn.convert(work, strategy="recompute_conv")
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    assert [o.result for o in fast.convbn_report.outcomes] == ["left"]
    assert_steps_match(eager, fast, x, steps=1, fused=False, tol=dict(rtol=0, atol=0))


class _HeadLinear(nn.Module):
    """A channels-last LayerNorm -> act -> Linear, the chain alone (its input made by a product)."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.norm, self.act, self.fc = nn.LayerNorm(8), ACTS[act](), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.norm(x.permute(0, 2, 3, 1) * 2)))


@pytest.mark.parametrize("act", sorted(ACTS))
def test_the_planner_replays_the_chain_backward_to_the_byte(act: str) -> None:
    """The planner's memory model (``autograd/norm_chain_memory.py``) of the head + Linear chain's
    backward against the step's exact CPU timeline: the same peak, to the byte."""
    from convbn.autograd.refcounts import frees_incoming_gradients
    from convbn.passes.plan.peak_model import chain_backward_peak
    from test_norm_memory_model import _cost

    torch.manual_seed(0)
    fused = convbn.convert(_HeadLinear(act), strategy="recompute_conv")
    x, proj = torch.randn(8, 8, 16, 16, requires_grad=True), torch.randn(8, 16, 16, 16)
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda out: (out * proj).sum()  # noqa: E731
    loss(fused(x)).backward()
    for p in fused.parameters():
        p.grad = None
    chain, = [m for _, m in convbn.fused_modules(fused) if isinstance(m, FusedNormChain)]
    assert chain.layers[1].conv.channel_linear
    cost, keep = _cost(chain)
    tl = timeline(fused, x, loss_fn=loss)
    idx = [i for i, p in enumerate(tl.points) if p.op.startswith("NormChainFunctionBackward/")]
    assert idx, "the fused chain's backward did not run"
    before = tl.points[idx[0] - 1].bytes - cost.y_bytes[-1]  # what was alive besides the incoming gradient
    held = 0 if frees_incoming_gradients() else cost.y_bytes[-1]
    assert chain_backward_peak(cost, keep)[0] + held == max(tl.points[i].bytes for i in idx) - before
