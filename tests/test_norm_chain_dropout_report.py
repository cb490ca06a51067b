"""A per-sample-norm chain with a training dropout (``p > 0``) in a tail runs fused, drawing eager's
masks (Note: [a dropout in a per-sample norm chain] in autograd/norm_chain.py), and the report says
fused: the sixth sweep's diffusers ``UNet3DConditionModel`` (its ``TemporalConvLayer``: GroupNorm ->
SiLU -> Dropout(0.1) -> Conv3d). In eval, or with ``p == 0``, the dropout is an identity and the
chain runs fused too."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import assert_steps_match, perturbed_twins


def _net(p: float) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Dropout(p),
                         nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU())


def _step(model: nn.Module, x: torch.Tensor) -> list:
    """One training step from a fixed RNG state: the output, the input's and every parameter's gradient."""
    torch.manual_seed(3)
    xi = x.clone().requires_grad_()
    out = model(xi)
    out.backward(torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5)))
    grads = [xi.grad] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [out.detach(), *grads]


def _norms_called(model: nn.Module, x: torch.Tensor) -> list:
    called: list = []

    def observer(n: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            called.append(n)
        hook.convbn_observer = True  # type: ignore[attr-defined]  # an observer: fused layers stay fused
        return hook

    handles = [m.register_forward_pre_hook(observer(n)) for n, m in model.named_modules() if isinstance(m, nn.GroupNorm)]
    try:
        model(x).sum().backward()
    finally:
        for h in handles:
            h.remove()
    return called


@pytest.mark.parametrize("example", [True, False])
def test_a_training_dropout_in_a_norm_chain_runs_fused_and_is_reported_so(example: bool) -> None:
    eager, work = perturbed_twins(lambda: _net(0.1))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(work, example_inputs=(x,) if example else None)
    for a, b in zip(_step(fast, x), _step(eager, x)):  # from the same RNG state: eager's dropout masks
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not _norms_called(fast, x)  # the GroupNorm modules did not run: the chain's Function did
    outcomes = fast.convbn_report.outcomes
    assert [o.result for o in outcomes] == ["fused", "fused"], outcomes
    fast.eval()
    assert all(o.result == "fused" for o in fast.convbn_report.outcomes)  # eval: the dropout is an identity


def test_a_p0_dropout_leaves_the_norm_chain_fused_and_reported_so() -> None:
    eager, work = perturbed_twins(lambda: _net(0.0))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(work, example_inputs=(x,))
    assert_steps_match(eager, fast, x, steps=1)
    assert not _norms_called(fast, x)
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused", "fused"]


def test_the_report_says_such_a_chain_runs_as_eager_modules_under_compile() -> None:
    """Under ``torch.compile`` a dropout-tail chain runs its layers as eager modules
    (``compilable_norm_chain``): the report says so beside the layer and on the outcome, in
    training; in eval (the dropout an identity) and for a chain without dropout it says nothing."""
    fast = convbn.convert(_net(0.1))
    x = torch.randn(2, 3, 8, 8)
    fast(x).sum().backward()
    caveat = "under torch.compile its layers run as eager modules (a training dropout in its tail)"
    report = fast.convbn_report
    assert [(o.result, o.reason) for o in report.outcomes] == [("fused", caveat)] * 2  # one chain, both norms
    assert f"1: fused; {caveat}" in str(report) and f"5: fused; {caveat}" in str(report)
    fast.eval()
    assert [(o.result, o.reason) for o in fast.convbn_report.outcomes] == [("fused", ""), ("fused", "")]
    plain = convbn.convert(_net(0.0))
    plain(x).sum().backward()
    assert all(o.reason == "" for o in plain.convbn_report.outcomes)
