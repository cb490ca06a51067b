"""The convert report and ``convbn.fused_modules`` say what runs, at every moment: before the
first call (the plan not made yet), after a first-call or first-backward check fell back, and
after the "never above eager" last resort -- checked against the autograd graph of a step
(BatchNorms computed in ``ChainFunctionBackward`` nodes vs eager's batch-norm nodes).
"""
from __future__ import annotations

import contextlib
import copy
import re
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import Tensor, nn

import convbn
from peak_helpers import step_peak as _step_peak
from fusion_checks import CHAIN_BACKWARD, fused_chains


def _graph_counts(out: Tensor) -> Tuple[int, int]:
    """(fused chain calls, eager batch-norm backward nodes) in ``out``'s autograd graph."""
    chains = eager_bn = 0
    seen: Dict[int, Any] = {}
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        name = type(node).__name__
        chains += name == CHAIN_BACKWARD
        eager_bn += "BatchNormBackward" in name
        stack.extend(n for n, _ in node.next_functions)
    return chains, eager_bn


def _assert_report_is_the_graph(fast: nn.Module, out: Tensor) -> None:
    """Every BatchNorm the report calls fused is computed by a fused chain in ``out``'s graph,
    every one it calls left by eager's batch norm; ``fused_modules`` lists the chains that ran."""
    report = fast.convbn_report
    fused = [o for o in report.outcomes if o.result == "fused"]
    left = [o for o in report.outcomes if o.left]
    chains, eager_bn = _graph_counts(out)
    running = list(convbn.fused_modules(fast))
    assert chains == len(running), (chains, [n for n, _ in running], str(report))
    assert sum(sum(l.bn is not None for l in c.layers) for _, c in running) == len(fused), str(report)
    assert eager_bn == len(left), (eager_bn, str(report))
    for o in left:
        assert o.reason.startswith("fallback: "), o


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))


_SCALE = {"value": 1.0}  # a global the forward reads: a trace records it as a constant, and no guard watches it


class _Scaled(nn.Module):
    """Reads a global Python float at call time (attributes of the model are guarded; globals are not)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _net()

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) * _SCALE["value"]


def test_first_call_fallback_is_reported_as_it_runs() -> None:
    model = _Scaled()
    x = torch.randn(4, 3, 8, 8)
    fast = convbn.convert(copy.deepcopy(model))
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused", "fused"]
    _SCALE["value"] = 2.0  # the rewrite recorded 1.0: the first call's check finds them different
    try:
        with pytest.warns(RuntimeWarning, match="differs from the original on its first call"):
            out = fast(x)
    finally:
        _SCALE["value"] = 1.0
    _assert_report_is_the_graph(fast, out)
    assert all("first call" in o.reason for o in fast.convbn_report.outcomes)
    assert list(convbn.fused_modules(fast)) == []
    assert "fallback" in str(fast.convbn_report)


class _Doubler(torch.autograd.Function):
    """Hand-written backward that is not the forward's derivative."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g * 2.0


class _WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _net()

    def forward(self, x: Tensor) -> Tensor:
        return _Doubler.apply(self.body(x))


def test_first_backward_fallback_is_reported_as_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import convbn.passes.tracing.trace as trace_module

    monkeypatch.setattr(trace_module, "opaque_functions", contextlib.nullcontext)  # the Function inlined
    fast = convbn.convert(_WithFunction())
    x = torch.randn(4, 3, 8, 8)
    out = fast(x)
    _assert_report_is_the_graph(fast, out)  # fused, before the backward's check
    with pytest.warns(RuntimeWarning, match="gradients differ"):
        out.sum().backward()
    out = fast(x)
    _assert_report_is_the_graph(fast, out)
    assert all("first backward" in o.reason for o in fast.convbn_report.outcomes)


def _head(features: int = 256, hidden: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 10))


def test_never_above_eager_last_resort_is_reported_as_it_runs() -> None:
    x = torch.randn(16, 256)
    fast = convbn.convert(_head(), example_inputs=x)
    assert fast.convbn_report.eager_fallback and all(c.eager for c in fused_chains(fast))
    out = fast(x)
    _assert_report_is_the_graph(fast, out)
    assert all("above eager" in o.reason for o in fast.convbn_report.outcomes)


def test_before_the_first_call_the_plan_is_pending() -> None:
    fast = convbn.convert(_net())
    report = fast.convbn_report
    assert [p.status for p in report.pairs] == ["fused, plan pending"] * 2
    assert "plan pending" in str(report) and "recompute_bn" not in str(report)
    out = fast(torch.randn(4, 3, 8, 8))
    assert [p.status for p in report.pairs] == ["fused"] * 2
    assert "plan pending" not in str(report)
    _assert_report_is_the_graph(fast, out)




@pytest.mark.expect_unfused("weight-dominated heads run as eager modules: their fused step would peak above eager's")
@pytest.mark.parametrize("sizes", [(256, 64, 16), (32, 32, 8), (512, 256, 64), (128, 128, 4)],
                         ids=lambda s: "x".join(map(str, s)))
def test_small_heads_without_example_inputs_never_peak_above_eager(sizes: Tuple[int, int, int]) -> None:
    features, hidden, batch = sizes
    x = torch.randn(batch, features, generator=torch.Generator().manual_seed(0))
    eager = _head(features, hidden)
    fast = convbn.convert(copy.deepcopy(eager))
    peak_eager, peak_fast = _step_peak(eager, x), _step_peak(fast, x)
    assert peak_fast <= peak_eager, (peak_fast / peak_eager, str(fast.convbn_report))
    out = fast(x)
    _assert_report_is_the_graph(fast, out)
    if list(convbn.fused_modules(fast)) == []:  # fell back: the report says why
        assert all("first training call" in o.reason for o in fast.convbn_report.outcomes)
        for o in fast.convbn_report.outcomes:  # the figures it names are the rule it applied (fused > 0.9 x eager)
            found = re.search(r"measured (\d+) bytes .* above 90% of its eager layers' (\d+)", o.reason)
            assert found and int(found[1]) > 0.9 * int(found[2]), o.reason
    torch.testing.assert_close(out, eager(x), rtol=1e-4, atol=1e-5)


def test_an_activation_heavy_chain_without_example_inputs_stays_fused() -> None:
    x = torch.randn(32, 64)
    fast = convbn.convert(_head(64, 128))
    fast(x).sum().backward()
    _assert_report_is_the_graph(fast, fast(x))
    assert len(list(convbn.fused_modules(fast))) == 1


@pytest.mark.expect_unfused("hooks registered after conversion: the module's own forward runs")
def test_hooks_added_after_convert_are_reported_as_they_run() -> None:
    fast = convbn.convert(_net())
    x = torch.randn(4, 3, 8, 8)
    fast(x).sum().backward()
    handle = fast[1].register_forward_hook(lambda m, i, o: None)
    out = fast(x)
    _assert_report_is_the_graph(fast, out)
    assert all("hooks" in o.reason for o in fast.convbn_report.outcomes)
    handle.remove()
    out = fast(x)
    _assert_report_is_the_graph(fast, out)
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused", "fused"]


class _Masked(nn.Module):
    """Traced for ``mask=None``; a call with a mask takes data-dependent Python no variant can trace."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: Tensor, mask: Any = None) -> Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        if mask is not None:
            if float(mask.sum()) > 0:  # data-dependent: the call with a mask runs the module's own forward
                y = y * mask
        return y


def test_a_call_unlike_the_captured_ones_is_reported_as_it_runs() -> None:
    torch.manual_seed(0)
    fast = convbn.convert(_Masked())
    x = torch.randn(2, 3, 6, 6)
    out = fast(x)  # first call: checked, then fused
    _assert_report_is_the_graph(fast, fast(x))
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused"]
    with pytest.warns(RuntimeWarning):
        out = fast(x, mask=torch.ones(1, 8, 1, 1))
    _assert_report_is_the_graph(fast, out)
    assert [o.result for o in fast.convbn_report.outcomes] == ["left"]
    assert "its last call (mask" in fast.convbn_report.outcomes[0].reason
    _assert_report_is_the_graph(fast, fast(x))  # a captured kind of call again: fused, and said so
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused"]


class _Untraceable(nn.Module):
    """Branches on a tensor's value (the trace leaves it a call) and returns an optional part
    that is ``None`` at run time: the trace sees a proxy there, not ``None``."""

    def forward(self, x: Tensor) -> Tuple[Tensor, Any]:
        if x.sum() > -1e9:  # data-dependent control flow: not traceable
            return x, None
        return x, x


class _OptionalOutput(nn.Module):
    """The output's structure depends on what an untraced child returns (a transformer
    library's model output built from an encoder's optional hidden states)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.inner = _Untraceable()
        self.head = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x: Tensor) -> Dict[str, Tensor]:
        y, extra = self.inner(self.stem(x))
        out = {"y": self.head(y)}
        if extra is not None:
            out["extra"] = extra
        return out


def test_before_the_first_call_an_unchecked_rewrite_is_reported_unchecked() -> None:
    fast = convbn.convert(_OptionalOutput())
    report = fast.convbn_report
    text = str(report)
    assert "first call not checked yet: 2 of these pairs" in text and "<root>" in text, text
    x = torch.randn(4, 3, 8, 8)
    with pytest.warns(RuntimeWarning, match="output structure changed"):
        out = fast(x)["y"]
    _assert_report_is_the_graph(fast, out)  # the root's rewrite fell back: its pairs are listed so
    assert [o.result for o in report.outcomes] == ["left", "left"]
    assert "first call not checked yet" not in str(report) and "fallback" in str(report)
    _assert_report_is_the_graph(fast, fast(x)["y"])


def test_a_rewrite_whose_first_call_is_unchecked_says_so() -> None:
    fast = convbn.convert(_OptionalOutput(), strategy="recompute_bn")  # a fixed strategy: no plan pending
    report = fast.convbn_report
    assert [p.status for p in report.pairs] == ["fused, first call not checked yet"] * 2
    rows = [line for line in str(report).splitlines() if line.strip()[:2] in ("0.", "1.")]
    assert len(rows) == 2 and all("recompute_bn" in r and "fallback" not in r for r in rows), str(report)
    assert [o.result for o in report.outcomes] == ["fused", "fused"]  # what the first call runs if it agrees


class _SamePad(nn.Module):
    """TF-"SAME" padding computed from the input's shape: traced on its first call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn = nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8)

    def forward(self, x: Tensor) -> Tensor:
        pad = 1 if x.shape[-1] % 2 == 0 else 0
        return torch.relu(self.bn(self.conv(nn.functional.pad(x, (0, pad, 0, pad)))))


def test_a_module_captured_on_its_first_call_is_reported_waiting() -> None:
    fast = convbn.convert(_SamePad())
    assert "captured on the first call: <root>" in str(fast.convbn_report), str(fast.convbn_report)
    out = fast(torch.randn(4, 3, 8, 8))
    assert "captured on the first call" not in str(fast.convbn_report)
    _assert_report_is_the_graph(fast, out)
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused"]
