"""Equivalence of the fused Conv -> BatchNorm -> activation layers with eager PyTorch.

Every check builds the eager baseline ``nn.ConvNd -> nn.BatchNormNd -> activation`` from
*deep copies* of the fused module's children, runs 2-3 consecutive training steps with
random inputs and random upstream gradients (never ``.sum()``), applies the same SGD
update to both, and compares outputs, the input gradient, every parameter gradient,
``running_mean``/``running_var`` and ``num_batches_tracked``.

The grid is kept small on purpose: the full cross product strategy x activation x dims on
a base config, then each conv/BN option varied on its own.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple, Union

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.autograd import gradcheck, gradgradcheck

from convbn.autograd.layer_functions import FrozenFunction, RecomputeBNFunction, RecomputeConvFunction
from convbn.functional.activations import get_activation
from convbn.functional.batchnorm import BNSpec
from convbn.functional.conv import make_conv_spec
from convbn.autograd.dispatch import conv_bn_act
from convbn.nn.fused_conv_bn import FusedConvBN1d, FusedConvBN2d, FusedConvBN3d

STRATEGIES = ("recompute_conv", "recompute_bn", "frozen")
FUSED = {1: FusedConvBN1d, 2: FusedConvBN2d, 3: FusedConvBN3d}
SPATIAL = {1: (7,), 2: (5, 6), 3: (4, 3, 5)}

#: (id, what the fused module gets, factory of the eager activation module)
ACTIVATIONS: List[Tuple[str, Any, Any]] = [
    ("none", None, nn.Identity),
    ("relu", "relu", nn.ReLU),
    ("relu6", "relu6", nn.ReLU6),
    ("leaky_relu", "leaky_relu", nn.LeakyReLU),
    ("leaky_relu0.2", nn.LeakyReLU(0.2), lambda: nn.LeakyReLU(0.2)),
    ("silu", "silu", nn.SiLU),
    ("gelu", "gelu", nn.GELU),
    ("gelu_tanh", nn.GELU(approximate="tanh"), lambda: nn.GELU(approximate="tanh")),
    ("hardswish", "hardswish", nn.Hardswish),
    ("hardsigmoid", "hardsigmoid", nn.Hardsigmoid),
    ("sigmoid", "sigmoid", nn.Sigmoid),
    ("tanh", nn.Tanh(), nn.Tanh),
    ("elu0.5", nn.ELU(0.5), lambda: nn.ELU(0.5)),
    ("celu0.7", nn.CELU(0.7), lambda: nn.CELU(0.7)),
    ("selu", "selu", nn.SELU),
    ("mish", "mish", nn.Mish),
    ("softplus", nn.Softplus(2.0, 1.0), lambda: nn.Softplus(2.0, 1.0)),
]
ACT_IDS = [a[0] for a in ACTIVATIONS]
ACT_BY_ID = {a[0]: a for a in ACTIVATIONS}

TOL64 = dict(rtol=1e-10, atol=1e-10)
TOL32 = dict(rtol=1e-4, atol=1e-5)



# --------------------------------------------------------------------------- helpers


def make_pair(
    dims: int,
    act_id: str = "relu",
    strategy: str = "recompute_bn",
    dtype: torch.dtype = torch.float64,
    in_channels: int = 4,
    out_channels: int = 6,
    kernel_size: Union[int, Tuple[int, ...]] = 3,
    **options: Any,
) -> Tuple[nn.Module, nn.Sequential]:
    """A fused module with random (non-default) parameters/stats and its eager twin."""
    _, fused_act, eager_act = ACT_BY_ID[act_id]
    torch.manual_seed(11)
    fused = FUSED[dims](
        in_channels, out_channels, kernel_size, activation=copy.deepcopy(fused_act), strategy=strategy, dtype=dtype, **options
    )
    with torch.no_grad():
        if fused.bn.affine:
            fused.bn.weight.uniform_(0.5, 1.5)
            fused.bn.bias.uniform_(-0.5, 0.5)
        if fused.bn.track_running_stats:
            fused.bn.running_mean.uniform_(-0.3, 0.3)
            fused.bn.running_var.uniform_(0.5, 2.0)
    eager = nn.Sequential(copy.deepcopy(fused.conv), copy.deepcopy(fused.bn), eager_act().to(dtype))
    return fused, eager


def set_mode(fused: nn.Module, eager: nn.Sequential, mode: str) -> None:
    """``train``; ``eval`` (whole module); ``bn_eval`` (conv trains, BN frozen: fine-tuning)."""
    fused.train(mode != "eval")
    eager.train(mode != "eval")
    if mode == "bn_eval":
        fused.bn.eval()
        eager[1].eval()
    if fused.strategy == "frozen":
        # the eager meaning of the frozen strategy: BN normalises with running stats
        eager[1].eval()


def _param_grads(fused: nn.Module, eager: nn.Sequential) -> Dict[str, Tuple[Optional[Tensor], Optional[Tensor]]]:
    return {
        "conv.weight": (fused.conv.weight, eager[0].weight),
        "conv.bias": (fused.conv.bias, eager[0].bias),
        "bn.weight": (fused.bn.weight, eager[1].weight),
        "bn.bias": (fused.bn.bias, eager[1].bias),
    }


def assert_state_equal(fused: nn.Module, eager: nn.Sequential, tol: Dict[str, float]) -> None:
    for name in ("running_mean", "running_var"):
        a, b = getattr(fused.bn, name), getattr(eager[1], name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")
    a, b = fused.bn.num_batches_tracked, eager[1].num_batches_tracked
    assert (a is None) == (b is None)
    if a is not None:
        assert int(a) == int(b), f"num_batches_tracked {int(a)} != {int(b)}"


def run_steps(
    fused: nn.Module,
    eager: nn.Sequential,
    spatial: Tuple[int, ...],
    steps: int = 3,
    batch: int = 3,
    tol: Optional[Dict[str, float]] = None,
    lr: float = 0.1,
    seed: int = 0,
) -> None:
    """Run ``steps`` forward/backward/SGD steps on both and compare everything each step."""
    dtype = fused.conv.weight.dtype
    tol = tol or (TOL64 if dtype == torch.float64 else TOL32)
    gen = torch.Generator().manual_seed(seed)
    c_in = fused.conv.in_channels
    for step in range(steps):
        x = torch.randn(batch, c_in, *spatial, generator=gen, dtype=dtype)
        xf = x.clone().requires_grad_()
        xe = x.clone().requires_grad_()
        out_f = fused(xf)
        out_e = eager(xe)
        torch.testing.assert_close(out_f, out_e, **tol, msg=lambda m: f"step {step} output: {m}")
        grad = torch.randn(out_e.shape, generator=gen, dtype=dtype)
        if out_f.requires_grad:
            out_f.backward(grad)
            out_e.backward(grad)
            torch.testing.assert_close(xf.grad, xe.grad, **tol, msg=lambda m: f"step {step} input grad: {m}")
        for name, (pf, pe) in _param_grads(fused, eager).items():
            assert (pf is None) == (pe is None), name
            if pf is None:
                continue
            assert (pf.grad is None) == (pe.grad is None), f"{name}.grad presence"
            if pf.grad is not None:
                torch.testing.assert_close(pf.grad, pe.grad, **tol, msg=lambda m: f"step {step} {name}.grad: {m}")
        assert_state_equal(fused, eager, tol)
        with torch.no_grad():
            for pf, pe in _param_grads(fused, eager).values():
                if pf is not None and pf.grad is not None:
                    pf -= lr * pf.grad
                    pe -= lr * pe.grad
                    pf.grad = None
                    pe.grad = None


# --------------------------------------------------------------------------- the grid


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("act_id", ACT_IDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_base_grid(strategy: str, act_id: str, dims: int) -> None:
    """Full cross product strategy x activation x dims on the base config, training."""
    fused, eager = make_pair(dims, act_id, strategy, padding=1)
    set_mode(fused, eager, "train")
    run_steps(fused, eager, SPATIAL[dims])


@pytest.mark.parametrize("act_id", ACT_IDS)
@pytest.mark.parametrize("mode", ["eval", "bn_eval"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_modes(strategy: str, mode: str, act_id: str) -> None:
    """Whole-module eval, and frozen fine-tuning (conv in train mode, BN in eval mode)."""
    fused, eager = make_pair(2, act_id, strategy, padding=1)
    set_mode(fused, eager, mode)
    nbt = int(fused.bn.num_batches_tracked)
    stats = fused.bn.running_mean.clone(), fused.bn.running_var.clone()
    run_steps(fused, eager, SPATIAL[2])
    # neither eval nor frozen BN may touch the statistics
    assert int(fused.bn.num_batches_tracked) == nbt
    torch.testing.assert_close(fused.bn.running_mean, stats[0], rtol=0, atol=0)
    torch.testing.assert_close(fused.bn.running_var, stats[1], rtol=0, atol=0)


OPTIONS: List[Tuple[str, int, Dict[str, Any]]] = [
    ("stride2", 2, dict(stride=2, padding=1)),
    ("stride_tuple", 2, dict(stride=(2, 1), padding=(1, 0))),
    ("stride_3d", 3, dict(stride=(1, 2, 2), padding=1)),
    ("padding0", 2, dict(padding=0)),
    ("padding_tuple", 2, dict(padding=(2, 1))),
    ("padding_same", 2, dict(padding="same")),
    ("padding_same_even_kernel", 2, dict(padding="same", kernel_size=(2, 4))),
    ("padding_same_dilated_1d", 1, dict(padding="same", kernel_size=4, dilation=3)),
    ("padding_valid", 2, dict(padding="valid")),
    ("dilation2", 2, dict(padding=2, dilation=2)),
    ("dilation_tuple_3d", 3, dict(padding=(0, 1, 2), dilation=(1, 1, 2))),
    ("groups2", 2, dict(padding=1, groups=2)),
    ("depthwise", 2, dict(padding=1, groups=4, out_channels=8)),
    ("groups_1d", 1, dict(padding=1, groups=2)),
    ("no_bias", 2, dict(padding=1, bias=False)),
    ("no_bias_3d", 3, dict(padding=1, bias=False)),
    ("reflect", 2, dict(padding=1, padding_mode="reflect")),
    ("circular", 2, dict(padding=(1, 2), padding_mode="circular")),
    ("replicate", 2, dict(padding=1, padding_mode="replicate")),
    ("reflect_1d", 1, dict(padding=2, padding_mode="reflect")),
    ("replicate_3d", 3, dict(padding=1, padding_mode="replicate")),
    ("circular_same", 2, dict(padding="same", padding_mode="circular", kernel_size=4)),
    ("affine_false", 2, dict(padding=1, affine=False)),
    ("affine_false_3d", 3, dict(padding=1, affine=False, bias=False)),
    ("momentum_none", 2, dict(padding=1, momentum=None)),
    ("momentum_0.3", 2, dict(padding=1, momentum=0.3)),
    ("momentum_none_1d", 1, dict(padding=1, momentum=None)),
    ("eps", 2, dict(padding=1, eps=1e-2)),
    ("kernel1", 2, dict(kernel_size=1)),
    ("kernel_tuple", 2, dict(kernel_size=(1, 3), padding=(0, 1))),
    ("no_track", 2, dict(padding=1, track_running_stats=False)),
    ("no_track_1d", 1, dict(padding=1, track_running_stats=False)),
]


@pytest.mark.parametrize("act_id", ["none", "relu", "silu"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name,dims,options", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_options(name: str, dims: int, options: Dict[str, Any], strategy: str, act_id: str) -> None:
    """Each conv/BN option varied on its own, for every strategy, in training mode."""
    if strategy == "frozen" and options.get("track_running_stats") is False:
        pytest.skip("frozen needs running statistics (error path tested in test_errors.py)")
    fused, eager = make_pair(dims, act_id, strategy, **options)
    set_mode(fused, eager, "train")
    run_steps(fused, eager, SPATIAL[dims])


@pytest.mark.parametrize("strategy", ["recompute_conv", "recompute_bn"])
@pytest.mark.parametrize("track", [True, False])
def test_eval_mode_options(strategy: str, track: bool) -> None:
    """Eval mode with ``track_running_stats=False`` normalises with batch statistics, like eager."""
    fused, eager = make_pair(2, "gelu", strategy, padding=1, track_running_stats=track, momentum=None)
    set_mode(fused, eager, "eval")
    run_steps(fused, eager, SPATIAL[2])


def test_momentum_none_uses_num_batches_tracked() -> None:
    """``momentum=None``: running stats are the cumulative average of the batch statistics."""
    fused, eager = make_pair(2, "relu", "recompute_conv", padding=1, momentum=None)
    set_mode(fused, eager, "train")
    run_steps(fused, eager, SPATIAL[2], steps=3)
    assert int(fused.bn.num_batches_tracked) == 3
    # fresh BN: the cumulative average of three unbiased batch variances, computed by hand
    fresh = FusedConvBN2d(2, 3, 1, momentum=None, dtype=torch.float64)
    xs = [torch.randn(4, 2, 3, 3, dtype=torch.float64) for _ in range(3)]
    ys = []
    for x in xs:
        fresh(x.requires_grad_())
        ys.append(fresh.conv(x).detach())  # conv weight is not updated (no optimizer)
    var = torch.stack([y.transpose(0, 1).flatten(1).var(1, unbiased=True) for y in ys]).mean(0)
    mean = torch.stack([y.mean((0, 2, 3)) for y in ys]).mean(0)
    torch.testing.assert_close(fresh.bn.running_var, var, **TOL64)
    torch.testing.assert_close(fresh.bn.running_mean, mean, **TOL64)


def _step_tensors(model: nn.Module, x: Tensor, grad_seed: int) -> Dict[str, Tensor]:
    """Forward + backward with a random upstream gradient; everything eager would expose."""
    conv, bn = (model.conv, model.bn) if hasattr(model, "conv") else (model[0], model[1])
    xr = x.clone().to(conv.weight.dtype).requires_grad_()
    out = model(xr)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=torch.float64)
    out.backward(grad.to(out.dtype))
    found = {"out": out.detach(), "x.grad": xr.grad, "running_mean": bn.running_mean, "running_var": bn.running_var}
    for name, p in (("conv.weight", conv.weight), ("conv.bias", conv.bias), ("bn.weight", bn.weight), ("bn.bias", bn.bias)):
        if p is not None:
            found[name + ".grad"] = p.grad.clone()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return {k: v.detach().double().clone() for k, v in found.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("act_id", ["relu", "gelu_tanh", "none"])
@pytest.mark.parametrize("dims", [1, 2])
def test_float32_within_eager_tolerance(strategy: str, act_id: str, dims: int) -> None:
    """float32: the fused layer's error against a float64 eager run is of the order of eager
    float32's own error against that run (10x its max error, floored at 1e-6 of the scale)."""
    fused, eager32 = make_pair(dims, act_id, strategy, dtype=torch.float32, padding=1)
    eager64 = copy.deepcopy(eager32).double()
    for m in (fused, eager32, eager64):
        m.train()
        if strategy == "frozen" and m is not fused:
            m[1].eval()
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(4, 4, *SPATIAL[dims], generator=gen, dtype=torch.float64).float()
        f, e32, e64 = (_step_tensors(m, x, step) for m in (fused, eager32, eager64))
        assert f.keys() == e64.keys()
        for k in e64:
            own = (e32[k] - e64[k]).abs().max().item()
            err = (f[k] - e64[k]).abs().max().item()
            scale = e64[k].abs().max().item()
            assert err <= 10 * own + 1e-6 * scale, f"step {step} {k}: fused err {err:.3g} vs eager float32 err {own:.3g}"
        assert int(fused.bn.num_batches_tracked) == int(eager32[1].num_batches_tracked)


def test_no_grad_forward_matches_and_updates_stats() -> None:
    """Under ``torch.no_grad`` (no Function is used) training still matches eager and updates stats."""
    for strategy in STRATEGIES:
        fused, eager = make_pair(2, "hardswish", strategy, padding=1)
        set_mode(fused, eager, "train")
        x = torch.randn(3, 4, 5, 6, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), eager(x), **TOL64)
        assert_state_equal(fused, eager, TOL64)


def test_functional_matches_eager() -> None:
    """``conv_bn_act`` (functional form) vs ``F.conv2d -> F.batch_norm -> act`` incl. running stats."""
    torch.manual_seed(1)
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    w = torch.randn(6, 2, 3, 3, dtype=torch.float64)
    b, g, beta = (torch.randn(6, dtype=torch.float64) for _ in range(3))
    for strategy in ("recompute_conv", "recompute_bn"):
        rm_f, rv_f = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
        rm_e, rv_e = rm_f.clone(), rv_f.clone()
        leaves_f = [t.clone().requires_grad_() for t in (x, w, b, g, beta)]
        leaves_e = [t.clone().requires_grad_() for t in (x, w, b, g, beta)]
        out_f = conv_bn_act(
            leaves_f[0], leaves_f[1], leaves_f[2], leaves_f[3], leaves_f[4], rm_f, rv_f,
            stride=2, padding=1, groups=2, padding_mode="reflect", momentum=0.3, eps=1e-3,
            activation="silu", strategy=strategy,
        )
        ye = torch.nn.functional.conv2d(
            torch.nn.functional.pad(leaves_e[0], [1, 1, 1, 1], mode="reflect"), leaves_e[1], leaves_e[2], stride=2, groups=2
        )
        out_e = torch.nn.functional.silu(
            torch.nn.functional.batch_norm(ye, rm_e, rv_e, leaves_e[3], leaves_e[4], True, 0.3, 1e-3)
        )
        torch.testing.assert_close(out_f, out_e, **TOL64)
        grad = torch.randn(out_e.shape, dtype=torch.float64)
        gf = torch.autograd.grad(out_f, leaves_f, grad)
        ge = torch.autograd.grad(out_e, leaves_e, grad)
        for a, e in zip(gf, ge):
            torch.testing.assert_close(a, e, **TOL64)
        torch.testing.assert_close(rm_f, rm_e, **TOL64)
        torch.testing.assert_close(rv_f, rv_e, **TOL64)


def test_grid_detects_a_wrong_result() -> None:
    """The comparison machinery fails on a real discrepancy (guards against a vacuous grid)."""
    fused, eager = make_pair(2, "relu", "recompute_bn", padding=1)
    with torch.no_grad():
        eager[1].weight[0] += 1e-6
    with pytest.raises(AssertionError):
        run_steps(fused, eager, SPATIAL[2], steps=1)
    fused, eager = make_pair(2, "relu", "recompute_conv", padding=1, momentum=0.3)
    eager[1].momentum = 0.2
    with pytest.raises(AssertionError, match="running_mean|running_var"):
        run_steps(fused, eager, SPATIAL[2], steps=1)


# --------------------------------------------------------------------------- gradcheck


FUNCTIONS = {
    "recompute_conv": RecomputeConvFunction,
    "recompute_bn": RecomputeBNFunction,
    "frozen": FrozenFunction,
}

GRADCHECK_CASES: List[Tuple[str, str, Dict[str, Any]]] = [
    ("identity", "plain", dict()),
    ("silu", "strided_grouped", dict(stride=2, padding=1, groups=2)),
    ("gelu", "dilated_nobias", dict(padding=2, dilation=2, bias=False)),
    ("leaky_relu", "no_affine", dict(padding=1, affine=False)),
    ("hardswish", "1d", dict(dims=1, padding=1)),
]


def _gradcheck_inputs(
    dims: int = 2, bias: bool = True, affine: bool = True, groups: int = 1, seed: int = 0
) -> Tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    c_in, c_out, k = 2, 4, 3
    sp = (5,) * dims if dims == 2 else (7,)
    opts = dict(dtype=torch.float64)
    x = torch.randn(3, c_in, *sp, generator=gen, **opts).requires_grad_()
    w = torch.randn(c_out, c_in // groups, *([k] * dims), generator=gen, **opts).requires_grad_()
    b = torch.randn(c_out, generator=gen, **opts).requires_grad_() if bias else None
    g = (torch.rand(c_out, generator=gen, **opts) + 0.5).requires_grad_() if affine else None
    beta = torch.randn(c_out, generator=gen, **opts).requires_grad_() if affine else None
    return x, w, b, g, beta


@pytest.mark.parametrize("act_name,case,options", GRADCHECK_CASES, ids=[c[1] + "-" + c[0] for c in GRADCHECK_CASES])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradcheck_functions(strategy: str, act_name: str, case: str, options: Dict[str, Any]) -> None:
    """Each hand-written backward against finite differences, float64."""
    opts = dict(options)
    dims = opts.pop("dims", 2)
    bias, affine, groups = opts.pop("bias", True), opts.pop("affine", True), opts.get("groups", 1)
    x, w, b, g, beta = _gradcheck_inputs(dims, bias, affine, groups)
    spec = make_conv_spec(dims, w.shape[2:], **opts)
    act = get_activation(act_name)
    gen = torch.Generator().manual_seed(1)
    rm = torch.randn(w.shape[0], generator=gen, dtype=torch.float64) * 0.1
    rv = torch.rand(w.shape[0], generator=gen, dtype=torch.float64) + 0.5
    fn = FUNCTIONS[strategy]
    bn = BNSpec(1e-5, strategy != "frozen", 0.1)

    def f(x: Tensor, w: Tensor, b: Optional[Tensor], g: Optional[Tensor], beta: Optional[Tensor]) -> Tensor:
        # fresh stats each call: the batch-stat Functions update them in place
        return fn.apply(x, w, b, g, beta, rm.clone(), rv.clone(), spec, bn, act)

    assert gradcheck(f, (x, w, b, g, beta), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradcheck_partial_requires_grad(strategy: str) -> None:
    """Only some inputs need gradients (``needs_input_grad`` masks): still correct."""
    x, w, b, g, beta = _gradcheck_inputs()
    x = x.detach()
    beta = beta.detach()
    spec = make_conv_spec(2, w.shape[2:], padding=1)
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64) * 1.3
    bn = BNSpec(1e-5, strategy != "frozen", 0.1)
    fn = FUNCTIONS[strategy]
    assert gradcheck(
        lambda w, b, g: fn.apply(x, w, b, g, beta, rm.clone(), rv.clone(), spec, bn, get_activation("relu6")),
        (w, b, g),
        eps=1e-6,
        atol=1e-6,
        rtol=1e-4,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradgradcheck_functions(strategy: str) -> None:
    """Double backward (create_graph) goes through the differentiable rebuild."""
    x, w, b, g, beta = _gradcheck_inputs(seed=3)
    x = x[:2, :, :4, :4].detach().requires_grad_()
    spec = make_conv_spec(2, w.shape[2:], padding=1)
    rm, rv = torch.zeros(4, dtype=torch.float64) + 0.1, torch.ones(4, dtype=torch.float64) * 1.3
    bn = BNSpec(1e-5, strategy != "frozen", 0.1)
    fn = FUNCTIONS[strategy]
    act = get_activation("silu")
    assert gradgradcheck(
        lambda x, w, g: fn.apply(x, w, b.detach(), g, beta.detach(), rm.clone(), rv.clone(), spec, bn, act),
        (x, w, g),
        eps=1e-6,
        atol=1e-5,
        rtol=1e-3,
    )


@pytest.mark.parametrize("bn_training", [True, False], ids=["train_bn", "eval_bn"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_implementation_per_strategy(strategy: str, bn_training: bool) -> None:
    """A recompute layer runs as a one-layer chain (Note: [one recompute implementation] in
    convbn/autograd/layer_functions.py); ``frozen``, and any layer whose BatchNorm uses running
    statistics, folds BN into the conv in FrozenFunction."""
    layer = FusedConvBN2d(3, 4, 3, activation="relu", strategy=strategy)
    layer.bn.train(bn_training)
    out = layer(torch.randn(2, 3, 6, 6, requires_grad=True))
    folded = strategy == "frozen" or not bn_training
    assert type(out.grad_fn).__name__ == ("FrozenFunctionBackward" if folded else "ChainFunctionBackward")


# --------------------------------------------------------------------------- hypothesis


@st.composite
def conv_geometry(draw: Any) -> Dict[str, Any]:
    dims = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2]))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(dims))
    spatial = tuple(draw(st.integers(3, 7)) for _ in range(dims))
    batch = draw(st.integers(1, 3))
    out = [
        (s + 2 * p - d * (k - 1) - 1) // st_ + 1 for s, p, d, k, st_ in zip(spatial, padding, dilation, kernel, stride)
    ]
    assume(all(o >= 1 for o in out))
    n_per_channel = batch
    for o in out:
        n_per_channel *= o
    assume(n_per_channel > 1)
    return dict(
        dims=dims,
        in_channels=c_in,
        out_channels=c_out,
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        spatial=spatial,
        batch=batch,
        bias=draw(st.booleans()),
        strategy=draw(st.sampled_from(STRATEGIES)),
        act_id=draw(st.sampled_from(ACT_IDS)),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(geo=conv_geometry())
def test_hypothesis_random_geometry(geo: Dict[str, Any]) -> None:
    """Random small conv geometries: fused module == eager (two training steps)."""
    geo = dict(geo)
    dims, spatial, batch = geo.pop("dims"), geo.pop("spatial"), geo.pop("batch")
    fused, eager = make_pair(dims, **geo)
    set_mode(fused, eager, "train")
    run_steps(fused, eager, spatial, steps=2, batch=batch)


# --------------------------------------------------------------------------- checkpoints


def _named_sequential(fused: nn.Module) -> nn.Sequential:
    return nn.Sequential(OrderedDict(conv=copy.deepcopy(fused.conv), bn=copy.deepcopy(fused.bn)))


def _randomise(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]:
            t.copy_(torch.rand(t.shape, generator=gen, dtype=t.dtype) + 0.5)
        for b in module.buffers():
            if not b.is_floating_point():
                b.fill_(seed)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_round_trip_named_sequential(strategy: str) -> None:
    fused = FusedConvBN2d(3, 5, 3, padding=1, activation="relu", strategy=strategy)
    seq = _named_sequential(fused)
    assert list(fused.state_dict()) == list(seq.state_dict())
    # Sequential -> fused (strict)
    _randomise(seq, 7)
    fused.load_state_dict(seq.state_dict(), strict=True)
    for k, v in seq.state_dict().items():
        assert torch.equal(fused.state_dict()[k], v), k
    # fused -> Sequential (strict)
    _randomise(fused, 9)
    seq.load_state_dict(fused.state_dict(), strict=True)
    for k, v in fused.state_dict().items():
        assert torch.equal(seq.state_dict()[k], v), k
    assert int(seq.bn.num_batches_tracked) == 9
    # the loaded module computes what the Sequential does
    x = torch.randn(2, 3, 6, 6)
    fused.eval()
    seq.eval()
    torch.testing.assert_close(fused(x), torch.relu(seq(x)))


def test_state_dict_from_plain_sequential() -> None:
    """A checkpoint of ``nn.Sequential(conv, bn)`` (keys ``0.*``/``1.*``) loads strictly."""
    conv, bn = nn.Conv2d(3, 5, 3, bias=False), nn.BatchNorm2d(5)
    plain = nn.Sequential(conv, bn)
    _randomise(plain, 3)
    sd = plain.state_dict()
    assert any(k.startswith("0.") for k in sd)
    fused = FusedConvBN2d(3, 5, 3, bias=False)
    result = fused.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(fused.conv.weight, conv.weight)
    assert torch.equal(fused.bn.running_var, bn.running_var)
    assert int(fused.bn.num_batches_tracked) == 3
    assert set(sd) == {"0.weight", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"}


def test_state_dict_nested_prefix() -> None:
    """Inside a parent model, a plain ``Sequential(conv, bn)`` checkpoint still loads."""
    old = nn.Sequential(OrderedDict(stem=nn.Sequential(nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4)), head=nn.Linear(4, 2)))
    _randomise(old, 5)
    new = nn.Sequential(OrderedDict(stem=FusedConvBN1d(2, 4, 3), head=nn.Linear(4, 2)))
    new.load_state_dict(old.state_dict(), strict=True)
    assert torch.equal(new.stem.bn.running_mean, old.stem[1].running_mean)
    assert torch.equal(new.head.weight, old.head.weight)


def test_state_dict_strict_mismatch_still_fails() -> None:
    """A wrong checkpoint is not silently accepted."""
    fused = FusedConvBN2d(3, 5, 3)
    sd = nn.Sequential(nn.Conv2d(3, 5, 3, bias=False), nn.BatchNorm2d(5)).state_dict()
    with pytest.raises(RuntimeError, match="conv.bias"):
        fused.load_state_dict(sd, strict=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_from_modules_shares_and_trains_originals(dims: int, strategy: str) -> None:
    conv_cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    bn_cls = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
    conv, bn = conv_cls(3, 4, 3, padding=1), bn_cls(4)
    fused = FUSED[dims].from_modules(conv, bn, "relu", strategy)
    assert fused.conv is conv and fused.bn is bn
    assert fused.conv.weight is conv.weight and fused.conv.bias is conv.bias
    assert fused.bn.weight is bn.weight and fused.bn.bias is bn.bias
    assert fused.bn.running_mean is bn.running_mean and fused.bn.running_var is bn.running_var
    assert fused.bn.num_batches_tracked is bn.num_batches_tracked
    params = {id(p) for p in fused.parameters()}
    assert params == {id(conv.weight), id(conv.bias), id(bn.weight), id(bn.bias)}

    before_w, before_gamma = conv.weight.detach().clone(), bn.weight.detach().clone()
    before_rm = bn.running_mean.clone()
    opt = torch.optim.SGD(fused.parameters(), lr=0.5)
    x = torch.randn(3, 3, *SPATIAL[dims])
    out = fused(x)
    out.backward(torch.randn(out.shape))
    opt.step()
    assert not torch.equal(conv.weight, before_w)
    assert not torch.equal(bn.weight, before_gamma)
    if strategy == "frozen":
        assert torch.equal(bn.running_mean, before_rm) and int(bn.num_batches_tracked) == 0
    else:
        assert not torch.equal(bn.running_mean, before_rm) and int(bn.num_batches_tracked) == 1


def test_from_modules_matches_eager_training() -> None:
    """Training through ``from_modules`` equals training the original modules eagerly."""
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64), nn.BatchNorm2d(4, momentum=None, dtype=torch.float64)
    eager = nn.Sequential(copy.deepcopy(conv), copy.deepcopy(bn), nn.SiLU())
    fused = FusedConvBN2d.from_modules(conv, bn, nn.SiLU(), "recompute_conv")
    run_steps(fused, eager, (5, 5), steps=3)
