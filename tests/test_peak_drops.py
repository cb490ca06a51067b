"""Note: [drops only where the step peaks] (passes/plan/peak_model.py): the planner forbids a chain's
backward to drop and rebuild inputs where the step peaks elsewhere; the peak stays the same
to the byte, the gradients bit for bit, and the element-wise rebuilds are fewer."""
import random

import pytest
import torch
from torch import nn

import convbn
import convbn.autograd.chain as chain_mod
from convbn.autograd.chain_plan import ChainPlan
from convbn.nn.chain import FusedChain
from convbn.passes.plan.auto_plan import measure_peak
from convbn.passes.plan.peak_model import ChainCost, drops_needed, step_peak


def _cbr(i, o):
    return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]


def _two_stage_net():
    """A wide-resolution chain then a wide-channel one: the step peaks in the second."""
    return nn.Sequential(*_cbr(3, 8), *_cbr(8, 8), *_cbr(8, 8), nn.MaxPool2d(2), *_cbr(8, 64), *_cbr(64, 64),
                         *_cbr(64, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def _step(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_skipped_drops_keep_the_peak_and_the_gradients_and_save_rebuilds(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    with pytest.warns(UserWarning, match="lowest any plan reaches"):  # the lowest-peak plan: it recomputes most
        model = convbn.convert(_two_stage_net(), example_inputs=x, peak_budget=1e-6)
    chains = [c for _, c in convbn.fused_modules(model) if isinstance(c, FusedChain)]
    assert any(not l.may_drop for c in chains for l in c.layers)
    rebuilds = [0]
    real = chain_mod.bn_apply

    def counting(*args):
        rebuilds[0] += 1
        return real(*args)

    monkeypatch.setattr(chain_mod, "bn_apply", counting)
    peak = measure_peak(model, (x,)).peak
    grads = _step(model, x)
    planned = rebuilds[0]
    assert peak == model.convbn_report.predicted_peak_bytes
    for c in chains:  # what the backward did before: drop wherever its own chain's peak falls
        c.apply_plan(ChainPlan(c.plan.keep, (True,) * len(c.layers)))
    rebuilds[0] = 0
    assert measure_peak(model, (x,)).peak == peak
    grads_all = _step(model, x)
    assert planned < rebuilds[0]
    for a, b in zip(grads, grads_all):
        assert torch.equal(a, b)


def test_drops_needed_never_changes_the_predicted_peak():
    rng = random.Random(1)
    for _ in range(40):
        costs, keeps = [], []
        for _ in range(rng.randint(1, 4)):
            k = rng.randint(1, 4)
            ys = tuple(rng.randint(1, 9) for _ in range(k))
            costs.append(ChainCost(ys, (rng.randint(1, 9),) + ys[:-1], (1,) * k,
                                   tuple(rng.choice(("output", "smooth", "identity")) for _ in range(k)),
                                   prefix=rng.randint(0, 30)))
            keeps.append([rng.random() < 0.3 for _ in range(k)])
        floor = rng.randint(0, 20)
        need = drops_needed(costs, keeps, floor)
        assert step_peak(costs, keeps, floor, may_drop=need)[0] == step_peak(costs, keeps, floor)[0]
        # and forbidding drops in a chain that needs them would raise the peak
        for j, n in enumerate(need):
            if n:
                off = [f and i != j for i, f in enumerate([True] * len(costs))]
                assert step_peak(costs, keeps, floor, may_drop=off)[0] > step_peak(costs, keeps, floor)[0]
