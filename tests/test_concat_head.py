"""A chain head over a concatenation (issue 11): the head's input given as pieces.

``FusedChain(head(BN, act), (conv1, BN, act), (conv2 end))`` called with pieces must equal
eager ``conv2(act(BN(conv1(act(BN(torch.cat(pieces, 1)))))))`` exactly: outputs, the
pieces' gradients, every parameter gradient, running statistics and
``num_batches_tracked`` over several steps (float64, 1e-10); the chain keeps the pieces,
never their concatenation; gradcheck / gradgradcheck and the custom op with pieces.
"""
from __future__ import annotations

import copy
import math
from typing import List, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from convbn.autograd.chain import ChainFunction, ChainLayerSpec
from convbn.autograd.chain_input import ChainInput, concat_shape, split_grad
from convbn.autograd.chain_op import _chain_fwd, chain_op_apply, register_chain
from convbn.functional.activations import Activation
from convbn.functional.batchnorm import BNSpec
from convbn.functional.conv import conv_spec_from_module, make_conv_spec
from convbn.memory import saved_bytes
from convbn.nn.chain import ChainLayer, FusedChain

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
SPATIAL = {1: (7,), 2: (5, 4), 3: (3, 4, 3)}
TOL = dict(rtol=1e-10, atol=1e-10)


class DenseLayer(nn.Module):
    """Eager reference: BN -> act -> 1x1 conv -> BN -> act -> 3x3 conv on ``cat(pieces, 1)``."""

    def __init__(self, dims: int, c_in: int, growth: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        make_act = {"relu": nn.ReLU, "silu": nn.SiLU}[act]
        self.norm1 = BN[dims](c_in, dtype=dtype)
        self.act1 = make_act()
        self.conv1 = CONV[dims](c_in, 2 * growth, 1, bias=False, dtype=dtype)
        self.norm2 = BN[dims](2 * growth, dtype=dtype)
        self.act2 = make_act()
        self.conv2 = CONV[dims](2 * growth, growth, 3, padding=1, bias=True, dtype=dtype)
        with torch.no_grad():
            for bn in (self.norm1, self.norm2):
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)

    def forward(self, *pieces: Tensor) -> Tensor:
        x = torch.cat(pieces, 1)
        return self.conv2(self.act2(self.norm2(self.conv1(self.act1(self.norm1(x))))))


class Fused(nn.Module):
    """The same modules, run as one head chain called with the pieces."""

    def __init__(self, body: DenseLayer, modes: Tuple[str, str]) -> None:
        super().__init__()
        self.body = body
        b = body
        self.chain = FusedChain([
            ChainLayer(bn=b.norm1, tail=(b.act1,), names=("", "norm1", "act1")),
            ChainLayer(b.conv1, "weight", None, conv_spec_from_module(b.conv1), b.norm2, tail=(b.act2,),
                       mode=modes[0], names=("conv1", "norm2", "act2")),
            ChainLayer(b.conv2, "weight", "bias", conv_spec_from_module(b.conv2), None, mode=modes[1],
                       names=("conv2", "", "")),
        ])

    def forward(self, *pieces: Tensor) -> Tensor:
        return self.chain(*pieces)


def _pieces(dims: int, channels: Sequence[int], dtype: torch.dtype = torch.float64, n: int = 3) -> List[Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(n, c, *SPATIAL[dims], generator=g, dtype=dtype) for c in channels]


def _build(dims: int, channels: Sequence[int], act: str = "relu", modes: Tuple[str, str] = ("recompute_bn",) * 2,
           dtype: torch.dtype = torch.float64) -> Tuple[DenseLayer, Fused]:
    torch.manual_seed(0)
    eager = DenseLayer(dims, sum(channels), 3, act, dtype)
    return eager, Fused(copy.deepcopy(eager), modes)


def _steps(eager: nn.Module, fused: Fused, pieces: List[Tensor], steps: int = 3) -> None:
    pe = [p.clone().requires_grad_() for p in pieces]
    pf = [p.clone().requires_grad_() for p in pieces]
    for s in range(steps):
        out_e, out_f = eager(*pe), fused(*pf)
        if s < steps - 1:
            up = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(s), dtype=out_e.dtype)
            out_e.backward(up)
            out_f.backward(up)
        else:
            out_e.sum().backward()
            out_f.sum().backward()
        assert_close(out_f, out_e, **TOL)
        for i, (a, b) in enumerate(zip(pf, pe)):
            assert_close(a.grad, b.grad, **TOL, msg=lambda m: f"step {s} piece {i} grad: {m}")
        named_f = dict(fused.body.named_parameters())
        for n, p in eager.named_parameters():
            assert_close(named_f[n].grad, p.grad, **TOL, msg=lambda m: f"step {s} {n} grad: {m}")
        for (n, b), bf in zip(eager.named_buffers(), fused.body.buffers()):
            assert_close(bf, b, **TOL, msg=lambda m: f"step {s} {n}: {m}")
        with torch.no_grad():
            for p in list(eager.parameters()) + list(fused.body.parameters()):
                p -= 0.05 * p.grad


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("channels", [(5,), (2, 3), (4, 1, 2, 3)])
@pytest.mark.parametrize("modes", [("recompute_bn", "recompute_bn"), ("recompute_conv", "recompute_conv")])
@pytest.mark.parametrize("act", ["relu", "silu"])
def test_head_over_pieces_equals_eager_cat(dims: int, channels: Tuple[int, ...], modes: Tuple[str, str],
                                           act: str) -> None:
    eager, fused = _build(dims, channels, act, modes)
    _steps(eager, fused, _pieces(dims, channels))


def test_pieces_that_need_no_gradient_get_none() -> None:
    eager, fused = _build(2, (2, 3, 2))
    a, b, c = _pieces(2, (2, 3, 2))
    b.requires_grad_()
    fused(a, b, c).sum().backward()
    be = b.detach().clone().requires_grad_()
    eager(a, be, c).sum().backward()
    assert a.grad is None and c.grad is None
    assert_close(b.grad, be.grad, **TOL)


def test_eval_no_grad_and_hooks_with_pieces() -> None:
    eager, fused = _build(2, (2, 3))
    pieces = _pieces(2, (2, 3))
    with torch.no_grad():  # training forward without autograd: running stats still move once
        assert_close(fused(*pieces), eager(*pieces), **TOL)
    for (n, b), bf in zip(eager.named_buffers(), fused.body.buffers()):
        assert_close(bf, b, **TOL, msg=n)
    eager.eval()
    fused.eval()
    assert_close(fused(*pieces), eager(*pieces), **TOL)
    seen: List[Tuple[int, ...]] = []
    fused.body.norm1.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    fused.train()
    eager.train()
    assert_close(fused(*pieces), eager(*pieces), **TOL)  # hooked: the eager path on the concatenation
    assert seen == [concat_shape(pieces)]


def test_pieces_errors_name_the_problem() -> None:
    eager, fused = _build(2, (2, 3))
    a, b = _pieces(2, (2, 3))
    with pytest.raises(ValueError, match="agree on every other dimension"):
        fused(a, b[:, :, :3])
    with pytest.raises(ValueError, match="share one dtype"):
        fused(a, b.float())
    with pytest.raises(RuntimeError, match="to have 5 channels"):
        fused(a, a)
    with pytest.raises(TypeError, match="needs an input"):
        fused()
    conv_first = FusedChain([ChainLayer(eager.conv1, "weight", None, conv_spec_from_module(eager.conv1), eager.norm2)])
    with pytest.raises(ValueError, match="only a chain that starts with a BatchNorm"):
        conv_first(a, b)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("mode", ["recompute_bn", "recompute_conv"])
def test_keeps_the_pieces_not_the_concatenation(mode: str) -> None:
    """Saved: the pieces (by reference: the same storages), conv1's output where its mode
    keeps it, per BN its (C,) mean and invstd; no tensor with the concatenation's shape."""
    _, fused = _build(2, (2, 3, 4), modes=(mode, "recompute_bn"), dtype=torch.float32)
    pieces = [p.requires_grad_() for p in _pieces(2, (2, 3, 4), torch.float32)]
    r = saved_bytes(fused, *pieces)
    cat = concat_shape(pieces)
    y1 = (3, 6, *SPATIAL[2])
    want = sum(_nbytes(p) for p in pieces) + 4 * 2 * 9 + 4 * 2 * 6
    if mode == "recompute_bn":
        want += math.prod(y1) * 4
    assert r.activation_bytes == want, r.shapes
    assert cat not in [s for _, s, _, _ in r.shapes]


def test_pieces_shared_by_two_chains_count_once() -> None:
    """Two dense layers reading the same earlier features keep them once (saved bytes
    de-duplicate storages): the second chain adds only its new piece."""
    _, first = _build(2, (2, 3), dtype=torch.float32)
    _, second = _build(2, (2, 3, 4), dtype=torch.float32)
    a, b, c = [p.requires_grad_() for p in _pieces(2, (2, 3, 4), torch.float32)]

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = first, second

        def forward(self, a: Tensor, b: Tensor, c: Tensor) -> Tuple[Tensor, Tensor]:
            return self.first(a, b), self.second(a, b, c)

    both = saved_bytes(Two(), a, b, c).activation_bytes
    alone = saved_bytes(second, a, b, c).activation_bytes
    only_first = saved_bytes(first, a, b).activation_bytes
    assert both == alone + only_first - _nbytes(a) - _nbytes(b)


# --------------------------------------------------------------------------- the Function and the custom op


def _specs() -> Tuple[ChainLayerSpec, ...]:
    conv1 = make_conv_spec(2, (1, 1))
    conv2 = make_conv_spec(2, (3, 3), padding=1)
    return (ChainLayerSpec(None, BNSpec(1e-5, True, 0.0), Activation("relu"), True),
            ChainLayerSpec(conv1, BNSpec(1e-5, True, 0.0), Activation("silu"), False),
            ChainLayerSpec(conv2, None, Activation("identity"), True))


def _params() -> List[Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(5,), (5,), (4, 5, 1, 1), (4,), (4,), (2, 4, 3, 3), (2,)]
    return [(torch.rand(s, generator=g, dtype=torch.float64) * 0.5 + 0.5).requires_grad_() for s in shapes]


def _fn_pieces() -> List[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, c, 3, 3, generator=g, dtype=torch.float64, requires_grad=True) for c in (2, 1, 2)]


def test_gradcheck_and_gradgradcheck_with_pieces() -> None:
    specs, stats = _specs(), ((None, None),) * 3
    params = _params()
    params.insert(3, None)  # conv1 has no bias
    pieces = _fn_pieces()
    present = [p for p in params if p is not None]

    def fn(*args: Tensor) -> Tensor:
        ps, rest = args[:3], iter(args[3:])
        full = [next(rest) if p is not None else None for p in params]
        return ChainFunction.apply(*ps, *full, specs, stats, 3)

    assert torch.autograd.gradcheck(fn, (*pieces, *present), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradgradcheck(fn, (*pieces, *present), eps=1e-6, atol=1e-5)


def test_custom_op_with_pieces_matches_the_function() -> None:
    specs, stats = list(_specs()), [(None, None)] * 3
    structure = register_chain([(s.conv, s.act, None if s.bn is None else s.bn.eps, s.tail) for s in specs])  # held: the op finds it while it lives
    key = structure.key
    params = _params()
    params.insert(3, None)
    pieces = _fn_pieces()
    out_op = chain_op_apply(key, pieces, params, specs, stats)
    out_fn = ChainFunction.apply(*pieces, *params, tuple(specs), tuple(stats), 3)
    assert_close(out_op, out_fn, rtol=1e-12, atol=1e-12)
    wrt = [*pieces, *[p for p in params if p is not None]]
    g = torch.randn_like(out_op)
    for a, b in zip(torch.autograd.grad(out_op, wrt, g), torch.autograd.grad(out_fn, wrt, g)):
        assert_close(a, b, rtol=1e-12, atol=1e-12)
    dense = [p.detach().requires_grad_() if p is not None else torch.empty(0, dtype=torch.float64) for p in params]
    args = ([p.detach().requires_grad_() for p in pieces], dense, [], torch.zeros(3, dtype=torch.float64), key,
            [s.keep_y for s in specs], [s.bn is not None for s in specs], [False] * 3, [p is not None for p in params],
            [s.may_drop for s in specs])
    torch.library.opcheck(_chain_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_chain_input_helpers() -> None:
    a, b = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    x = ChainInput([a, b])
    assert x.shape == (2, 8, 4) and len(x) == 2
    assert ChainInput([a]).build() is a
    g = torch.randn(2, 8, 4)
    ga, gb = split_grad(g, x.sizes, [True, True])
    assert ga.data_ptr() == g.data_ptr() and torch.equal(gb, g[:, 3:])  # type: ignore[union-attr]
    assert split_grad(g, x.sizes, [False, True])[0] is None
    assert split_grad(None, x.sizes, [True, True]) == [None, None]
    with pytest.raises(ValueError, match="at least one piece"):
        ChainInput([])


def test_double_backward_when_one_piece_is_computed_from_another() -> None:
    """Second-order gradients are partial derivatives per piece: a piece computed from another
    (a DenseNet's later feature from an earlier one) must not add its path twice."""
    e1, f1 = _build(2, (4,))
    e2, f2 = _build(2, (4, 3))
    a = _pieces(2, (4,))[0]
    got = []
    for m1, m2 in ((f1, f2), (e1, e2)):
        ai = a.clone().requires_grad_()
        out = m2(ai, m1(ai))
        (g,) = torch.autograd.grad(out.pow(2).sum(), ai, create_graph=True)
        g.pow(2).sum().backward()
        got.append((g.detach(), ai.grad))
    assert_close(got[0][0], got[1][0], **TOL)
    assert_close(got[0][1], got[1][1], **TOL)
