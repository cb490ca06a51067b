"""Transposed convolutions and ``nn.Linear`` as the convolution of a fused layer or chain.

Every check trains a fused copy and the eager model side by side for several steps
(random upstream gradients, then ``.sum()``), applies the same SGD update to both, and
compares outputs, the input gradient, every parameter gradient, the running statistics
and ``num_batches_tracked`` (float64 at 1e-10; float32 tolerance on real models).
"""
from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.autograd import gradcheck, gradgradcheck

import convbn
from convbn.autograd.layer_functions import FrozenFunction, RecomputeBNFunction, RecomputeConvFunction
from convbn.functional.activations import Activation, activation_from_module
from convbn.functional.batchnorm import BNSpec
from convbn.functional.conv import conv_flops, conv_output_shape, conv_spec_from_module
from convbn.functional.norms import row_of_module
from convbn.memory import saved_bytes
from convbn.nn.chain import ChainLayer, FusedChain
from convbn.nn.fused_conv_bn import FusedConvBN1d, FusedConvBN2d, FusedConvBN3d

from adversarial_models import TransposedOutputSizeThenBN  # shared with test_convert

TOL64 = dict(rtol=1e-10, atol=1e-10)
#: float32 on real models: absolute tolerance relative to each tensor's largest magnitude
TOL32 = dict(rtol=5e-4, atol_scale=5e-4)
CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
FUSED = {1: FusedConvBN1d, 2: FusedConvBN2d, 3: FusedConvBN3d}
SPATIAL = {1: (5,), 2: (4, 3), 3: (3, 2, 3)}
LAYER_STRATEGIES = ("recompute_conv", "recompute_bn", "frozen")


# --------------------------------------------------------------------------- helpers


def randomise(model: nn.Module, seed: int = 3) -> nn.Module:
    """Non-default BatchNorm parameters and running statistics (so every term matters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.affine:
                    m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                    m.bias.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
                if m.track_running_stats:
                    m.running_mean.copy_(torch.rand(m.num_features, generator=g) * 0.6 - 0.3)
                    m.running_var.copy_(torch.rand(m.num_features, generator=g) * 1.5 + 0.5)
    return model


def assert_close(actual: Tensor, expected: Tensor, tol: dict, what: str, floor: float = 0.0) -> None:
    """``floor``: a magnitude below which differences are rounding (e.g. the gradient of a conv
    bias before a training-mode BatchNorm, zero up to rounding of the model's gradients)."""
    atol = tol["atol"] if "atol" in tol else tol["atol_scale"] * max(float(expected.abs().max()), floor)
    torch.testing.assert_close(actual, expected, rtol=tol["rtol"], atol=atol, msg=lambda m: f"{what}: {m}")


def _param_pairs(eager: nn.Module, fused: nn.Module) -> List[Tuple[str, Tensor, Tensor]]:
    pe = dict(eager.named_parameters())
    pf = dict(fused.named_parameters())
    assert list(pe) == list(pf)
    return [(n, pf[n], pe[n]) for n in pe]


def train_side_by_side(eager: nn.Module, fused: nn.Module, run: Callable[[nn.Module, Tensor], Tensor],
                       make_x: Callable[[torch.Generator], Tensor], steps: int = 3,
                       tol: Optional[dict] = None, lr: float = 0.1) -> None:
    """``steps`` steps with random upstream gradients, then one with ``.sum()``; compare everything.

    ``run(model, x)`` is the forward (``fused`` may differ from ``eager`` in how it runs; its
    parameters and buffers are named as ``eager``'s).
    """
    tol = tol or TOL64
    gen = torch.Generator().manual_seed(0)
    for step in range(steps + 1):
        x = make_x(gen)
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(100 + step)  # dropout in the model: the same random stream for both
        out_e = run(eager, xe)
        torch.manual_seed(100 + step)
        out_f = run(fused, xf)
        assert_close(out_f, out_e, tol, f"step {step} output")
        if step < steps:
            grad = torch.randn(out_e.shape, generator=gen, dtype=out_e.dtype)
            out_e.backward(grad)
            out_f.backward(grad)
        else:
            out_e.sum().backward()
            out_f.sum().backward()
        assert_close(xf.grad, xe.grad, tol, f"step {step} input grad")
        floor = 1e-2 * max(float(p.grad.abs().max()) for p in eager.parameters() if p.grad is not None)
        for name, pf, pe in _param_pairs(eager, fused):
            assert (pf.grad is None) == (pe.grad is None), f"{name}.grad presence"
            if pe.grad is not None:
                assert_close(pf.grad, pe.grad, tol, f"step {step} {name}.grad", floor)
        be, bf = dict(eager.named_buffers()), dict(fused.named_buffers())
        assert list(be) == list(bf)
        for name in be:
            if name.endswith("num_batches_tracked"):
                assert int(bf[name]) == int(be[name]), f"step {step} {name}"
            else:
                assert_close(bf[name], be[name], tol, f"step {step} {name}")
        with torch.no_grad():
            for _, pf, pe in _param_pairs(eager, fused):
                if pe.grad is not None:
                    pf -= lr * pf.grad
                    pe -= lr * pe.grad
                pf.grad = pe.grad = None


class Chained(nn.Module):
    """``body``'s modules run as one :class:`FusedChain` (each conv/linear, its BN, its activation).

    ``body`` stays registered under the same name as in the eager twin, so parameters and
    buffers are named alike; the chain only references them.
    """

    def __init__(self, body: nn.Sequential, modes: Sequence[str]) -> None:
        super().__init__()
        self.body = body
        mods = list(body)
        layers, watched = [], []
        i = 0
        while i < len(mods):
            conv, bn = mods[i], mods[i + 1]
            act_mod = mods[i + 2] if i + 2 < len(mods) and not isinstance(
                mods[i + 2], (nn.modules.conv._ConvNd, nn.Linear)) else None
            act = activation_from_module(act_mod) if act_mod is not None else Activation("identity")
            layers.append(ChainLayer(conv, "weight", "bias" if conv.bias is not None else None,
                                     conv_spec_from_module(conv), bn, act, modes[len(layers)]))
            watched.append([m for m in (conv, bn, act_mod) if m is not None])
            i += 3 if act_mod is not None else 2
        self.chain = FusedChain(layers)
        self.chain.watch(watched)

    def forward(self, x: Tensor) -> Tensor:
        return self.chain(x)


def _call(m: nn.Module, x: Tensor) -> Tensor:
    return m(x)


def convt_layer(dims: int, cin: int, cout: int, k: int, stride: int, padding: int, output_padding: int,
                groups: int, dilation: int, bias: bool = True) -> nn.Module:
    return CONVT[dims](cin, cout, k, stride=stride, padding=padding, output_padding=output_padding,
                       groups=groups, bias=bias, dilation=dilation)


def _x(shape: Tuple[int, ...]) -> Callable[[torch.Generator], Tensor]:
    return lambda gen: torch.randn(*shape, generator=gen, dtype=torch.float64)


# --------------------------------------------------------------------------- geometry


GEOMETRY = [
    (dims, stride, op, groups, dilation)
    for dims, stride, groups, dilation in itertools.product((1, 2, 3), (1, 2, 3), (1, 2), (1, 2))
    for op in sorted({0, max(stride, dilation) - 1})
]


def _geo_id(g: Tuple[int, ...]) -> str:
    return "d{}-s{}-op{}-g{}-dil{}".format(*g)


@pytest.mark.parametrize("geo", GEOMETRY, ids=_geo_id)
def test_output_shape_and_flops_match_torch(geo: Tuple[int, int, int, int, int]) -> None:
    dims, stride, op, groups, dilation = geo
    conv = convt_layer(dims, 4, 6, 3, stride, 1, op, groups, dilation).double()
    x = torch.randn(2, 4, *SPATIAL[dims], dtype=torch.float64)
    spec = conv_spec_from_module(conv)
    y = conv(x)
    assert conv_output_shape(x.shape, conv.weight.shape, spec) == tuple(y.shape)
    # MACs: each input element meets C_out/groups * prod(k) weights
    assert conv_flops(y.shape, conv.weight.shape, spec, x.shape) == x.numel() * (6 // groups) * 3 ** dims


# --------------------------------------------------------------------------- single layers


@pytest.mark.parametrize("strategy", LAYER_STRATEGIES)
@pytest.mark.parametrize("geo", GEOMETRY, ids=_geo_id)
def test_single_transposed_layer_matches_eager(geo: Tuple[int, int, int, int, int], strategy: str) -> None:
    dims, stride, op, groups, dilation = geo
    torch.manual_seed(0)
    eager = randomise(nn.Sequential(convt_layer(dims, 4, 6, 3, stride, 1, op, groups, dilation),
                                    BN[dims](6), nn.ReLU()).double())
    if strategy == "frozen":
        eager[1].eval()  # what the frozen strategy computes: BN with running statistics
    body = copy.deepcopy(eager)

    class Single(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = body
            object.__setattr__(self, "fused", FUSED[dims].from_modules(body[0], body[1], "relu", strategy))

        def forward(self, x: Tensor) -> Tensor:
            return self.fused(x)

    fused = Single()
    eager_wrapped = nn.Module()
    eager_wrapped.body = eager  # same parameter names as ``fused``
    train_side_by_side(eager_wrapped, fused, lambda m, x: m.body(x) if m is eager_wrapped else m(x),
                       _x((3, 4, *SPATIAL[dims])))


# --------------------------------------------------------------------------- chains


CHAIN_MODES = [("recompute_bn",) * 2, ("recompute_conv",) * 2, ("recompute_conv", "recompute_bn"),
               ("recompute_bn", "recompute_conv")]


def conv_then_convt(dims: int, stride: int, op: int, groups: int, dilation: int, act: Callable[[], nn.Module]) -> nn.Sequential:
    """conv -> BN -> act -> convT -> BN -> act (a decoder's up-sampling step after a conv)."""
    return nn.Sequential(
        CONV[dims](2, 4, 3, padding=1), BN[dims](4), act(),
        convt_layer(dims, 4, 6, 3, stride, 1, op, groups, dilation, bias=False), BN[dims](6), act(),
    )


@pytest.mark.parametrize("modes", CHAIN_MODES, ids="-".join)
@pytest.mark.parametrize("geo", GEOMETRY, ids=_geo_id)
def test_chain_conv_then_transposed_matches_eager(geo: Tuple[int, int, int, int, int], modes: Tuple[str, ...]) -> None:
    dims, stride, op, groups, dilation = geo
    torch.manual_seed(1)
    eager = randomise(conv_then_convt(dims, stride, op, groups, dilation, nn.ReLU).double())
    fused = Chained(copy.deepcopy(eager), modes)
    wrapped = nn.Module()
    wrapped.body = eager
    train_side_by_side(wrapped, fused, lambda m, x: m.body(x) if m is wrapped else m(x), _x((3, 2, *SPATIAL[dims])))


@pytest.mark.parametrize("act", [nn.ReLU, nn.SiLU, nn.Identity, lambda: nn.LeakyReLU(0.2)], ids=["relu", "silu", "id", "leaky"])
@pytest.mark.parametrize("modes", CHAIN_MODES + [("recompute_conv",) * 3, ("recompute_bn", "recompute_conv", "recompute_bn")],
                         ids="-".join)
def test_decoder_step_chain(modes: Tuple[str, ...], act: Callable[[], nn.Module]) -> None:
    """A U-Net-like decoder step: convT (x2) -> BN -> act -> conv -> BN -> act (-> conv -> BN)."""
    torch.manual_seed(2)
    mods: List[nn.Module] = [nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1), nn.BatchNorm2d(4), act(),
                             nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4, momentum=None), act()]
    if len(modes) == 3:
        mods += [nn.ConvTranspose2d(4, 2, 2, stride=2, groups=2), nn.BatchNorm2d(2)]
    eager = randomise(nn.Sequential(*mods).double())
    fused = Chained(copy.deepcopy(eager), modes)
    wrapped = nn.Module()
    wrapped.body = eager
    train_side_by_side(wrapped, fused, lambda m, x: m.body(x) if m is wrapped else m(x), _x((2, 6, 3, 4)))


def test_transposed_chain_in_eval_and_no_grad() -> None:
    torch.manual_seed(3)
    eager = randomise(conv_then_convt(2, 2, 1, 2, 1, nn.ReLU).double())
    fused = Chained(copy.deepcopy(eager), ("recompute_conv", "recompute_bn"))
    x = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), eager(x), **TOL64)  # training mode: stats move alike
    eager.eval()
    fused.eval()
    torch.testing.assert_close(fused(x), eager(x), **TOL64)
    for (n, b), be in zip(fused.body.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, be, **TOL64, msg=n)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dims=st.integers(1, 3),
    k=st.integers(1, 3),
    stride=st.integers(1, 3),
    dilation=st.integers(1, 2),
    padding=st.integers(0, 2),
    op_frac=st.integers(0, 2),
    groups=st.sampled_from([1, 2]),
    bias=st.booleans(),
    modes=st.tuples(st.sampled_from(["recompute_bn", "recompute_conv"]), st.sampled_from(["recompute_bn", "recompute_conv"])),
    act=st.sampled_from(["relu", "silu", "gelu", "identity"]),
)
def test_transposed_geometry_property(dims: int, k: int, stride: int, dilation: int, padding: int, op_frac: int,
                                      groups: int, bias: bool, modes: Tuple[str, str], act: str) -> None:
    """Any valid transposed geometry, as the second layer of a two-layer chain, equals eager."""
    op = min(op_frac, max(stride, dilation) - 1)
    spatial = (3,) * dims
    out = [(s - 1) * stride - 2 * padding + dilation * (k - 1) + op + 1 for s in spatial]
    if any(o <= 0 for o in out):
        return  # eager refuses this geometry too
    act_mod = {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU, "identity": nn.Identity}[act]
    torch.manual_seed(4)
    eager = randomise(nn.Sequential(
        CONV[dims](2, 4, 1), BN[dims](4), act_mod(),
        CONVT[dims](4, 4, k, stride, padding, op, groups, bias, dilation), BN[dims](4), act_mod(),
    ).double())
    fused = Chained(copy.deepcopy(eager), modes)
    wrapped = nn.Module()
    wrapped.body = eager
    train_side_by_side(wrapped, fused, lambda m, x: m.body(x) if m is wrapped else m(x), _x((2, 2, *spatial)), steps=2)


# --------------------------------------------------------------------------- Linear -> BatchNorm1d


def mlp_head(act: Callable[[], nn.Module]) -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), act(),
                         nn.Linear(8, 6, bias=False), nn.BatchNorm1d(6, momentum=None), act(),
                         nn.Linear(6, 3), nn.BatchNorm1d(3, affine=False))


@pytest.mark.parametrize("act", [nn.ReLU, nn.GELU, nn.Tanh, lambda: nn.ELU(0.5)], ids=["relu", "gelu", "tanh", "elu"])
@pytest.mark.parametrize("modes", [("recompute_bn",) * 3, ("recompute_conv",) * 3,
                                   ("recompute_conv", "recompute_bn", "recompute_conv")], ids="-".join)
def test_linear_bn1d_chain_matches_eager(modes: Tuple[str, ...], act: Callable[[], nn.Module]) -> None:
    torch.manual_seed(5)
    eager = randomise(mlp_head(act).double())
    fused = Chained(copy.deepcopy(eager), modes)
    wrapped = nn.Module()
    wrapped.body = eager
    train_side_by_side(wrapped, fused, lambda m, x: m.body(x) if m is wrapped else m(x), _x((7, 5)))


@pytest.mark.parametrize("strategy", LAYER_STRATEGIES)
@pytest.mark.parametrize("bias", [True, False])
def test_single_linear_layer_matches_eager(strategy: str, bias: bool) -> None:
    torch.manual_seed(6)
    eager = randomise(nn.Sequential(nn.Linear(5, 4, bias=bias), nn.BatchNorm1d(4), nn.SiLU()).double())
    if strategy == "frozen":
        eager[1].eval()
    body = copy.deepcopy(eager)

    class Single(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = body
            object.__setattr__(self, "fused", FusedConvBN1d.from_modules(body[0], body[1], "silu", strategy))

        def forward(self, x: Tensor) -> Tensor:
            return self.fused(x)

    wrapped = nn.Module()
    wrapped.body = eager
    train_side_by_side(wrapped, Single(), lambda m, x: m.body(x) if m is wrapped else m(x), _x((6, 5)))


def test_linear_chain_on_3d_input_runs_as_eager() -> None:
    """Linear on (N, L, C) then BatchNorm1d(L) normalises over L: not the fused pattern; the
    chain computes it as eager does (here L == out_features, so eager accepts it)."""
    torch.manual_seed(7)
    eager = randomise(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU()).double())
    fused = Chained(copy.deepcopy(eager), ("recompute_conv",))
    wrapped = nn.Module()
    wrapped.body = eager
    train_side_by_side(wrapped, fused, lambda m, x: m.body(x) if m is wrapped else m(x), _x((3, 4, 5)))


def test_linear_layer_errors_name_the_shape() -> None:
    fused = FusedConvBN1d.from_modules(nn.Linear(5, 4), nn.BatchNorm1d(4))
    # eager's type: BatchNorm1d reads Linear's (3, 2, 4) output as 2 channels, a RuntimeError
    with pytest.raises(RuntimeError, match=r"expected 2D input \(N, C\) for a fused Linear\+BatchNorm1d"):
        fused(torch.randn(3, 2, 5))
    with pytest.raises(RuntimeError, match="running_mean should contain 2 elements"):
        nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))(torch.randn(3, 2, 5))
    with pytest.raises(ValueError, match=r"expected 2D input \(N, C\) for a fused Linear\+BatchNorm1d"):
        fused(torch.randn(5))  # BatchNorm1d's own rank check in eager
    with pytest.raises(RuntimeError, match="to have 5 channels, but got 6"):
        fused(torch.randn(3, 6))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        fused(torch.randn(1, 5))
    with pytest.raises(TypeError, match=r"expects an nn.Conv2d or nn.ConvTranspose2d, but got Linear"):
        FusedConvBN2d.from_modules(nn.Linear(5, 4), nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="num_features=3 does not match the conv's out_channels=4"):
        FusedConvBN2d.from_modules(nn.ConvTranspose2d(2, 4, 2), nn.BatchNorm2d(3))


# --------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("fn", [RecomputeConvFunction, RecomputeBNFunction, FrozenFunction], ids=lambda f: f.__name__)
@pytest.mark.parametrize("kind", ["transposed", "linear"])
def test_gradcheck_and_gradgradcheck(fn: Any, kind: str) -> None:
    torch.manual_seed(8)
    if kind == "transposed":
        conv = nn.ConvTranspose2d(4, 4, 2, stride=2, padding=0, output_padding=1, groups=2, dilation=2).double()
        x = torch.randn(2, 4, 2, 3, dtype=torch.float64, requires_grad=True)
    else:
        conv = nn.Linear(3, 4).double()
        x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    spec = conv_spec_from_module(conv)
    w = conv.weight.detach().clone().requires_grad_()
    b = conv.bias.detach().clone().requires_grad_()
    g = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_()
    beta = torch.randn(4, dtype=torch.float64, requires_grad=True)
    frozen = fn is FrozenFunction
    rm, rv = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    bn = BNSpec(1e-5, not frozen, 0.0)  # momentum 0: repeated calls see the same running stats

    def f(x: Tensor, w: Tensor, b: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        return fn.apply(x, w, b, g, beta, rm, rv, spec, bn, Activation("silu"))

    assert gradcheck(f, (x, w, b, g, beta))
    assert gradgradcheck(f, (x, w, b, g, beta))


# --------------------------------------------------------------------------- convert()

CONVERT_STRATEGIES = ("auto", "recompute_bn", "recompute_conv")


class Decoder(nn.Module):
    """A small encoder-decoder: down conv, transposed up-sampling (module and functional
    forms), a skip concatenation, and an MLP head on pooled features (Linear -> BN1d)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.up = nn.Sequential(nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1, groups=2),
                                nn.BatchNorm2d(4), nn.SiLU())
        self.fuse = nn.Sequential(nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
        self.up2_weight = nn.Parameter(torch.randn(4, 3, 2, 2) * 0.3)
        self.bn2 = nn.BatchNorm2d(3)
        self.head = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.GELU())
        self.fc_weight = nn.Parameter(torch.randn(5, 6) * 0.3)
        self.bn_fc = nn.BatchNorm1d(5)

    def forward(self, x: Tensor) -> Tensor:
        skip = self.enc1(x)
        y = self.up(self.enc2(skip))
        y = self.fuse(torch.cat([y, skip], 1))
        y = F.relu(self.bn2(F.conv_transpose2d(y, self.up2_weight, None, 2)))
        feats = self.head(y.mean((2, 3)))
        return torch.tanh(self.bn_fc(F.linear(feats, self.fc_weight))).sum(1) + y.flatten(1).mean(1)


def _double_model(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return randomise(factory().double())


def _convert_and_train(eager: nn.Module, x: Tensor, strategy: str, tol: dict, lr: float = 0.1, **kw: Any) -> nn.Module:
    fast = convbn.convert(copy.deepcopy(eager), strategy=strategy, **kw)
    train_side_by_side(eager, fast, _call, lambda gen: x + 0.1 * torch.randn(x.shape, generator=gen, dtype=x.dtype),
                       steps=2, tol=tol, lr=lr)
    return fast


@pytest.mark.parametrize("example", [False, True], ids=["lazy", "example_inputs"])
@pytest.mark.parametrize("strategy", CONVERT_STRATEGIES)
def test_convert_decoder_fuses_transposed_and_linear(strategy: str, example: bool) -> None:
    eager = _double_model(Decoder)
    x = torch.randn(3, 2, 6, 4, dtype=torch.float64)
    fast = _convert_and_train(eager, x, strategy, TOL64, example_inputs=x if example else None)
    report = fast.convbn_report
    # (conv, bn, activation, chain, position): the transposed convs and linears chain with what feeds them
    assert [(p.conv, p.bn, p.activation, p.chain, p.position) for p in report.pairs] == [
        ("enc1.0", "enc1.1", "relu", 0, 0),
        ("enc2.0", "enc2.1", "relu", 1, 0), ("up.0", "up.1", "silu", 1, 1),
        ("fuse.0", "fuse.1", "relu", 2, 0), ("up2_weight", "bn2", "relu", 2, 1),  # F.conv_transpose2d
        ("head.0", "head.1", "gelu", 3, 0), ("fc_weight", "bn_fc", "tanh", 3, 1),  # nn.Linear, F.linear
    ]
    assert not report.skipped, report.skipped


@pytest.mark.expect_unfused("a transposed conv called with output_size is left unfused")
def test_convert_leaves_output_size_call_unfused_with_reason() -> None:
    eager = _double_model(TransposedOutputSizeThenBN)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    with pytest.warns(UserWarning, match="fused nothing"):
        fast = convbn.convert(copy.deepcopy(eager))
    (skip,) = fast.convbn_report.skipped
    assert skip.bn == "bn" and "output_size=" in skip.reason and "output_padding" in skip.reason
    train_side_by_side(eager, fast, _call, _x(tuple(x.shape)), steps=1)


def test_convert_linear_on_sequences_runs_as_eager() -> None:
    """Linear on (N, L, C) -> BatchNorm1d(L) normalises over L, a different computation:
    when the shapes happen to line up (L == out_features) the matched chain runs it as eager."""
    eager = _double_model(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU()))
    fast = convbn.convert(copy.deepcopy(eager))
    train_side_by_side(eager, fast, _call, _x((2, 4, 3)))
    train_side_by_side(eager, fast, _call, _x((5, 3)))  # and (N, C) inputs fused


def test_saved_bytes_of_a_transposed_chain_exact() -> None:
    """Saved bytes of conv -> BN -> ReLU -> convT -> BN -> ReLU: the chain input, each kept conv
    output, and two (C,) statistics per layer -- derived from shapes, per plan."""
    torch.manual_seed(9)
    eager = conv_then_convt(2, 2, 1, 2, 1, nn.ReLU)
    x = torch.randn(2, 2, 5, 4)
    y0 = (2, 4, 5, 4)
    y1 = conv_output_shape(y0, eager[3].weight.shape, conv_spec_from_module(eager[3]))
    assert y1 == (2, 6, 10, 8)
    f32 = 4
    stats = 2 * (4 + 6) * f32
    for modes, kept in [(("recompute_conv",) * 2, []), (("recompute_bn",) * 2, [y0, y1]),
                        (("recompute_conv", "recompute_bn"), [y1]), (("recompute_bn", "recompute_conv"), [y0])]:
        fused = Chained(copy.deepcopy(eager), modes)
        rec = saved_bytes(fused, x)
        acts = sorted(s for (_, s, _, _), p in zip(rec.shapes, rec.is_param) if not p and len(s) == 4)
        assert acts == sorted([tuple(x.shape), *kept]), (modes, acts)
        expect = (x.numel() + sum(torch.Size(k).numel() for k in kept)) * f32 + stats
        assert rec.activation_bytes == expect, modes
    # eager keeps more: conv outputs, BN outputs and ReLU outputs
    assert saved_bytes(eager, x).activation_bytes > expect


@pytest.mark.parametrize("num_res_units", [0, 2])
@pytest.mark.parametrize("strategy", CONVERT_STRATEGIES)
def test_monai_unet_transposed_batchnorms_fused(num_res_units: int, strategy: str) -> None:
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    eager = randomise(nets.UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                                num_res_units=num_res_units, norm="batch")).double()
    x = torch.randn(2, 1, 16, 16, dtype=torch.float64)
    # float64 at 1e-10: with the residual units' PReLU tails fused, float32 rounding (amplified
    # by BatchNorms over 2x4x4 values and SGD steps) is no longer bit-comparable at 1e-5
    fast = _convert_and_train(eager, x, strategy, TOL64, example_inputs=x)
    report = fast.convbn_report
    transposed = {n for n, m in eager.named_modules() if isinstance(m, nn.modules.conv._ConvNd) and m.transposed}
    fused_after_transposed = [p for p in report.pairs if p.conv in transposed]
    # every transposed conv followed by a BatchNorm (all but the output layer without residual units)
    expected = {n for n in transposed if not (num_res_units == 0 and n.startswith("model.2"))}
    assert {p.conv for p in fused_after_transposed} == expected and expected
    assert not report.skipped, report.skipped
    bns = [n for n, m in eager.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert sorted(p.bn for p in report.pairs if p.bn) == sorted(bns)  # chain ends have no BN
    assert report.saved_bytes < report.eager_saved_bytes


@pytest.mark.slow
def test_torch_compile_fullgraph_transposed_chain() -> None:
    torch.manual_seed(10)
    eager = conv_then_convt(2, 2, 1, 1, 1, nn.ReLU)
    fused = copy.deepcopy(eager)
    conv = convbn.convert(fused, strategy="recompute_bn")
    compiled = torch.compile(conv, fullgraph=True)  # any graph break raises
    x = torch.randn(2, 2, 5, 4)
    for _ in range(2):
        out, out_e = compiled(x), eager(x)
        g = torch.randn_like(out)
        out.backward(g)
        out_e.backward(g)
        torch.testing.assert_close(out, out_e, rtol=1e-4, atol=1e-5)
    for p, pe in zip(fused.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, pe.grad, rtol=1e-3, atol=1e-4 * max(1.0, pe.grad.abs().max().item()))
    for b, be in zip(fused.buffers(), eager.buffers()):
        torch.testing.assert_close(b, be, rtol=1e-4, atol=1e-6)
    # batch-sized storages: what the compiled chain keeps is at most what the eager chain keeps
    def batch_sized(model: nn.Module) -> int:
        return sum(n for _, shape, _, n in saved_bytes(model, x).shapes if len(shape) and shape[0] == x.shape[0])

    assert 0 < batch_sized(compiled) <= batch_sized(conv)


def test_planner_costs_of_transposed_and_linear_layers() -> None:
    """The report's recompute MACs and kept bytes of a transposed conv and a linear layer are
    derived from their own geometry (a transposed conv's MACs follow its *input*)."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Sequential(nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), nn.BatchNorm2d(6), nn.ReLU())
            self.fc = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5))

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(self.up(x).mean((2, 3)))

    x = torch.randn(2, 4, 3, 5)
    fast = convbn.convert(Net(), strategy="recompute_conv", example_inputs=x)
    up, fc = sorted(fast.convbn_report.pairs, key=lambda p: p.conv != "up.0")
    assert (up.conv, fc.conv) == ("up.0", "fc.0")
    assert up.extra_flops == x.numel() * (6 // 2) * 3 * 3
    assert fc.extra_flops == 2 * 6 * 5
    assert up.layer.y_bytes() == 2 * 6 * 7 * 11 * 4


@pytest.mark.parametrize("kind", ["transposed", "linear"])
def test_chain_gradcheck_and_gradgradcheck(kind: str) -> None:
    """The chain Function's first and second derivatives (w.r.t. the input) with a transposed
    conv or linear layers inside, in float64."""
    torch.manual_seed(11)
    if kind == "transposed":
        body = conv_then_convt(1, 2, 1, 2, 1, nn.SiLU).double()
        x = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    else:
        body = mlp_head(nn.Tanh).double()
        x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    fused = Chained(body, ["recompute_conv"] + ["recompute_bn"] * 2)
    assert gradcheck(fused, (x,))
    assert gradgradcheck(fused, (x,))


@pytest.mark.parametrize("modes", CHAIN_MODES, ids="-".join)
def test_frozen_batchnorm_after_transposed_and_linear_in_training(modes: Tuple[str, ...]) -> None:
    """A BatchNorm in eval mode inside a training model (fine-tuning with frozen statistics)
    after a transposed conv and after a linear layer."""
    torch.manual_seed(12)
    for body, shape in ((conv_then_convt(2, 2, 1, 2, 2, nn.GELU), (2, 2, 4, 3)), (mlp_head(nn.ReLU)[:6], (5, 5))):
        eager = randomise(body.double())
        eager[4].eval()
        fused = Chained(copy.deepcopy(eager), modes)
        wrapped = nn.Module()
        wrapped.body = eager
        train_side_by_side(wrapped, fused, lambda m, x: m.body(x) if m is wrapped else m(x), _x(shape))


class PaddedFunctionalUp(nn.Module):
    """Zero padding before a transposed conv (not absorbed: a transposed conv's ``padding``
    crops its output), and ``F.conv_transpose1d`` with every geometry argument as a keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.pad = nn.ZeroPad1d((1, 2))
        self.up = nn.ConvTranspose1d(4, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm1d(4)
        self.weight = nn.Parameter(torch.randn(4, 3, 2) * 0.4)
        self.bias = nn.Parameter(torch.randn(6) * 0.1)
        self.bn2 = nn.BatchNorm1d(6)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn(self.up(self.pad(x))))
        y = F.conv_transpose1d(y, self.weight, self.bias, stride=3, padding=1, output_padding=2, groups=2, dilation=2)
        return F.silu(self.bn2(y))


@pytest.mark.parametrize("strategy", CONVERT_STRATEGIES)
def test_convert_padded_and_keyword_functional_transposed(strategy: str) -> None:
    eager = _double_model(PaddedFunctionalUp)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    fast = _convert_and_train(eager, x, strategy, TOL64)
    report = fast.convbn_report
    assert [(p.conv, p.bn, p.activation, p.chain) for p in report.pairs] == [
        ("up", "bn", "relu", 0), ("weight", "bn2", "silu", 0)]
    assert "pad" in [str(n.target) for n in fast.forward.graph.nodes if n.op == "call_module"]


@pytest.mark.parametrize("kind", ["transposed", "linear"])
def test_autocast_bf16_and_channels_last(kind: str) -> None:
    """Under CPU bf16 autocast the fused transposed/linear chains compute eager's outputs and
    stay within eager's own bf16 gradient error (measured against float32); channels_last
    inputs give channels_last outputs, as eager's."""
    torch.manual_seed(13)
    if kind == "transposed":
        ref32 = conv_then_convt(2, 2, 1, 2, 1, nn.SiLU)
        x = torch.randn(4, 2, 6, 5)
    else:
        ref32 = mlp_head(nn.ReLU)
        x = torch.randn(16, 5)
    eager, fused = copy.deepcopy(ref32), copy.deepcopy(ref32)
    conv = convbn.convert(fused, strategy="auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_e = conv(x), eager(x)
    out32 = ref32(x)
    assert out.dtype == out_e.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), out_e.float(), rtol=0, atol=0)
    g = torch.randn_like(out32)
    out.backward(g.to(out.dtype))
    out_e.backward(g.to(out_e.dtype))
    out32.backward(g)
    for p, pe, p32 in zip(fused.parameters(), eager.parameters(), ref32.parameters()):
        assert p.grad.dtype == torch.float32
        assert (p.grad - pe.grad).abs().max() <= 2 * (pe.grad - p32.grad).abs().max() + 2e-2 * p32.grad.abs().max()
    if kind == "transposed":
        xc = x.to(memory_format=torch.channels_last)
        out, out_e = conv(xc), eager(xc)
        assert out.is_contiguous(memory_format=torch.channels_last) == out_e.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(out, out_e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["VNet", "AttentionUnet"])
def test_monai_decoders_with_transposed_batchnorms_fully_fused(name: str) -> None:
    """Two more real decoders whose up-sampling is ConvTranspose -> BatchNorm: every
    BatchNorm fused, every transposed conv in a pair. AttentionUnet trains as eager for 2
    steps in float64; VNet (deep 5x5x5 3-D convs: slow in float64 here, and in float32 the
    two runs' rounding grows over steps) is compared on one float32 step, with its p=0.5
    dropout on the decoder's skip inputs under the same seed."""
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    if name == "VNet":
        eager = randomise(nets.VNet(spatial_dims=3, in_channels=1, out_channels=2, dropout_prob_down=0.0,
                                    dropout_prob_up=(0.0, 0.0)))
        fast = convbn.convert(copy.deepcopy(eager))
        train_side_by_side(eager, fast, _call, lambda gen: torch.randn(2, 1, 16, 16, 16, generator=gen), steps=0,
                           tol=TOL32)
    else:
        eager = randomise(nets.AttentionUnet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16),
                                             strides=(2, 2))).double()
        x = torch.randn(2, 1, 16, 16, dtype=torch.float64)
        fast = _convert_and_train(eager, x, "auto", dict(rtol=1e-8, atol_scale=1e-8), example_inputs=x)
        assert fast.convbn_report.saved_bytes < fast.convbn_report.eager_saved_bytes
    report = fast.convbn_report
    transposed = {n for n, m in eager.named_modules() if isinstance(m, nn.modules.conv._ConvNd) and m.transposed}
    assert transposed and transposed <= {p.conv for p in report.pairs}
    # every BatchNorm, and every per-sample norm (AttentionUnet's merge convs: InstanceNorm), in a pair
    bns = [n for n, m in eager.named_modules()
           if isinstance(m, nn.modules.batchnorm._BatchNorm) or row_of_module(m) is not None]
    assert sorted(p.bn for p in report.pairs if p.bn) == sorted(bns) and not report.skipped  # chain ends have no BN
