"""Threads beside convbn: a check, a trace or a training step in one thread changes nothing
another thread sees (its random numbers, ``nn.Module.__call__``, its results).

Each test starts a second thread doing what real programs do beside a model (a
data-augmentation thread drawing from the global RNG, an eager model training, a second
converted copy training) and compares everything with eager PyTorch.
"""
from __future__ import annotations

import copy
import threading
import warnings
from typing import Any, Callable, Dict, List

import pytest
import torch
from torch import Tensor, nn

import convbn
from fusion_checks import assert_chain_ran, assert_fused


def _net(seed: int, p: float = 0.3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(p),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


class _Drawer(threading.Thread):
    """Draws ``torch.rand(4)`` from the global CPU generator until told to stop; ``repeats``
    counts draws equal to an earlier one (a stream set back by someone else)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.seen: set = set()
        self.draws = 0
        self.repeats = 0

    def run(self) -> None:
        while not self.stop.is_set():
            key = tuple(torch.rand(4).tolist())
            self.draws += 1
            if key in self.seen:
                self.repeats += 1
            self.seen.add(key)

    def __enter__(self) -> "_Drawer":
        self.start()
        while self.draws < 100:  # running before the main thread starts
            pass
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.join()


@pytest.mark.parametrize("with_inputs", [False, True], ids=["lazy", "example_inputs"])
def test_another_threads_random_numbers_never_repeat_during_convert_and_checks(with_inputs: bool) -> None:
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    model = _net(0)
    with _Drawer() as drawer:
        for _ in range(3):  # each round: convert, first call (checked), first backward (checked)
            fast = convbn.convert(copy.deepcopy(model), example_inputs=x if with_inputs else None)
            out = fast(x)
            out.square().mean().backward()
            assert_chain_ran(out)
    assert drawer.draws > 1000
    assert drawer.repeats == 0, f"{drawer.repeats} of {drawer.draws} draws of another thread repeated"
    assert_fused(fast, pairs=2)


def _train(model: nn.Module, steps: int, seed: int, draw_beside: bool = False) -> List[float]:
    """``steps`` SGD steps on batches from a private generator; with ``draw_beside`` the loop
    also draws from the global RNG (what a data pipeline does)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 3, 8, 8, generator=gen)
        if draw_beside:
            torch.rand(64)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _in_threads(jobs: Dict[str, Callable[[], Any]]) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    errors: List[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def run(name: str, job: Callable[[], Any]) -> None:
        try:
            barrier.wait()
            results[name] = job()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n, j)) for n, j in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_two_threads_training_converted_copies_get_eagers_results_fused() -> None:
    base = _net(0, p=0.0)
    expected = {s: _train(copy.deepcopy(base), 4, s) for s in (1, 2)}
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(9))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback warns: the thread raises
        for _ in range(3):
            copies = {s: convbn.convert(copy.deepcopy(base)) for s in (1, 2)}
            got = _in_threads({str(s): (lambda s=s: _train(copies[s], 4, s, draw_beside=True)) for s in (1, 2)})
            for s in (1, 2):
                torch.testing.assert_close(got[str(s)], expected[s], rtol=1e-4, atol=1e-6)
                assert_fused(copies[s], pairs=2)
                assert_chain_ran(copies[s](x))  # still fused: no fallback


class _Shake(torch.autograd.Function):
    """A custom Function (tracing patches ``Function.apply`` and each ``forward``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.conv2, self.bn2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), \
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: Tensor) -> Tensor:
        y = _Shake.apply(torch.relu(self.bn(self.conv(x))))
        return torch.relu(self.bn2(self.conv2(y))).mean((2, 3))


def _eager_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _train_eager(model: nn.Module, steps: int) -> List[float]:
    gen = torch.Generator().manual_seed(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 12, generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_two_converts_at_once_beside_an_eager_training_thread() -> None:
    torch.manual_seed(0)
    models = [_Block(), _net(1, p=0.0)]
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    expected_losses = _train_eager(_eager_model(2), 60)
    refs = []
    for m in models:
        out = m(x)
        out.sum().backward()
        refs.append((out.detach(), [p.grad.clone() for p in m.parameters()]))
        m.zero_grad()
    call, getattr_, jit_isinstance, apply = (nn.Module.__dict__["__call__"], nn.Module.__dict__["__getattr__"],
                                             torch.jit.isinstance, torch.autograd.Function.__dict__["apply"])
    for _ in range(3):
        copies = [copy.deepcopy(m) for m in models]
        jobs: Dict[str, Callable[[], Any]] = {
            "eager": lambda: _train_eager(_eager_model(2), 60),
            **{f"convert{i}": (lambda c=c: [convbn.convert(c) for _ in range(1)][0]) for i, c in enumerate(copies)},
        }
        got = _in_threads(jobs)
        assert got["eager"] == expected_losses
        for i, (ref_out, ref_grads) in enumerate(refs):
            fast = got[f"convert{i}"]
            assert_fused(fast, pairs=2)
            out = fast(x)
            assert_chain_ran(out)
            out.sum().backward()
            torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
            for p, g in zip(fast.parameters(), ref_grads):
                torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)
    # nothing left patched
    assert nn.Module.__dict__["__call__"] is call and nn.Module.__dict__["__getattr__"] is getattr_
    assert torch.jit.isinstance is jit_isinstance and torch.autograd.Function.__dict__["apply"] is apply
    assert "forward" in _Shake.__dict__ and isinstance(_Shake.__dict__["forward"], staticmethod)
    # torch.fx's process-wide "tracing" flag is off again (overlapping traces left it on, and
    # every later torch.compile call then raised "symbolically trace a dynamo-optimized function")
    import torch.fx._symbolic_trace as fx_trace

    assert fx_trace._is_fx_tracing_flag is False
    compiled = torch.compile(lambda t: t * 2, backend="eager")
    torch.testing.assert_close(compiled(x), x * 2)


def test_import_convbn_installs_nothing_process_wide() -> None:
    """A fresh interpreter: ``import convbn`` leaves logging filters, the attributes tracing
    patches and torch's operator registry as they were (no ``convbn::`` op until the op path
    is used), and reads no switch from the environment yet (set after import, it still counts)."""
    import os
    import subprocess
    import sys

    code = r'''
import logging, os, sys
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

def ops():
    return sorted(s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("convbn::"))

def state():
    loggers = [logging.getLogger()] + [l for l in logging.Logger.manager.loggerDict.values() if isinstance(l, logging.Logger)]
    return ({l.name: list(l.filters) for l in loggers if l.filters},
            nn.Module.__dict__["__call__"], nn.Module.__dict__["__getattr__"], torch.jit.isinstance,
            torch.autograd.Function.__dict__["apply"], _BatchNorm.__dict__["forward"])

before = state()
import convbn
from convbn.autograd.chain_compiled import compile_chains_mode
from convbn.autograd.chain_kernels import fused_kernels_enabled
after = state()
assert before[1:] == after[1:], "an attribute was patched"
assert after[0] == before[0], ("logging filters installed", after[0])
assert ops() == [], ("operators registered on import", ops())
import convbn.autograd.chain_op  # the op path registers its ops when it is used
assert ops() == ["convbn::chain_bwd", "convbn::chain_fwd"], ops()
os.environ["CONVBN_COMPILE_CHAINS"] = "op"
os.environ["CONVBN_FUSED_KERNELS"] = "1"
assert compile_chains_mode() == "op" and fused_kernels_enabled(), "switches read at import only"
print("ok")
'''
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVBN_")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
