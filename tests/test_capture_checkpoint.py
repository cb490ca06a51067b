"""``torch.utils.checkpoint`` inside a converted model: the checkpoint stays a call and the
block it runs is fused on its own, so its recompute in backward updates the BatchNorms'
running statistics as eager's does (a second time): ``num_batches_tracked`` and running
statistics equal eager's at every step, no first-backward fallback."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint

import convbn
from capture_helpers import TOL, assert_same_state, step, twins
from fusion_checks import assert_chain_ran, assert_fused


def cbr(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class Checkpointed(nn.Module):
    def __init__(self, spelled: str, reentrant: bool) -> None:
        super().__init__()
        self.spelled, self.reentrant = spelled, reentrant
        self.a, self.b, self.c = cbr(3, 8), cbr(8, 8), cbr(8, 8)

    def forward(self, x):
        y = self.a(x)
        if self.spelled == "imported":
            y = checkpoint(self.b, y, use_reentrant=self.reentrant)
        else:
            y = torch.utils.checkpoint.checkpoint(self.b, y, use_reentrant=self.reentrant)
        return self.c(y)


def x_(seed: int = 1):
    return torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("validated", [False, True], ids=["lazy", "example_inputs"])
@pytest.mark.parametrize("spelled", ["imported", "qualified"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_keeps_eager_running_statistics(validated, spelled, reentrant):
    eager, twin = twins(lambda: Checkpointed(spelled, reentrant))
    kw = {"example_inputs": x_()} if validated else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no check falls back
        fast = convbn.convert(twin, **kw)
        report = assert_fused(fast, pairs=3)
        assert {o.batchnorm for o in report.outcomes if o.result == "fused"} == {"a.1", "b.1", "c.1"}
        for s in range(3):
            torch.testing.assert_close(step(fast, x_(s), seed=s), step(eager, x_(s), seed=s), **TOL)
            assert_same_state(eager, fast)  # num_batches_tracked: +2 per step on b.1, as eager
    assert int(fast.b[1].num_batches_tracked) == 6
    out = fast(x_())
    assert_chain_ran(out, calls=2 if reentrant else 3)  # a reentrant checkpoint hides b's node behind its own
    assert fast.forward.fallback is False and fast.b.forward.fallback is False


def test_validation_through_a_reentrant_checkpoint_leaves_grad_fields_exactly():
    """The validation step backpropagates with ``.backward()`` there (``autograd.grad`` is
    refused): each ``.grad`` it set aside comes back, the same tensor with the same values, and
    ``None`` stays ``None``."""
    _, model = twins(lambda: Checkpointed("imported", True))
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i)) if i % 2 else None
    before = [(p.grad, None if p.grad is None else p.grad.clone()) for p in params]
    fast = convbn.convert(model, example_inputs=x_())
    assert_fused(fast, pairs=3)
    for p, (g, values) in zip(fast.parameters(), before):
        assert p.grad is g, "a .grad field was replaced"
        if values is not None:
            assert torch.equal(p.grad, values), "a .grad field's values changed"
