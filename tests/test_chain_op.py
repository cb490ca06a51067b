"""The torch.compile path of a chain: the ``convbn::chain_fwd`` custom op.

Under ``torch.compile`` a :class:`convbn.nn.FusedChain` runs as this op; here it is
checked directly (eager calls of the op): registration (``torch.library.opcheck``:
schema, fake kernel, autograd registration), gradients against the ChainFunction path
and ``gradcheck`` in float64.
"""
import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import convbn
from convbn.autograd.chain import ChainLayerSpec
from convbn.autograd.chain_op import _chain_fwd, chain_op_apply, register_chain
from convbn.functional.activations import Activation
from convbn.functional.batchnorm import BNSpec
from convbn.functional.conv import make_conv_spec


def _specs(keep):
    convs = [make_conv_spec(2, (3, 3), padding=1), make_conv_spec(2, (1, 1))]
    acts = [Activation("relu"), Activation("silu")]
    return [ChainLayerSpec(c, BNSpec(1e-5, True, 0.1), a, k) for c, a, k in zip(convs, acts, keep)]


def _params(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 3, 3, 3), (6,), (6,), (6,), (4, 6, 1, 1), None, (4,), (4,)]
    return [None if s is None else torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("keep", [(True, True), (False, True), (True, False), (False, False)])
def test_opcheck_registration(keep):
    specs = _specs(keep)
    structure = register_chain([(s.conv, s.act, s.bn.eps) for s in specs])  # held: the op finds it while it lives
    key = structure.key
    params = _params()
    dense = [p if p is not None else torch.empty(0, dtype=torch.float64) for p in params]
    x = torch.randn(3, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    running = [torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64),
               torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)]
    factors = torch.tensor([0.1, 0.1], dtype=torch.float64)
    args = ([x], dense, running, factors, key, list(keep), [True, True], [True, True], [p is not None for p in params],
            [True, False])
    torch.library.opcheck(_chain_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("keep", [(True, True), (False, False)])
def test_op_matches_chain_function_and_gradchecks(keep):
    specs = _specs(keep)
    structure = register_chain([(s.conv, s.act, s.bn.eps) for s in specs])  # held: the op finds it while it lives
    key = structure.key
    params = _params()
    x = torch.randn(3, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    no_stats = [(None, None), (None, None)]

    def via_op(x, *ps):
        return chain_op_apply(key, x, list(ps), specs, no_stats)

    def via_function(x, *ps):
        return convbn.autograd.ChainFunction.apply(x, *ps, tuple(specs), tuple(no_stats))

    out_op, out_fn = via_op(x, *params), via_function(x, *params)
    assert_close(out_op, out_fn, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out_op)
    grads_op = torch.autograd.grad(out_op, [x] + [p for p in params if p is not None], g)
    grads_fn = torch.autograd.grad(out_fn, [x] + [p for p in params if p is not None], g)
    for a, b in zip(grads_op, grads_fn):
        assert_close(a, b, rtol=1e-12, atol=1e-12)
    present = [p for p in params if p is not None]

    def fn(x, *ps):
        it = iter(ps)
        full = [next(it) if p is not None else None for p in params]
        return via_op(x, *full)

    assert torch.autograd.gradcheck(fn, (x, *present), eps=1e-6, atol=1e-6)


def test_op_updates_running_stats_like_eager():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6, momentum=None), nn.ReLU(),
                          nn.Conv2d(6, 4, 1), nn.BatchNorm2d(4)).double()
    fused = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    chain = fused.convbn_chain0
    x = torch.randn(3, 3, 5, 5, dtype=torch.float64)
    for _ in range(2):
        from convbn.nn.fused_conv_bn import bn_running_stats, bn_spec_from_module

        layers = chain.layers
        stats = [bn_running_stats(l.bn) for l in layers]
        specs = [ChainLayerSpec(l.conv, bn_spec_from_module(l.bn, advance=True), l.act, True) for l in layers]
        params = [t for l in layers for t in (l.weight, l.bias, l.bn.weight, l.bn.bias)]
        out = chain_op_apply(chain.op_key, x, params, specs, stats)
        ref = eager(x)
    assert_close(out, ref)
    for b, be in zip(fused.buffers(), eager.buffers()):
        assert_close(b, be)


def _layout_args(x_fmt, w_fmt, pieces, dtype=torch.float64):
    """chain_fwd arguments for a two-layer chain (a head over ``pieces`` when > 1) in the given layouts, and
    the chain structure the op finds by the key (the caller holds it)."""
    g = torch.Generator().manual_seed(0)
    if pieces > 1:  # a head normalises the concatenation, then one conv layer
        specs = [ChainLayerSpec(None, BNSpec(1e-5, True, 0.1), Activation("relu"), False),
                 ChainLayerSpec(make_conv_spec(2, (3, 3), padding=1), BNSpec(1e-5, True, 0.1), Activation("silu"), False)]
        shapes = [(6,), (6,), (4, 6, 3, 3), (4,), (4,), (4,)]
        xs = [torch.randn(3, c, 5, 5, generator=g, dtype=dtype) for c in (2, 4)]
    else:
        specs = _specs((True, False))
        shapes = [(6, 3, 3, 3), (6,), (6,), (6,), (4, 6, 1, 1), (0,), (4,), (4,)]
        xs = [torch.randn(3, 3, 5, 5, generator=g, dtype=dtype)]
    xs = [x.contiguous(memory_format=x_fmt).requires_grad_() for x in xs]
    params = [torch.randn(s, generator=g, dtype=dtype).contiguous(memory_format=w_fmt if len(s) == 4 else torch.contiguous_format)
              .requires_grad_(s != (0,)) for s in shapes]
    structure = register_chain([(s.conv, s.act, s.bn.eps) for s in specs])  # held: the op finds it while it lives
    key = structure.key
    running = [torch.zeros(6, dtype=dtype), torch.ones(6, dtype=dtype), torch.zeros(4, dtype=dtype), torch.ones(4, dtype=dtype)]
    factors = torch.tensor([0.1, 0.1], dtype=torch.float64)
    keep = [s.keep_y for s in specs]
    return specs, (xs, params, running, factors, key, keep, [True, True], [True, True], [p.numel() > 0 for p in params],
                   [s.may_drop for s in specs]), structure


@pytest.mark.parametrize("x_fmt,w_fmt,pieces", [
    (torch.channels_last, torch.contiguous_format, 1),   # the usual GPU recipe: channels_last input
    (torch.contiguous_format, torch.channels_last, 1),   # channels_last weights only
    (torch.channels_last, torch.channels_last, 1),
    (torch.channels_last, torch.contiguous_format, 2),   # a head over a concatenation
])
def test_opcheck_across_layouts(x_fmt, w_fmt, pieces):
    """The fake kernels give the real ops' strides in every layout (Note: [the chain ops'
    output strides]); ``chain_bwd`` is checked on the saved set ``chain_fwd`` returns."""
    from convbn.autograd.chain_op import _chain_bwd

    specs, args, structure = _layout_args(x_fmt, w_fmt, pieces)  # the structure held while the op runs
    torch.library.opcheck(_chain_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    xs, params, running, factors, key, keep, bs, _, present, may_drop = args
    with torch.no_grad():
        out, saved, _ = _chain_fwd(xs, params, [t.clone() for t in running], factors, key, keep, bs, [True, True], present,
                                 may_drop)
    assert out.is_contiguous(memory_format=torch.channels_last)  # either layout channels_last: the output is too
    grad = torch.randn_like(out).contiguous(memory_format=x_fmt)
    needs = [True] + [p.requires_grad for p in params]
    torch.library.opcheck(_chain_bwd, (grad, [x.detach() for x in xs], [p.detach() for p in params], list(saved), key, keep, bs,
                                       needs, present, may_drop), test_utils=("test_schema", "test_faketensor"))
    grads = _chain_bwd(grad, [x.detach() for x in xs], [p.detach() for p in params], list(saved), key, keep, bs, needs, present,
                       may_drop)
    if pieces == 1:
        assert grads[0].stride() == xs[0].stride()
    for g, p in zip(grads[1:], params):
        if p.requires_grad:
            assert g.stride() == p.stride()
