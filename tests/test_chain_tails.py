"""Chains with general layers: element-wise tails (activations, PReLU, dropout), a
pre-activation head (BN -> tail -> conv, no conv of its own) and an end layer (a conv
with no BN after it), against the same modules run eagerly.

Each case runs three training steps (random upstream gradients, then ``.sum()``) under
the same seed for eager and fused and compares outputs, every gradient (PReLU weights
included), running statistics, ``num_batches_tracked`` and the global RNG state after
the step (a dropout must draw exactly what eager draws), in float64 at 1e-10.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from convbn.autograd.chain_plan import ChainPlan
from convbn.autograd.chain import ChainFunction, ChainLayerSpec
from convbn.autograd.chain_op import _chain_fwd, chain_op_apply, register_chain
from convbn.functional.activations import ACTIVATIONS, Activation
from convbn.functional.batchnorm import BNSpec
from convbn.functional.conv import conv_spec_from_module, make_conv_spec
from convbn.functional.tail import DropoutOp, PReLUOp
from convbn.memory import saved_bytes
from convbn.nn.chain import LAYER_MODES, ChainLayer, FusedChain
from convbn.passes.plan.peak_model import ChainCost, chain_backward_peak

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
TRANSPOSED = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
FEATURE_DROP = {1: nn.Dropout1d, 2: nn.Dropout2d, 3: nn.Dropout3d}
SPATIAL = {1: (7,), 2: (5, 4), 3: (3, 4, 3)}
TOL = dict(rtol=1e-10, atol=1e-10)

#: one layer: (has conv, has BN, tail factories)
Desc = Tuple[bool, bool, Sequence[Callable[[int], nn.Module]]]


class Holder(nn.Module):
    """Registers the modules a FusedChain reads (a chain holds them unregistered)."""

    def __init__(self, body: nn.Sequential, chain: FusedChain) -> None:
        super().__init__()
        self.body = body
        self.chain = chain

    def forward(self, x: Tensor) -> Tensor:
        return self.chain(x)


def build(dims: int, c_in: int, desc: Sequence[Desc], mode, dtype=torch.float64, seed=0, conv_kind: str = "conv"):
    """``(eager Sequential, fused Holder)`` sharing nothing, equal in value. ``mode``: one
    per layer or one for all; ``conv_kind``: ``conv``, ``transposed`` or ``linear`` (dims 1)."""
    torch.manual_seed(seed)
    mods: List[nn.Module] = []
    per_layer: List[Tuple[Optional[nn.Module], Optional[nn.Module], List[nn.Module]]] = []
    c = c_in
    for i, (has_conv, has_bn, tail) in enumerate(desc):
        conv = bn = None
        if has_conv:
            if conv_kind == "linear":
                conv = nn.Linear(c, c + 1, bias=i % 2 == 0, dtype=dtype)
            elif conv_kind == "transposed":
                conv = TRANSPOSED[dims](c, c + 1, 3, stride=2, padding=1, output_padding=1, bias=i % 2 == 0, dtype=dtype)
            else:
                conv = CONV[dims](c, c + 1, 3, padding=1, bias=i % 2 == 0, dtype=dtype)
            c += 1
            mods.append(conv)
        if has_bn:
            bn = BN[dims](c, dtype=dtype)
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
            mods.append(bn)
        ts = [f(c) for f in tail]
        for t in ts:
            if isinstance(t, nn.PReLU):
                t.to(dtype)
                with torch.no_grad():
                    t.weight.uniform_(0.05, 0.5)
        mods += ts
        per_layer.append((conv, bn, ts))
    eager = nn.Sequential(*mods)
    body = copy.deepcopy(eager)
    it = iter(body)
    modes = [mode] * len(desc) if isinstance(mode, str) else list(mode)
    layers = []
    for (conv, bn, ts), m in zip(per_layer, modes):
        fc = next(it) if conv is not None else None
        fb = next(it) if bn is not None else None
        ft = tuple(next(it) for _ in ts)
        layers.append(ChainLayer(
            fc, "weight", None if fc is None or fc.bias is None else "bias",
            None if fc is None else conv_spec_from_module(fc), fb, mode=m,
            names=("conv" if fc is not None else "", "bn" if fb is not None else "", *(type(t).__name__ for t in ft)),
            tail=ft))
    return eager, Holder(body, FusedChain(layers))


def step_pair(eager: nn.Module, fused: nn.Module, x: Tensor, steps: int = 3, lr: float = 0.05) -> None:
    """Train both for ``steps`` (same seed per step); compare everything after each step."""
    xe = x.clone().requires_grad_()
    xf = x.clone().requires_grad_()
    for step in range(steps):
        torch.manual_seed(1000 + step)
        out_e = eager(xe)
        gen = torch.Generator().manual_seed(step)
        up = torch.randn(out_e.shape, generator=gen, dtype=out_e.dtype) if step < steps - 1 else None
        (out_e.backward(up) if up is not None else out_e.sum().backward())
        rng_e = torch.get_rng_state()
        torch.manual_seed(1000 + step)
        out_f = fused(xf)
        (out_f.backward(up) if up is not None else out_f.sum().backward())
        rng_f = torch.get_rng_state()
        assert torch.equal(rng_e, rng_f), f"step {step}: the global RNG stream differs from eager's"
        assert_close(out_f, out_e, **TOL)
        assert_close(xf.grad, xe.grad, **TOL)
        pe, pf = dict(eager.named_parameters()), dict(fused.body.named_parameters())
        assert pe.keys() == pf.keys()
        for name in pe:
            assert pf[name].grad is not None, f"{name}: no gradient"
            assert_close(pf[name].grad, pe[name].grad, **TOL, msg=lambda m: f"{name} grad: {m}")
        for (name, be), bf in zip(eager.named_buffers(), fused.body.buffers()):
            assert_close(bf, be, **TOL, msg=lambda m: f"{name}: {m}")
        with torch.no_grad():
            for p in list(eager.parameters()) + list(fused.body.parameters()):
                p -= lr * p.grad


def no_grad_forward_pair(eager: nn.Module, fused: nn.Module, x: Tensor, seed: int) -> None:
    """One no-grad forward of each from the same seed: equal outputs, and the fused model
    leaves the global RNG exactly where eager left it (dropouts draw the same numbers)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        want = eager(x)
    rng = torch.get_rng_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        got = fused(x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert_close(got, want, **TOL)


def x_for(dims: int, c: int, dtype=torch.float64, n: int = 3) -> Tensor:
    return torch.randn(n, c, *SPATIAL[dims], generator=torch.Generator().manual_seed(7), dtype=dtype)


def act_module(name: str) -> Callable[[int], nn.Module]:
    return lambda c: Activation(name).module()


DROPS = {
    "none": lambda act: [act],
    "drop_before": lambda act: [lambda c: nn.Dropout(0.3), act],
    "drop_after": lambda act: [act, lambda c: nn.Dropout(0.3)],
    "drop2d_after": lambda act: [act, lambda c: nn.Dropout2d(0.3)],
}


def structure(name: str, tail: Sequence[Callable[[int], nn.Module]]) -> List[Desc]:
    if name == "plain":
        return [(True, True, tail), (True, True, tail)]
    if name == "preact":  # PreAct-ResNet body: BN -> tail -> conv -> BN -> tail -> conv
        return [(False, True, tail), (True, True, tail), (True, False, [])]
    raise ValueError(name)


@pytest.mark.parametrize("shape", ["plain", "preact"])
@pytest.mark.parametrize("mode", LAYER_MODES)
@pytest.mark.parametrize("drop", list(DROPS))
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activation_dropout_grid(act: str, drop: str, mode: str, shape: str) -> None:
    eager, fused = build(2, 3, structure(shape, DROPS[drop](act_module(act))), mode)
    step_pair(eager, fused, x_for(2, 3))


@pytest.mark.parametrize("mode", LAYER_MODES)
@pytest.mark.parametrize("shape", ["plain", "preact"])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_dims_with_feature_dropout(dims: int, shape: str, mode: str) -> None:
    tail = [lambda c: nn.ReLU(), lambda c, d=dims: FEATURE_DROP[d](0.4)]
    eager, fused = build(dims, 2, structure(shape, tail), mode)
    step_pair(eager, fused, x_for(dims, 2))


@pytest.mark.parametrize("mode", LAYER_MODES)
@pytest.mark.parametrize("cls", [nn.Dropout, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.Dropout2d])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_every_dropout_kind(cls: type, p: float, mode: str) -> None:
    eager, fused = build(2, 3, [(True, True, [lambda c: nn.SELU(), lambda c: cls(p)]),
                                (True, True, [lambda c: cls(p), lambda c: nn.SiLU()]), (True, False, [])], mode)
    step_pair(eager, fused, x_for(2, 3))


@pytest.mark.parametrize("inplace", [False, True])
def test_inplace_modules_in_a_tail(inplace: bool) -> None:
    tail = [lambda c: nn.Dropout(0.5, inplace=inplace), lambda c: nn.ReLU(inplace=inplace)]
    eager, fused = build(2, 3, structure("preact", tail), "recompute_conv")
    step_pair(eager, fused, x_for(2, 3))


@pytest.mark.parametrize("mode", LAYER_MODES)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("where", ["head", "middle", "end"])
def test_prelu(where: str, per_channel: bool, mode: str) -> None:
    prelu = lambda c: nn.PReLU(c if per_channel else 1)  # noqa: E731
    if where == "head":
        desc = [(False, True, [prelu]), (True, True, [lambda c: nn.ReLU()]), (True, False, [])]
    elif where == "middle":  # MONAI's Conv -> BN -> Dropout -> PReLU
        desc = [(True, True, [lambda c: nn.Dropout(0.2), prelu]), (True, True, [prelu])]
    else:  # an end layer with a tail: conv -> PReLU, no BN
        desc = [(True, True, [prelu]), (True, False, [prelu])]
    eager, fused = build(2, 3, desc, mode)
    step_pair(eager, fused, x_for(2, 3))


@pytest.mark.parametrize("modes", [("recompute_bn", "recompute_conv", "recompute_bn"),
                                   ("recompute_conv", "recompute_bn", "recompute_conv")])
def test_head_middle_end_mixed_modes(modes: Tuple[str, ...]) -> None:
    desc = [(False, True, [lambda c: nn.ReLU()]), (True, True, [lambda c: nn.GELU()]),
            (True, True, [lambda c: nn.ReLU()]), (True, False, [])]
    eager, fused = build(2, 3, desc, list(modes) + ["recompute_bn"])
    step_pair(eager, fused, x_for(2, 3))


@pytest.mark.parametrize("shape", ["head_only", "head_end", "end_only"])
def test_two_layer_edge_chains(shape: str) -> None:
    desc = {"head_only": [(False, True, [lambda c: nn.ReLU()])],
            "head_end": [(False, True, [lambda c: nn.SiLU(), lambda c: nn.Dropout(0.2)]), (True, False, [])],
            "end_only": [(True, False, [lambda c: nn.ReLU()])]}[shape]
    eager, fused = build(2, 3, desc, "recompute_bn")
    step_pair(eager, fused, x_for(2, 3))


def test_eval_mode_is_eager_eval() -> None:
    """Eval BN, dropouts as identities (no RNG drawn), with and without gradients."""
    desc = structure("preact", [lambda c: nn.Dropout(0.5), lambda c: nn.PReLU(c)])
    eager, fused = build(2, 3, desc, "recompute_bn")
    step_pair(eager, fused, x_for(2, 3), steps=1)
    eager.eval()
    fused.eval()
    x = x_for(2, 3)
    no_grad_forward_pair(eager, fused, x, seed=5)
    step_pair(eager, fused, x, steps=2)


def test_no_grad_training_forward_draws_like_eager() -> None:
    eager, fused = build(2, 3, structure("preact", [lambda c: nn.ReLU(), lambda c: nn.Dropout(0.5)]), "recompute_bn")
    no_grad_forward_pair(eager, fused, x_for(2, 3), seed=3)
    for be, bf in zip(eager.buffers(), fused.body.buffers()):
        assert_close(bf, be, **TOL)


def test_hooked_tail_module_runs_eagerly() -> None:
    """A hook registered on a tail module after the chain was built: the chain runs as eager modules."""
    eager, fused = build(2, 3, structure("preact", [lambda c: nn.ReLU(), lambda c: nn.Dropout(0.3)]), "recompute_bn")
    seen: List[int] = []
    fused.body[1].register_forward_hook(lambda m, i, o: seen.append(1))
    eager[1].register_forward_hook(lambda m, i, o: None)
    step_pair(eager, fused, x_for(2, 3), steps=2)
    assert len(seen) == 2


# --------------------------------------------------------------------------- Functions directly


def _small_specs(drop: bool) -> List[ChainLayerSpec]:
    conv = make_conv_spec(2, (3, 3), padding=1)
    head_tail = (PReLUOp(3),) + ((DropoutOp("dropout", 0.4),) if drop else ())
    return [ChainLayerSpec(None, BNSpec(1e-5, True, 0.0), Activation("identity"), True, head_tail),
            ChainLayerSpec(conv, BNSpec(1e-5, True, 0.0), Activation("silu"), False),
            ChainLayerSpec(conv, None, Activation("identity"), True, (PReLUOp(1),))]


def _small_params() -> List[Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (3,), (3,), (3, 3, 3, 3), (3,), (3,), (3,), (2, 3, 3, 3), (2,), (1,)]
    return [(torch.rand(s, generator=g, dtype=torch.float64) * 0.5 + 0.1).requires_grad_() for s in shapes]


@pytest.mark.parametrize("drop", [False, True])
def test_gradcheck_and_gradgradcheck_head_prelu_end(drop: bool) -> None:
    specs = tuple(_small_specs(drop))
    stats = ((None, None),) * 3
    params = _small_params()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def fn(x: Tensor, *ps: Tensor) -> Tensor:
        torch.manual_seed(0)  # every evaluation draws the same dropout mask
        return ChainFunction.apply(x, *ps, specs, stats)

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradgradcheck(fn, (x, *params), eps=1e-6, atol=1e-5)


def test_custom_op_matches_chain_function_on_head_prelu_end() -> None:
    """The torch.compile path (custom op) runs heads, PReLU tails and end layers too."""
    specs = _small_specs(False)
    structure = register_chain([(s.conv, s.act, None if s.bn is None else s.bn.eps, s.tail) for s in specs])  # held: the op finds it while it lives
    key = structure.key
    params = _small_params()
    stats = [(None, None)] * 3
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    out_op = chain_op_apply(key, x, params, specs, stats)
    out_fn = ChainFunction.apply(x, *params, tuple(specs), tuple(stats))
    assert_close(out_op, out_fn, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out_op)
    for a, b in zip(torch.autograd.grad(out_op, [x, *params], g), torch.autograd.grad(out_fn, [x, *params], g)):
        assert_close(a, b, rtol=1e-12, atol=1e-12)
    dense = [p.detach().requires_grad_() for p in params]
    args = ([x], dense, [], torch.zeros(3, dtype=torch.float64), key, [s.keep_y for s in specs],
            [s.bn is not None for s in specs], [False] * 3, [True] * len(dense), [s.may_drop for s in specs])
    torch.library.opcheck(_chain_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# --------------------------------------------------------------------------- memory


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("mode", LAYER_MODES)
@pytest.mark.parametrize("tail", ["relu", "prelu_dropout"])
def test_saved_bytes_of_a_head_chain(mode: str, tail: str) -> None:
    """A PreAct body keeps x0 (the head's BN input), the middle conv output where its mode
    keeps it, and per BN its (C,) mean / invstd: the head keeps nothing else, the end layer
    nothing at all, dropout masks are regenerated (nothing kept)."""
    tails = {"relu": [lambda c: nn.ReLU()], "prelu_dropout": [lambda c: nn.PReLU(c), lambda c: nn.Dropout(0.3)]}[tail]
    _, fused = build(2, 4, structure("preact", tails), mode, dtype=torch.float32)
    x = torch.randn(3, 4, 6, 5, requires_grad=True)
    r = saved_bytes(fused, x)
    y1 = (3, 5, 6, 5)
    want = _nbytes(x.shape, torch.float32) + 2 * _nbytes((4,), torch.float32) + 2 * _nbytes((5,), torch.float32)
    if mode == "recompute_bn":
        want += _nbytes(y1, torch.float32)
    assert r.activation_bytes == want, r.shapes
    assert sorted(s for _, s, _, _ in r.shapes if len(s) == 4) == sorted([tuple(x.shape)] + ([y1] if mode == "recompute_bn" else []))


# --------------------------------------------------------------------------- errors


def test_layer_errors_name_the_problem() -> None:
    bn = nn.BatchNorm2d(3)
    conv = nn.Conv2d(3, 3, 1)
    spec = conv_spec_from_module(conv)
    with pytest.raises(ValueError, match="neither"):
        ChainLayer()
    with pytest.raises(ValueError, match="not both"):
        ChainLayer(conv, "weight", "bias", spec, bn, Activation("relu"), tail=(nn.ReLU(),))
    with pytest.raises(TypeError, match="Linear"):
        ChainLayer(conv, "weight", "bias", spec, bn, tail=(nn.Linear(2, 2),))
    head = ChainLayer(bn=bn, tail=(nn.ReLU(),))
    mid = ChainLayer(conv, "weight", "bias", spec, nn.BatchNorm2d(3))
    end = ChainLayer(conv, "weight", "bias", spec)
    with pytest.raises(ValueError, match="first layer"):
        FusedChain([mid, head])
    with pytest.raises(ValueError, match="last layer"):
        FusedChain([end, mid])
    chain = FusedChain([head, mid, end])
    with pytest.raises(RuntimeError, match="channels"):
        chain(torch.randn(2, 4, 5, 5))
    with pytest.raises(ValueError, match="4D"):
        chain(torch.randn(2, 3, 5))
    assert "(head)" in repr(chain) and "(end)" in repr(chain)


def test_single_activation_tail_takes_the_fast_path() -> None:
    layer = ChainLayer(nn.Conv2d(2, 2, 1), "weight", "bias", make_conv_spec(2, (1, 1)), nn.BatchNorm2d(2),
                       tail=(Activation("relu"),))
    assert layer.tail == () and layer.act == Activation("relu")


@pytest.mark.parametrize("mode", LAYER_MODES)
@pytest.mark.parametrize("tail", ["relu", "silu", "prelu_dropout", "dropout_prelu", "relu_dropout_inplace"])
def test_measured_backward_matches_the_replay_for_head_and_end(tail: str, mode: str) -> None:
    """The planner's replay of a head/end chain's backward (sizes only) predicts the measured
    transient to within the chain's parameter gradients."""
    from convbn.memory import timeline

    tails = {"relu": [lambda c: nn.ReLU()], "silu": [lambda c: nn.SiLU()],
             "prelu_dropout": [lambda c: nn.PReLU(c), lambda c: nn.Dropout(0.3)],
             "dropout_prelu": [lambda c: nn.Dropout(0.3), lambda c: nn.PReLU()],
             "relu_dropout_inplace": [lambda c: nn.ReLU(), lambda c: nn.Dropout(0.3, inplace=True)]}[tail]
    _, fused = build(2, 4, structure("preact", tails), mode, dtype=torch.float32)
    x, proj = torch.randn(8, 4, 16, 16), torch.randn(8, 6, 16, 16)

    def loss(out: Tensor) -> Tensor:
        return (out * proj).sum()

    loss(fused(x)).backward()
    for p in fused.parameters():
        p.grad = None
    tl = timeline(fused, x, loss_fn=loss)
    layers = fused.chain.layers
    cost = ChainCost(tuple(l.y_bytes() for l in layers), tuple(_nbytes(l.x_shape, torch.float32) for l in layers),
                     tuple(l.flops() for l in layers), tuple(l.tail_kind() for l in layers), head=True, end=True)
    keep = [l.mode == "recompute_bn" for l in layers]
    predicted, _ = chain_backward_peak(cost, keep)
    idx = [i for i, p in enumerate(tl.points) if p.op.startswith("ChainFunctionBackward/")]
    before = tl.points[idx[0] - 1].bytes  # the incoming gradient and the kept outputs are alive
    alive = cost.kept_bytes(keep) + cost.y_bytes[-1]
    measured = max(tl.points[i].bytes for i in idx) - (before - alive)
    params = sum(p.numel() * 4 for p in fused.parameters())
    assert predicted <= measured <= predicted + params, (predicted, measured)


def test_autocast_head_chain_runs_as_eager() -> None:
    """Under autocast a head's BN sees the un-cast input (eager's order): the chain runs its modules."""
    eager, fused = build(2, 3, structure("preact", [lambda c: nn.ReLU()]), "recompute_bn", dtype=torch.float32)
    x = torch.randn(2, 3, 5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = eager(x), fused(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


@pytest.mark.slow
def test_torch_compile_head_prelu_end_chain_matches_eager() -> None:
    """fullgraph compile: a head + PReLU + end chain runs as the custom op (a dropout in eval
    mode is an identity there), gradients as eager's."""
    desc = [(False, True, [lambda c: nn.PReLU(c), lambda c: nn.Dropout(0.3)]), (True, True, [lambda c: nn.ReLU()]),
            (True, False, [])]
    eager, fused = build(2, 3, desc, "recompute_conv", dtype=torch.float32)
    eager[2].eval()
    fused.body[2].eval()
    compiled = torch.compile(fused, fullgraph=True)
    x = x_for(2, 3, dtype=torch.float32)
    out, out_e = compiled(x), eager(x)
    g = torch.randn_like(out)
    out.backward(g)
    out_e.backward(g)
    assert_close(out, out_e, rtol=1e-4, atol=1e-5)
    for p, pe in zip(fused.body.parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, rtol=1e-3, atol=1e-4)
    for b, be in zip(fused.body.buffers(), eager.buffers()):
        assert_close(b, be, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_torch_compile_with_active_dropout_runs_the_eager_modules() -> None:
    """A dropout in training under torch.compile: the chain runs as its eager modules, so the
    compiled converted chain gives what the compiled eager model gives. Dynamo's caches are
    emptied first: a compile of another dropout chain earlier in the process (whose frames the
    same module classes hit) made the two compiled models differ."""
    torch._dynamo.reset()
    desc = structure("preact", [lambda c: nn.ReLU(), lambda c: nn.Dropout(0.3)])
    eager, fused = build(2, 3, desc, "recompute_bn", dtype=torch.float32)
    x = x_for(2, 3, dtype=torch.float32)
    outs = []
    for model in (eager, fused):
        torch.manual_seed(0)
        outs.append(torch.compile(model, fullgraph=True)(x))
    assert torch.equal(outs[0], outs[1])


def test_planner_counts_what_head_and_end_layers_keep() -> None:
    """A head keeps nothing beyond x0, an end layer without tail nothing: the planner's kept
    bytes are the middle conv output only, and the measured saved bytes agree."""
    from convbn.passes.plan.planner import all_keep_bytes, plan_layers

    _, fused = build(2, 4, structure("preact", [lambda c: nn.ReLU()]), "recompute_conv", dtype=torch.float32)
    x = torch.randn(3, 4, 6, 5)
    floor = saved_bytes(fused, x).activation_bytes
    layers = fused.chain.layers
    assert all_keep_bytes([layers]) == _nbytes((3, 5, 6, 5), torch.float32)
    keep = plan_layers(layers, all_keep_bytes([layers]))  # pure: flags out, layers unchanged
    assert keep[1] and all(l.mode == "recompute_conv" for l in layers)
    fused.chain.apply_plan(ChainPlan.of_modes(["recompute_bn" if k else "recompute_conv" for k in keep]))
    used = sum(l.keep_bytes() for l, k in zip(layers, keep) if k)
    assert used == all_keep_bytes([layers])
    assert saved_bytes(fused, x).activation_bytes == floor + used
    assert not plan_layers(layers, 0)[1]


@pytest.mark.parametrize("end_tail", [False, True])
def test_autocast_prelu_and_dropout_tails_cast_like_eager(end_tail: bool) -> None:
    """CPU autocast runs prelu in bfloat16 (its weight cast like a conv's): same output as
    eager, gradients within bfloat16 rounding of eager's."""
    desc = [(True, True, [lambda c: nn.Dropout(0.2), lambda c: nn.PReLU(c)])]
    desc.append((True, False, [lambda c: nn.PReLU()]) if end_tail else (True, True, [lambda c: nn.PReLU()]))
    eager, fused = build(2, 3, desc, "recompute_bn", dtype=torch.float32)
    x = x_for(2, 3, dtype=torch.float32)
    outs = []
    for model in (eager, fused):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
        outs.append(out)
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])
    pe, pf = list(eager.parameters()), list(fused.body.parameters())
    scale = max(p.grad.abs().max().item() for p in pe)
    for p, q in zip(pe, pf):
        assert_close(q.grad, p.grad, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("mode", LAYER_MODES)
def test_double_backward_gradient_penalty_matches_eager(mode: str) -> None:
    """create_graph=True through a head + dropout + PReLU + end chain: the reference rebuild
    replays forward's dropout masks, so a gradient penalty's gradients equal eager's."""
    desc = [(False, True, [lambda c: nn.PReLU(c), lambda c: nn.Dropout(0.3)]),
            (True, True, [lambda c: nn.Dropout2d(0.3), lambda c: nn.SiLU()]), (True, False, [])]
    eager, fused = build(2, 3, desc, mode)
    x = x_for(2, 3)
    grads = []
    for model in (eager, fused):
        xi = x.clone().requires_grad_()
        torch.manual_seed(4)
        out = model(xi)
        params = list(model.parameters())
        gs = torch.autograd.grad((out * out).sum(), [xi, *params], create_graph=True)
        sum(g.square().sum() for g in gs).backward()
        grads.append([xi.grad] + [p.grad for p in params])
    for a, b in zip(*grads):
        assert_close(b, a, **TOL)


def test_channels_last_dropout_chain_matches_eager() -> None:
    eager, fused = build(2, 3, structure("preact", [lambda c: nn.ReLU(), lambda c: nn.Dropout(0.3)]), "recompute_conv")
    eager.to(memory_format=torch.channels_last)
    fused.to(memory_format=torch.channels_last)
    step_pair(eager, fused, x_for(2, 3).contiguous(memory_format=torch.channels_last))


def test_frozen_prelu_weight_gets_no_gradient() -> None:
    desc = [(True, True, [lambda c: nn.PReLU(c)]), (True, True, [lambda c: nn.Dropout(0.2), lambda c: nn.PReLU()])]
    eager, fused = build(2, 3, desc, "recompute_conv")
    for model in (eager, fused):
        for m in model.modules():
            if isinstance(m, nn.PReLU):
                m.weight.requires_grad_(False)
    x = x_for(2, 3)
    grads = []
    for model in (eager, fused):
        torch.manual_seed(2)
        model(x).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert_close(b, a, **TOL)


@pytest.mark.parametrize("mode", LAYER_MODES)
@pytest.mark.parametrize("kind", ["transposed", "linear"])
def test_tails_heads_and_ends_with_transposed_and_linear_layers(kind: str, mode: str) -> None:
    """The layer model is independent of the conv geometry: a decoder's transposed convs and
    an MLP's Linear -> BatchNorm1d with dropout / PReLU tails, pre-activation head and end."""
    tail = [lambda c: nn.Dropout(0.3), lambda c: nn.PReLU(c)]
    eager, fused = build(2 if kind == "transposed" else 1, 3, structure("preact", tail), mode, conv_kind=kind)
    x = x_for(2, 3) if kind == "transposed" else torch.randn(6, 3, generator=torch.Generator().manual_seed(7),
                                                             dtype=torch.float64)
    step_pair(eager, fused, x)
