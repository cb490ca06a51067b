"""What a check holds beside its training step, and no more (issue 41 item 1): nested snapshots
share one copy of each buffer (Note: [nested snapshots share their copies]) and a step's upstream
gradient is let go once its output's node has used it (Note: [an upstream gradient let go once
used]), with the step's results unchanged."""
from __future__ import annotations

import weakref
from typing import Any, List

import torch
from torch import nn

from convbn.passes.check.buffer_copies import same_bits
from convbn.passes.check.validate import StateSnapshot, run_step


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


def test_a_nested_snapshot_takes_the_enclosing_copy_and_both_restore_exactly() -> None:
    net = _net()
    bn = net[1]
    before = [b.clone() for b in net.buffers()]
    with StateSnapshot(net) as outer:
        with StateSnapshot(net) as inner:
            assert all(a[1] is b[1] for a, b in zip(outer.buffers, inner.buffers))  # one copy, not two
            net(torch.randn(2, 3, 8, 8))
        assert all(torch.equal(a, b) for a, b in zip(before, net.buffers()))
        net(torch.randn(2, 3, 8, 8))
        with StateSnapshot(net) as changed:  # the statistics moved since the outer copy: copies of its own
            assert changed.buffers[0][1] is not outer.buffers[0][1]
            moved = bn.running_mean.clone()
            bn.running_mean.add_(1.0)
        assert torch.equal(bn.running_mean, moved)
    assert all(torch.equal(a, b) for a, b in zip(before, net.buffers()))


def test_a_copy_is_shared_only_where_the_bits_are_the_same() -> None:
    """``-0.0 == 0.0`` and a NaN is not equal to itself; the copies compare bytes."""
    zero, minus = torch.zeros(3), torch.tensor([-0.0, 0.0, 0.0])
    assert not same_bits(zero, minus)
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bits(nan, nan.clone())
    assert not same_bits(torch.zeros(2), torch.zeros(2, dtype=torch.float64))

    net = _net()
    with StateSnapshot(net) as outer:
        net[1].running_mean.copy_(torch.tensor([-0.0, 0.0, 0.0, 0.0]))
        outer.buffers[0][1].zero_()  # the outer copy holds +0.0 (what it put back is checked below)
        with StateSnapshot(net) as inner:
            assert inner.buffers[0][1] is not outer.buffers[0][1]
            net[1].running_mean.fill_(5.0)
        assert torch.equal(net[1].running_mean.view(torch.int32),
                           torch.tensor([-0.0, 0.0, 0.0, 0.0]).view(torch.int32))


class _Seen(torch.autograd.Function):
    """Identity whose backward keeps a weak reference to the gradient it received."""

    seen: List[Any] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Seen.seen.append(weakref.ref(g))
        return g * 1.0


class _Alive(torch.autograd.Function):
    """Identity whose backward (run after the output's) records whether that gradient still lives."""

    alive: List[bool] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Alive.alive.append(_Seen.seen[-1]() is not None)
        return g * 1.0


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Seen.apply(_Alive.apply(self.lin(x)))


def test_the_upstream_gradient_is_let_go_once_its_output_node_used_it() -> None:
    torch.manual_seed(0)
    model, x = _Probe(), torch.randn(4, 5)
    _Seen.seen.clear()
    _Alive.alive.clear()
    run_step(model, (x,), list(model.parameters()), seed=0)
    assert _Alive.alive == [False]  # the output's node ran, and its upstream gradient is gone


def test_the_steps_gradients_are_those_of_the_same_upstream_gradients() -> None:
    """The same numbers as handing the backward the upstream gradients as a list, also where one
    output is computed from another (both gradients arrive at the first)."""
    class TwoOuts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 5)

        def forward(self, x: torch.Tensor) -> Any:
            y = self.lin(x)
            return y, y * 2.0

    torch.manual_seed(0)
    model, x = TwoOuts(), torch.randn(4, 5)
    params = list(model.parameters())
    out, grads = run_step(model, (x,), params, seed=0)
    xr = x.detach().requires_grad_(True)
    outs = model(xr)
    gen = torch.Generator().manual_seed(1)
    ups = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in outs]
    expected = torch.autograd.grad(list(outs), params + [xr], ups)
    assert len(grads) == len(expected)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
