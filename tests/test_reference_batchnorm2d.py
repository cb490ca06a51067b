"""Tests of the tutorial's BatchNorm2dFunction against the same maths in eager ops."""
from __future__ import annotations

import math
from typing import Any, Iterator, List

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from convbn.autograd.batchnorm2d import (
    BatchNorm2dFunction,
    batch_norm2d_backward,
    batch_norm2d_formula,
    batch_norm2d_reference,
    batch_norm2d_stats,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SHAPES = [(2, 3, 4, 4), (5, 2, 3, 1), (1, 4, 3, 3), (8, 1, 1, 1), (3, 2, 2, 5)]
EPS = [1e-3, 1e-5, 0.0, 0.5]


def _input(shape, seed: int = 0, dtype: torch.dtype = torch.float64, shift: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, dtype=dtype, generator=gen) * 2 + shift
    return x.requires_grad_(True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", EPS)
def test_output_and_gradient_match_formula(shape, eps: float) -> None:
    x = _input(shape)
    y = batch_norm2d_reference(x, eps)
    y_ref = batch_norm2d_formula(x, eps)
    assert_close(y, y_ref)
    grad_out = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, grad_out)
    (gx_ref,) = torch.autograd.grad(y_ref, x, grad_out)
    assert_close(gx, gx_ref)


@pytest.mark.parametrize("shape", SHAPES)
def test_relation_to_torch_batch_norm(shape) -> None:
    # With eps~0 (torch needs eps > 0) the tutorial's unbiased normalisation is torch's (biased) one scaled by
    # sqrt((M - 1) / M): a check against a real torch kernel, not only our own formula.
    x = _input(shape)
    per_channel = x.numel() // x.shape[1]
    y = batch_norm2d_reference(x, 0.0)
    y_torch = F.batch_norm(x, None, None, training=True, eps=1e-14) * math.sqrt(
        (per_channel - 1) / per_channel
    )
    assert_close(y, y_torch)
    grad_out = torch.randn_like(y)
    assert_close(
        torch.autograd.grad(y, x, grad_out)[0], torch.autograd.grad(y_torch, x, grad_out)[0]
    )


def test_default_eps_is_tutorials_and_outside_sqrt() -> None:
    x = _input((4, 2, 3, 3))
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    std = x.var(dim=(0, 2, 3), unbiased=True, keepdim=True).sqrt()
    assert_close(batch_norm2d_reference(x), (x - mean) / (std + 1e-3))


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_gradcheck(shape) -> None:
    x = _input(shape)
    assert torch.autograd.gradcheck(BatchNorm2dFunction.apply, (x,))
    assert torch.autograd.gradcheck(lambda t: BatchNorm2dFunction.apply(t, 0.1), (x,))


def test_stats_match_torch() -> None:
    x = _input((3, 4, 5, 2)).detach()
    mean, sqrt_var = batch_norm2d_stats(x)
    assert_close(mean, x.mean(dim=(0, 2, 3)))
    assert_close(sqrt_var, x.std(dim=(0, 2, 3), unbiased=True))


def test_backward_helper_matches_autograd() -> None:
    x = _input((2, 3, 4, 4))
    grad_out = torch.randn_like(x)
    mean, sqrt_var = batch_norm2d_stats(x.detach())
    got = batch_norm2d_backward(grad_out, x.detach(), mean, sqrt_var, 1e-3)
    (expected,) = torch.autograd.grad(batch_norm2d_formula(x), x, grad_out)
    assert_close(got, expected)


def test_float32_with_large_mean_is_accurate() -> None:
    x64 = _input((4, 3, 6, 6), shift=1000.0)
    x32 = x64.detach().float().requires_grad_(True)
    grad_out = torch.randn_like(x64)
    (g32,) = torch.autograd.grad(batch_norm2d_reference(x32), x32, grad_out.float())
    (g64,) = torch.autograd.grad(batch_norm2d_formula(x64), x64, grad_out)
    assert_close(g32.double(), g64, atol=1e-3, rtol=1e-3)


def test_double_backward_raises_because_once_differentiable() -> None:
    x = _input((2, 3, 4, 4))
    y = batch_norm2d_reference(x)
    grad_out = torch.randn_like(y, requires_grad=True)
    (gx,) = torch.autograd.grad(y, x, grad_out, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.backward(torch.randn_like(gx))


class _FullSizeAllocations(TorchDispatchMode):
    """Records every op that returns a new tensor with at least ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.ops: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.numel() >= self.numel
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.ops.append(str(func))
        return out


def test_backward_allocates_one_full_size_buffer() -> None:
    x = _input((4, 3, 5, 5), dtype=torch.float32)
    y = batch_norm2d_reference(x)
    grad_out = torch.randn_like(y)
    with _FullSizeAllocations(x.numel()) as recorder:
        torch.autograd.grad(y, x, grad_out)
    assert len(recorder.ops) == 1, recorder.ops
    # The eager formula, for contrast, allocates many.
    y_ref = batch_norm2d_formula(x)
    with _FullSizeAllocations(x.numel()) as recorder_ref:
        torch.autograd.grad(y_ref, x, grad_out)
    assert len(recorder_ref.ops) > 3


def test_saves_only_input_and_two_vectors() -> None:
    x = _input((4, 3, 5, 5))
    saved: List[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        batch_norm2d_reference(x)
    assert sorted(saved, key=len) == [torch.Size([3]), torch.Size([3]), x.shape]


@pytest.mark.parametrize(
    "value, eps, error, match",
    [
        (torch.randn(2, 3, 4), 1e-3, ValueError, "4-D input"),
        (torch.randn(1, 3, 1, 1), 1e-3, ValueError, "more than 1 value per channel"),
        (torch.randn(2, 3, 2, 2), -1.0, ValueError, "eps must be a non-negative"),
        (torch.randn(2, 3, 2, 2), "1e-3", ValueError, "eps must be a non-negative"),
        (torch.ones(2, 3, 2, 2, dtype=torch.int64), 1e-3, TypeError, "floating-point"),
        ([1.0, 2.0], 1e-3, TypeError, "Tensor"),
    ],
)
def test_bad_input_raises(value, eps, error, match) -> None:
    with pytest.raises(error, match=match):
        batch_norm2d_reference(value, eps)
