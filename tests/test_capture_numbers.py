"""A Python number a parent passes to a child's forward (EfficientNet's
``block(x, drop_connect_rate=rate * i / n)``) is traced as the constant it is and guarded,
like an optional ``None`` / ``bool`` / ``str``: every block fuses, and a call with another
number runs a variant captured for it, never the graph of the first."""
from __future__ import annotations

import torch
from torch import nn

import convbn
from capture_helpers import TOL, assert_same_state, step, twins
from fusion_checks import assert_chain_ran


class Block(nn.Module):
    """MBConv-style residual block with inline drop-connect on a rate its parent passes."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x, drop_connect_rate=None):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        if self.training and drop_connect_rate:
            keep = (torch.rand(x.shape[0], 1, 1, 1, dtype=x.dtype) > drop_connect_rate).to(x.dtype)
            y = y * keep / (1 - drop_connect_rate)
        return x + y


class Net(nn.Module):
    def __init__(self, n: int = 3, rate: float = 0.5) -> None:
        super().__init__()
        self.rate = rate
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.ModuleList(Block(8) for _ in range(n))

    def forward(self, x):
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            x = block(x, self.rate * i / len(self.blocks))
        return x


def _input(seed: int) -> torch.Tensor:
    return torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _bn_calls(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def test_a_number_passed_to_a_child_fuses_every_batchnorm_and_matches_eager():
    eager, fast = twins(Net)
    fast = convbn.convert(fast)
    for k in range(3):
        x = _input(k)
        ref = step(eager, x, seed=k)
        out = step(fast, x, seed=k)
        torch.testing.assert_close(out, ref, **TOL)
        assert_same_state(eager, fast)
        if k >= 1:  # the first step checks itself against eager; later ones run the chains only
            torch.manual_seed(k)
            chains = assert_chain_ran(fast(x))
            # the stem's conv-bn-relu and each block's conv-bn-relu-conv-bn: all 7 BatchNorms
            assert len(chains) == 4, f"expected 4 chain calls (all {_bn_calls(fast)} BatchNorms), got {len(chains)}"
            torch.manual_seed(k)  # the eager twin takes the same extra step (statistics stay equal)
            eager(x)
    assert_same_state(eager, fast)


def test_a_call_with_another_number_does_not_run_the_graph_traced_for_the_first():
    eager, fast = twins(lambda: Block(8))
    fast = convbn.convert(fast)
    x = torch.randn(4, 8, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for k, rate in enumerate((0.25, 0.25, 0.5, 0.5, 0.0, 0.25)):
        for m in (eager, fast):
            m.zero_grad()
        ref = step(eager, x, rate, seed=k)
        out = step(fast, x, rate, seed=k)
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"call {k}, drop_connect_rate={rate}: {m}")
        assert_same_state(eager, fast)
        if k in (1, 3, 5):  # a variant per rate, each checked on its first call, then run fused
            torch.manual_seed(k)
            assert_chain_ran(fast(x, rate))
            torch.manual_seed(k)
            eager(x, rate)
    assert any("drop_connect_rate=0.5" in v for v in fast.convbn_report.variants), fast.convbn_report.variants


def test_random_draws_are_recorded_for_the_tracing_thread_only():
    """While a shape trace records ``torch.rand`` as a graph node, another thread's
    ``torch.rand`` still draws a tensor (Note: [tracing patches are the tracing thread's])."""
    import threading

    from convbn.passes.graph.shape_capture import ShapeTracing

    seen = []
    ready, drawn = threading.Event(), threading.Event()

    def other_thread() -> None:
        ready.wait(60)
        seen.append(torch.rand(2))
        drawn.set()

    class Probe(Block):
        def forward(self, x, drop_connect_rate=None):
            if isinstance(x, torch.fx.Proxy) and isinstance(x.tracer, ShapeTracing) and not drawn.is_set():
                ready.set()
                drawn.wait(60)
            return super().forward(x, drop_connect_rate)

    class ProbeNet(Net):
        def __init__(self) -> None:
            super().__init__(n=2)
            self.blocks = nn.ModuleList(Probe(8) for _ in range(2))

    worker = threading.Thread(target=other_thread, daemon=True)
    worker.start()
    eager, fast = twins(ProbeNet)
    fast = convbn.convert(fast)  # captured with real shapes on its first call
    for k in range(2):
        x = _input(k)
        torch.testing.assert_close(step(fast, x, seed=k), step(eager, x, seed=k), **TOL)
    ready.set()  # should the trace never reach the probe, let the worker finish
    worker.join(60)
    assert drawn.is_set() and len(seen) == 1
    assert type(seen[0]) is torch.Tensor and seen[0].shape == (2,), seen
