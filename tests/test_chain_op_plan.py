"""The custom op under ``torch.compile`` runs the whole plan: where the planner forbade a
chain's backward to drop and rebuild inputs (``may_drop=False``, Note: [drops only where the
step peaks]) the op's backward gets the same flags, does the same rebuilds as the eager
fused path, and gives the same gradients."""
import contextlib

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import convbn
import convbn.autograd.chain as chain_mod
import convbn.autograd.chain_op as chain_op
from convbn.nn.chain import FusedChain
from fusion_checks import assert_fused

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _cbr(i, o):
    return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]


def _two_stage_net():
    """A wide-resolution chain then a wide-channel one: the step peaks in the second."""
    torch.manual_seed(0)
    return nn.Sequential(*_cbr(3, 8), *_cbr(8, 8), *_cbr(8, 8), nn.MaxPool2d(2), *_cbr(8, 32), *_cbr(32, 32),
                         *_cbr(32, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


@contextlib.contextmanager
def _op_chains():
    with convbn.compile_chains("op"):
        torch._dynamo.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()


def _step(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_compiled_op_backward_reads_may_drop_from_the_plan(monkeypatch):
    x = torch.randn(2, 3, 24, 24)
    model = convbn.convert(_two_stage_net(), example_inputs=x, peak_budget=1e-6)  # the lowest-peak plan
    assert_fused(model, pairs=6)
    chains = [c for _, c in convbn.fused_modules(model) if isinstance(c, FusedChain)]
    planned = sorted(tuple(l.may_drop for l in c.layers) for c in chains)
    assert any(not md for flags in planned for md in flags), planned  # the planner forbade some drops
    rebuilds, seen = [0], []
    real_bn, real_backward = chain_mod.bn_apply, chain_op.chain_backward

    def counting(*args):
        rebuilds[0] += 1
        return real_bn(*args)

    def spying(grad_out, x0, params, specs, *args, **kwargs):
        seen.append(tuple(s.may_drop for s in specs))
        return real_backward(grad_out, x0, params, specs, *args, **kwargs)

    monkeypatch.setattr(chain_mod, "bn_apply", counting)
    monkeypatch.setattr(chain_op, "chain_backward", spying)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    eager_grads = _step(model, x)  # the fused autograd Function (not compiled)
    eager_rebuilds = rebuilds[0]
    assert seen == []
    model.load_state_dict(state)
    with _op_chains():
        compiled = torch.compile(model, backend="aot_eager")
        rebuilds[0] = 0
        op_grads = _step(compiled, x)
    assert sorted(seen) == planned  # every chain's backward got the plan's flags
    assert rebuilds[0] == eager_rebuilds  # and did the same element-wise rebuilds
    for a, b in zip(op_grads, eager_grads):
        assert_close(a, b, rtol=1e-4, atol=1e-5)
