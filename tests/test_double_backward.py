"""Double backward through every fused layer: gradient penalties, MAML, Hessian-vector products.

The fused Functions (``FrozenFunction``, and the chain's ``ChainFunction``, which also runs
single ``recompute_conv`` / ``recompute_bn`` layers) take their fast native first-order path under no-grad and,
when autograd asks for a differentiable backward (``create_graph=True``), rebuild the layer
from the saved inputs with the reference ops and differentiate that (Note: [double backward]
in ``convbn/autograd/double_backward.py``). These tests check, in float64:

1. ``gradcheck`` + ``gradgradcheck`` of every strategy x activation x Conv1d/2d/3d, and of a
   converted chain with mixed per-layer modes (inputs kept away from activation kinks so
   finite differences are meaningful), plus the first and second derivatives against eager
   autograd for every activation;
2. second-order training quantities of converted / fused models against the eager model:
   a MAML step, a WGAN-GP gradient penalty and a Hessian-vector product, with running
   statistics and ``num_batches_tracked`` advanced exactly once per forward;
3. the first-order path does not touch the reference rebuild, and ``create_graph=True`` does.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call
from torch.testing import assert_close

import convbn
import convbn.autograd.chain as chain_mod
import convbn.autograd.layer_functions as fused_mod
from convbn.autograd.chain_plan import ChainPlan
from convbn import FusedChain, FusedConvBN2d, conv_bn_act
from convbn.functional.activations import Activation

STRATEGIES = ("recompute_conv", "recompute_bn", "frozen")
CONVERT_STRATEGIES = ("auto", "recompute_bn", "recompute_conv")

#: id -> (activation, pre-activation values where its derivative is not smooth)
ACTS: Dict[str, Tuple[Activation, Tuple[float, ...]]] = {
    "identity": (Activation("identity"), ()),
    "silu": (Activation("silu"), ()),
    "gelu": (Activation("gelu"), ()),
    "gelu_tanh": (Activation("gelu", approximate="tanh"), ()),
    "relu": (Activation("relu"), (0.0,)),
    "relu6": (Activation("relu6"), (0.0, 6.0)),
    "leaky_relu": (Activation("leaky_relu", negative_slope=0.2), (0.0,)),
    "hardswish": (Activation("hardswish"), (-3.0, 3.0)),
}

#: per conv dimensionality: input shape, weight shape, conv keyword arguments (tiny on purpose)
GEOMETRY: Dict[int, Tuple[Tuple[int, ...], Tuple[int, ...], Dict[str, Any]]] = {
    1: ((3, 2, 7), (3, 2, 3), dict(stride=2, padding=1)),
    2: ((2, 2, 4, 4), (4, 1, 3, 3), dict(padding=1, groups=2)),
    3: ((2, 2, 3, 3, 3), (3, 2, 2, 2, 2), dict(padding="same")),  # even kernel: asymmetric pre-pad
}

TIGHT = dict(rtol=1e-8, atol=1e-10)
FD = dict(eps=1e-6, atol=1e-6, rtol=1e-4)  # finite-difference tolerances for gradcheck


pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")



# --------------------------------------------------------------------------- one layer


def _layer_inputs(dims: int, seed: int) -> Tuple[List[Tensor], Tensor, Tensor]:
    """``[x, W, b, gamma, beta]`` (float64, requiring grad) and running stats for one layer."""
    x_shape, w_shape, _ = GEOMETRY[dims]
    g = torch.Generator().manual_seed(seed)
    c = w_shape[0]
    x = torch.randn(x_shape, generator=g, dtype=torch.float64)
    w = torch.randn(w_shape, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(c, generator=g, dtype=torch.float64) * 0.1
    gamma = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    beta = torch.rand(c, generator=g, dtype=torch.float64) - 0.5
    rm = (torch.rand(c, generator=g, dtype=torch.float64) - 0.5) * 0.4
    rv = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    return [t.requires_grad_() for t in (x, w, b, gamma, beta)], rm, rv


def _eager_pre_activation(dims: int, strategy: str, inputs: Sequence[Tensor], rm: Tensor, rv: Tensor) -> Tensor:
    """``BN(conv(x))`` with eager ops: batch statistics, or running stats for ``frozen``."""
    x, w, b, gamma, beta = inputs
    y = getattr(F, f"conv{dims}d")(x, w, b, **GEOMETRY[dims][2])
    if strategy == "frozen":
        return F.batch_norm(y, rm, rv, gamma, beta, False, 0.0, 1e-5)
    return F.batch_norm(y, None, None, gamma, beta, True, 0.0, 1e-5)


def _fused_layer(dims: int, strategy: str, act: Activation, rm: Tensor, rv: Tensor) -> Callable[..., Tensor]:
    """The fused layer as a function of ``(x, W, b, gamma, beta)``.

    Batch-statistic strategies get no running stats, so repeated calls (gradcheck) are
    deterministic; ``frozen`` reads its running stats without changing them.
    """
    frozen = strategy == "frozen"

    def fn(x: Tensor, w: Tensor, b: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
        return conv_bn_act(
            x, w, b, gamma, beta, rm if frozen else None, rv if frozen else None,
            training=not frozen, activation=act, strategy=strategy, **GEOMETRY[dims][2],
        )

    return fn


def _inputs_away_from_kinks(dims: int, strategy: str, kinks: Sequence[float],
                            margin: float = 1e-3) -> Tuple[List[Tensor], Tensor, Tensor]:
    """Inputs whose pre-activations all lie at least ``margin`` from the activation's kinks.

    gradcheck perturbs each input by 1e-6, which moves a pre-activation by ~1e-5 at most,
    so finite differences never straddle a kink. The first seed that qualifies is used
    (deterministic); the condition is asserted, not assumed.
    """
    for seed in range(200):
        inputs, rm, rv = _layer_inputs(dims, seed)
        with torch.no_grad():
            z = _eager_pre_activation(dims, strategy, inputs, rm, rv)
        if all(float((z - k).abs().min()) > margin for k in kinks):
            return inputs, rm, rv
    raise AssertionError(f"no seed keeps the pre-activations {margin} away from {kinks}")


@pytest.mark.parametrize("dims", (1, 2, 3))
@pytest.mark.parametrize("act_id", list(ACTS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradcheck_and_gradgradcheck(strategy: str, act_id: str, dims: int) -> None:
    """First order (fast native path) and second order (rebuild) against finite differences."""
    act, kinks = ACTS[act_id]
    inputs, rm, rv = _inputs_away_from_kinks(dims, strategy, kinks)
    fn = _fused_layer(dims, strategy, act, rm, rv)
    rm0, rv0 = rm.clone(), rv.clone()
    fast = dims != 2  # full Jacobians in 2-D; random projections in 1-D/3-D keep the grid quick
    assert gradcheck(fn, inputs, fast_mode=fast, **FD)
    assert gradgradcheck(fn, inputs, fast_mode=fast, **FD)
    assert torch.equal(rm, rm0) and torch.equal(rv, rv0), "frozen statistics changed"


def _eager_layer(dims: int, strategy: str, act: Activation, rm: Tensor, rv: Tensor) -> Callable[..., Tensor]:
    module = act.module()

    def fn(*inputs: Tensor) -> Tensor:
        return module(_eager_pre_activation(dims, strategy, inputs, rm, rv))

    return fn


def _first_and_second(fn: Callable[..., Tensor], inputs: Sequence[Tensor], seed: int) -> Tuple[List[Tensor], ...]:
    """First-order grads (fast path and create_graph path) and the second-order grads of a
    random projection of the first-order ones w.r.t. the inputs *and* the upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    out = fn(*inputs)
    v = torch.randn(out.shape, generator=g, dtype=out.dtype).requires_grad_()
    fast = torch.autograd.grad(out, inputs, v.detach(), retain_graph=True)
    first = torch.autograd.grad(out, inputs, v, create_graph=True)
    us = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in first]
    s = sum((f * u).sum() for f, u in zip(first, us))
    second = torch.autograd.grad(s, [*inputs, v], allow_unused=True)
    second = [torch.zeros_like(t) if d is None else d for t, d in zip([*inputs, v], second)]
    return list(fast), [f.detach() for f in first], second


@pytest.mark.parametrize("dims", (1, 2, 3))
@pytest.mark.parametrize("act_id", list(ACTS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_second_derivatives_match_eager(strategy: str, act_id: str, dims: int) -> None:
    """Every activation, kinks included: the mixed second derivatives equal eager autograd's."""
    act, _ = ACTS[act_id]
    inputs, rm, rv = _layer_inputs(dims, seed=5)
    fast, first, second = _first_and_second(_fused_layer(dims, strategy, act, rm, rv), inputs, seed=1)
    _, e_first, e_second = _first_and_second(_eager_layer(dims, strategy, act, rm, rv), inputs, seed=1)
    names = ("x", "W", "b", "gamma", "beta", "grad_out")
    for name, a, b in zip(names, first, e_first):
        assert_close(a, b, **TIGHT, msg=lambda m: f"first-order d/d{name}: {m}")
    for name, a, b in zip(names, fast, first):
        assert_close(a, b, **TIGHT, msg=lambda m: f"fast vs create_graph first-order d/d{name}: {m}")
    for name, a, b in zip(names, second, e_second):
        assert_close(a, b, **TIGHT, msg=lambda m: f"second-order d/d{name}: {m}")


def test_third_order_through_the_rebuild() -> None:
    """The rebuild is plain differentiable ops, so higher orders work too (e.g. GP inside MAML)."""
    act = Activation("silu")
    inputs, rm, rv = _layer_inputs(2, seed=2)
    thirds = []
    for fn in (_fused_layer(2, "recompute_conv", act, rm, rv), _eager_layer(2, "recompute_conv", act, rm, rv)):
        out = fn(*inputs)
        (gx,) = torch.autograd.grad(out.pow(2).sum(), inputs[0], create_graph=True)
        (gw,) = torch.autograd.grad(gx.pow(2).sum(), inputs[1], create_graph=True)
        thirds.append(torch.autograd.grad(gw.sin().sum(), inputs[3])[0])
    assert_close(thirds[0], thirds[1], **TIGHT)


# --------------------------------------------------------------------------- models


class Discriminator(nn.Module):
    """A small CNN critic: three Conv -> BN (-> act) layers (one chain once converted) + a linear head."""

    def __init__(self, acts: Sequence[Callable[[], nn.Module]] = (nn.SiLU, lambda: nn.LeakyReLU(0.2), nn.Identity),
                 momentum: Optional[float] = 0.1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4, momentum=momentum)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4, momentum=momentum)
        self.conv3 = nn.Conv2d(4, 3, 2, padding="same")  # even kernel: constant pre-pad inside the chain
        self.bn3 = nn.BatchNorm2d(3, momentum=momentum)
        self.acts = nn.ModuleList([make() for make in acts])
        self.head = nn.Linear(3 * 3 * 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.acts[0](self.bn1(self.conv1(x)))
        x = self.acts[1](self.bn2(self.conv2(x)))
        x = self.acts[2](self.bn3(self.conv3(x)))
        return self.head(x.flatten(1))


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return model.double().train()


def _fused_blocks(eager: Discriminator, strategies: Sequence[str]) -> nn.Module:
    """The eager model with each Conv -> BN -> act replaced by a ``FusedConvBN2d`` sharing its
    modules (single-layer Functions; same parameter names via a ``blocks`` mapping)."""
    model = copy.deepcopy(eager)
    convs, bns = (model.conv1, model.conv2, model.conv3), (model.bn1, model.bn2, model.bn3)
    blocks = [
        FusedConvBN2d.from_modules(c, b, a, strategy=s) for c, b, a, s in zip(convs, bns, model.acts, strategies)
    ]

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = model.head
            self.blocks = nn.ModuleList(blocks)

        def forward(self, x: Tensor) -> Tensor:
            for blk in self.blocks:
                x = blk(x)
            return self.head(x.flatten(1))

    return Blocks()


def _eager_blocks(eager: Discriminator) -> nn.Module:
    """Eager twin of :func:`_fused_blocks` with the same parameter/buffer names."""
    model = copy.deepcopy(eager)
    seqs = [nn.Sequential(OrderedDict(conv=c, bn=b, act=a))
            for c, b, a in zip((model.conv1, model.conv2, model.conv3), (model.bn1, model.bn2, model.bn3), model.acts)]

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = model.head
            self.blocks = nn.ModuleList(seqs)

        def forward(self, x: Tensor) -> Tensor:
            for blk in self.blocks:
                x = blk(x)
            return self.head(x.flatten(1))

    return Blocks()


def _chains(model: nn.Module) -> List[FusedChain]:
    return [m for _, m in convbn.fused_modules(model) if isinstance(m, FusedChain)]


def _pair(case: str) -> Tuple[nn.Module, nn.Module]:
    """``(eager, fused)`` float64 twins in training mode with identical parameters and buffers."""
    eager = _randomize(Discriminator(), seed=3)
    if case in CONVERT_STRATEGIES:
        fused = convert_model(eager, case)
    elif case == "mixed_modes":
        fused = convert_model(eager, "recompute_bn")
        (chain,) = _chains(fused)
        chain.apply_plan(ChainPlan.of_modes(("recompute_conv", "recompute_bn", "recompute_conv")))
    elif case == "bn_eval":  # fine-tuning with one frozen BatchNorm inside the chain
        eager.bn2.eval()
        fused = convert_model(eager, "auto")
        assert not fused.bn2.training
    elif case == "momentum_none":
        eager = _randomize(Discriminator(momentum=None), seed=3)
        fused = convert_model(eager, "recompute_conv")
    elif case == "fused_modules":
        fused = _fused_blocks(eager, ("recompute_conv", "recompute_bn", "recompute_conv"))
        eager = _eager_blocks(eager)
    elif case == "fused_frozen":
        fused = _fused_blocks(eager, ("recompute_bn", "frozen", "recompute_conv"))
        eager = _eager_blocks(eager)
        eager.blocks[1].bn.eval()  # the eager meaning of strategy="frozen"
    else:  # pragma: no cover
        raise ValueError(case)
    return eager, fused


def convert_model(eager: nn.Module, strategy: str) -> nn.Module:
    """``convbn.convert`` of a deep copy; the Discriminator's three layers form one chain."""
    fused = convbn.convert(copy.deepcopy(eager), strategy=strategy)
    assert [len(c.layers) for c in _chains(fused)] == [3], "expected one 3-layer chain"
    return fused


CASES = (*CONVERT_STRATEGIES, "mixed_modes", "bn_eval", "momentum_none", "fused_modules", "fused_frozen")


def _params(model: nn.Module) -> "OrderedDict[str, nn.Parameter]":
    return OrderedDict(model.named_parameters())


def _assert_grads_equal(fused: nn.Module, eager: nn.Module, what: str) -> None:
    fp, ep = _params(fused), _params(eager)
    assert list(fp) == list(ep)
    for name in ep:
        a, b = fp[name].grad, ep[name].grad
        assert (a is None) == (b is None), f"{what}: {name} grad is None in one model only"
        if a is not None:
            assert_close(a, b, **TIGHT, msg=lambda m: f"{what}: grad of {name}: {m}")


def _assert_buffers_equal(fused: nn.Module, eager: nn.Module, forwards: int) -> None:
    """Running stats equal eager's, and each training BN counted exactly ``forwards`` batches."""
    fb, eb = OrderedDict(fused.named_buffers()), OrderedDict(eager.named_buffers())
    assert list(fb) == list(eb)
    bn_training = {n: m.training for n, m in eager.named_modules() if isinstance(m, nn.BatchNorm2d)}
    for name in eb:
        if name.endswith("num_batches_tracked"):
            training = bn_training[name.rpartition(".")[0]]
            assert int(fb[name]) == int(eb[name]) == (forwards if training else 0), name
        else:
            assert_close(fb[name], eb[name], **TIGHT, msg=lambda m: f"buffer {name}: {m}")


def _batch(seed: int, n: int = 4) -> Tensor:
    return torch.randn(n, 2, 6, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("case", CASES)
def test_maml_step_matches_eager(case: str) -> None:
    """Inner SGD step with create_graph=True, outer loss at the fast weights, outer.backward()."""
    eager, fused = _pair(case)
    x1, x2 = _batch(1), _batch(2)
    t1 = torch.randn(4, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    t2 = torch.randn(4, 1, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    lr = 0.3
    for model in (eager, fused):
        params = _params(model)
        inner = F.mse_loss(model(x1), t1)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True, allow_unused=True)
        fast = {n: p if g is None else p - lr * g for (n, p), g in zip(params.items(), grads)}
        state = {**fast, **dict(model.named_buffers())}
        outer = F.mse_loss(functional_call(model, state, (x2,)), t2)
        outer.backward()
    _assert_grads_equal(fused, eager, f"MAML [{case}]")
    _assert_buffers_equal(fused, eager, forwards=2)


@pytest.mark.parametrize("case", CASES)
def test_wgan_gp_matches_eager(case: str) -> None:
    """``gp = ((||dD(x_hat)/dx_hat||_2 - 1)^2).mean()``; ``(D(x).mean() + gp).backward()``."""
    eager, fused = _pair(case)
    real, fake = _batch(5), _batch(6)
    alpha = torch.rand(4, 1, 1, 1, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    upstream = torch.randn(4, 1, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    grads_x = []
    for model in (eager, fused):
        x_hat = (alpha * real + (1 - alpha) * fake).requires_grad_()
        (gx,) = torch.autograd.grad(model(x_hat), x_hat, upstream, create_graph=True)
        gp = ((gx.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
        (model(real).mean() + 10.0 * gp).backward()
        grads_x.append(gx.detach())
    assert_close(grads_x[1], grads_x[0], **TIGHT)
    _assert_grads_equal(fused, eager, f"WGAN-GP [{case}]")
    _assert_buffers_equal(fused, eager, forwards=2)


@pytest.mark.parametrize("case", CASES)
def test_hessian_vector_product_matches_eager(case: str) -> None:
    """``H v`` of the loss w.r.t. all parameters, by double backward."""
    eager, fused = _pair(case)
    x = _batch(9)
    target = torch.randn(4, 1, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    vs = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in eager.parameters()]
    hvps = []
    for model in (eager, fused):
        params = list(model.parameters())
        loss = F.mse_loss(model(x), target)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        hv = torch.autograd.grad(grads, params, vs, allow_unused=True)
        hvps.append([torch.zeros_like(p) if h is None else h for p, h in zip(params, hv)])
    for name, a, b in zip(_params(eager), hvps[1], hvps[0]):
        assert_close(a, b, **TIGHT, msg=lambda m: f"Hv [{case}] w.r.t. {name}: {m}")
    assert any(h.abs().max() > 0 for h in hvps[0][:-2]), "degenerate test: zero Hessian-vector product"
    _assert_buffers_equal(fused, eager, forwards=1)


def test_wgan_gp_on_a_monai_resnet_matches_eager() -> None:
    """A real third-party model (residual blocks, several chains, in-place residual adds)."""
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    eager = _randomize(nets.resnet10(spatial_dims=2, n_input_channels=2, num_classes=3, conv1_t_stride=2), seed=1)
    fused = convbn.convert(copy.deepcopy(eager), strategy="auto")
    assert len(_chains(fused)) > 1
    x_hat = torch.randn(2, 2, 24, 24, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    upstream = torch.randn(2, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for model in (eager, fused):
        x = x_hat.clone().requires_grad_()
        (gx,) = torch.autograd.grad(model(x), x, upstream, create_graph=True)
        ((gx.flatten(1).norm(2, dim=1) - 1) ** 2).mean().backward()
    _assert_grads_equal(fused, eager, "WGAN-GP [monai resnet10]")
    _assert_buffers_equal(fused, eager, forwards=1)


def test_chain_gradcheck_and_gradgradcheck_mixed_modes() -> None:
    """``ChainFunction`` itself, through a converted 3-layer chain whose layers keep / recompute
    differently and whose middle BatchNorm normalises with running statistics."""
    eager = _randomize(Discriminator(acts=(nn.SiLU, nn.GELU, nn.Identity)), seed=4)
    eager.bn2.eval()
    fused = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    (chain,) = _chains(fused)
    chain.apply_plan(ChainPlan.of_modes(("recompute_conv", "recompute_bn", "recompute_conv")))
    names = list(_params(fused))
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    inputs = [x.requires_grad_(), *[p.detach().clone().requires_grad_() for p in fused.parameters()]]

    def fn(x: Tensor, *params: Tensor) -> Tensor:
        return functional_call(fused, dict(zip(names, params)), (x,))

    assert gradcheck(fn, inputs, **FD)
    assert gradgradcheck(fn, inputs, **FD)


# --------------------------------------------------------------------------- first order untouched


@pytest.fixture
def rebuild_calls(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], List[int]]:
    """Patch the reference rebuild where the autograd modules look it up.

    ``arm(forbid)``: with ``forbid=True`` any call raises; otherwise calls are counted.
    """
    real = fused_mod.conv_bn_act_reference
    calls: List[int] = []
    state = {"forbid": True}

    def spy(*args: Any, **kwargs: Any) -> Tensor:
        if state["forbid"]:
            raise AssertionError("the first-order backward called the reference rebuild")
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_mod, "conv_bn_act_reference", spy)
    monkeypatch.setattr(chain_mod, "conv_bn_act_reference", spy)

    def arm(forbid: bool) -> List[int]:
        state["forbid"] = forbid
        calls.clear()
        return calls

    return arm


MODEL_KINDS = tuple(f"convert_{s}" for s in CONVERT_STRATEGIES) + ("fused_modules",)


def _model(kind: str) -> nn.Module:
    eager = _randomize(Discriminator(), seed=6)
    if kind == "fused_modules":
        return _fused_blocks(eager, ("recompute_conv", "recompute_bn", "frozen"))
    return convert_model(eager, kind[len("convert_"):])


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_first_order_backward_never_rebuilds(kind: str, rebuild_calls: Callable[[bool], List[int]]) -> None:
    model = _model(kind)
    rebuild_calls(True)
    x = _batch(12).requires_grad_()
    model(x).pow(2).mean().backward()
    torch.autograd.grad(model(x).sum(), x)  # autograd.grad without create_graph: fast path too
    assert x.grad is not None and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_create_graph_uses_the_rebuild(kind: str, rebuild_calls: Callable[[bool], List[int]]) -> None:
    model = _model(kind)
    calls = rebuild_calls(False)
    x = _batch(13).requires_grad_()
    (gx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    # one reference Conv -> BN -> act per fused layer (3), whether chained or not
    assert len(calls) == 3, f"create_graph=True rebuilt {len(calls)} layers, expected 3"
    gx.pow(2).sum().backward()  # second order: differentiates the rebuilt graph, rebuilds nothing more
    assert len(calls) == 3
    assert all(p.grad is not None for p in model.parameters() if p.dim() == 4), "a conv weight got no gradient"
