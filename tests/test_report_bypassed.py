"""A container converted alone whose parent calls its children, not it: the report says what
runs (Note: [a container its parent does not call] in ``passes/graph/bypassed.py``).

guided-diffusion's / torchcfm's ``ResBlock`` does ``norm, rest = self.out_layers[0],
self.out_layers[1:]``: its forward cannot be traced, so ``out_layers`` is converted alone, and
its rewritten forward never runs. The report must list its norm as left (with the reason),
``fused_modules`` must not list its chain, and the norm calls that run in eager form must be
the ones the report does not call fused; a container called whole stays fused and runs fused.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, Iterator, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convbn
from convbn.passes.graph.graph_module import installed

_FUSED_DIRS = tuple(os.path.join(os.path.dirname(os.path.abspath(convbn.__file__)), d) + os.sep
                    for d in ("autograd", "functional"))
REASON = "its parent calls its children, not it"


@contextlib.contextmanager
def eager_norm_calls() -> Iterator[List[str]]:
    """Within the block, every eager-form batch / group norm call (not convbn's fused kernels)
    appends the function's name to the list."""
    calls: List[str] = []
    real = {name: getattr(F, name) for name in ("batch_norm", "group_norm")}

    def counting(name: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not sys._getframe(1).f_code.co_filename.startswith(_FUSED_DIRS):
                calls.append(name)
            return real[name](*args, **kwargs)
        return counted

    for name in real:
        setattr(F, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(F, name, fn)


class PartsBlock(nn.Module):
    """guided-diffusion's ``ResBlock`` with scale-shift norm, reduced: untraceable (``len`` of a
    shape in a loop), and it calls ``out_layers``' children, not ``out_layers``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.out_layers = nn.Sequential(norm, nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1))

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        while len(scale.shape) < len(h.shape):
            scale = scale[..., None]
        norm, rest = self.out_layers[0], self.out_layers[1:]
        return rest(norm(h) * (1 + scale))


class WholeBlock(PartsBlock):
    """The same, calling ``out_layers`` whole (its rewritten forward runs); untraceable even with
    real shapes (a branch on a value), so ``out_layers`` is converted alone here too."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if bool((scale == scale).all()):
            h = h + 0
        return self.out_layers(h) * (1 + scale[:, :, None, None])


NORMS = {"group_norm": lambda: nn.GroupNorm(4, 8), "batch_norm": lambda: nn.BatchNorm2d(8)}


def _converted(block: type, norm: str, with_inputs: bool) -> Any:
    torch.manual_seed(0)
    model, args = block(NORMS[norm]()), (torch.randn(2, 8, 8, 8), torch.randn(2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = convbn.convert(model, example_inputs=args if with_inputs else None)
    # converted alone: the block's own forward runs, out_layers has its rewritten forward
    assert installed(fast.out_layers) is not None and installed(fast) is None
    return fast, args


def _step(model: nn.Module, args: Any) -> List[str]:
    """One training step; the eager-form norm calls it made."""
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(), eager_norm_calls() as calls:
        warnings.simplefilter("ignore")
        model(*args).sum().backward()
    return calls


@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_a_container_its_parent_does_not_call_is_reported_left(norm: str, with_inputs: bool) -> None:
    fast, args = _converted(PartsBlock, norm, with_inputs)
    _step(fast, args)  # the first call (captured / checked without example_inputs)
    calls = _step(fast, args)
    assert calls == [norm]  # the user's norm module ran: nothing of out_layers runs fused
    [outcome] = fast.convbn_report.outcomes
    assert (outcome.batchnorm, outcome.result) == ("out_layers.0", "left"), fast.convbn_report
    assert REASON in outcome.reason and "Sequential" in outcome.reason, outcome.reason
    assert not list(convbn.fused_modules(fast))
    # the same chain, once its container is called whole, runs fused, and the report says so again
    fast.out_layers(torch.randn(2, 8, 8, 8))  # (without example_inputs, its first-call check)
    with eager_norm_calls() as whole:
        fast.out_layers(torch.randn(2, 8, 8, 8))
    assert whole == []
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused"]


@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_a_container_called_whole_stays_fused(norm: str, with_inputs: bool) -> None:
    fast, args = _converted(WholeBlock, norm, with_inputs)
    assert [o.result for o in fast.convbn_report.outcomes] == ["fused"]  # before any call too
    _step(fast, args)
    calls = _step(fast, args)
    assert calls == []  # no eager-form norm: the chain ran
    assert [(o.batchnorm, o.result) for o in fast.convbn_report.outcomes] == [("out_layers.0", "fused")]
    assert [n for n, _ in convbn.fused_modules(fast)] and installed(fast.out_layers).bypassed == ""


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_bypassed_outputs_gradients_and_stats_equal_eager(norm: str) -> None:
    """What runs (the user's modules) is eager: outputs, every gradient and the running stats."""
    torch.manual_seed(0)
    ref = PartsBlock(NORMS[norm]())
    fast, args = _converted(PartsBlock, norm, False)
    fast.load_state_dict(ref.state_dict())
    for model in (ref, fast):
        _step(model, args)
        _step(model, args)
    for a, b in zip(ref.parameters(), fast.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    for a, b in zip(ref.buffers(), fast.buffers()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(ref(*args), fast(*args))


class SkippingBlock(WholeBlock):
    """Calls neither ``out_layers`` nor its children (a branch not taken): nothing says its
    parent reaches into it."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if bool((scale == scale).all()):
            h = h + 0
        return h * (1 + scale[:, :, None, None])


@pytest.mark.expect_unfused("the converted container is never called")
def test_a_container_skipped_whole_is_not_called_bypassed_with_example_inputs() -> None:
    fast, args = _converted(SkippingBlock, "batch_norm", True)
    _step(fast, args)
    assert installed(fast.out_layers).bypassed == ""
    [outcome] = fast.convbn_report.outcomes
    assert outcome.result == "fused", outcome.reason
