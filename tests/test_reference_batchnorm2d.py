"""Tests of the tutorial's BatchNorm2dFunction (and the fused Conv+BN built on it) against eager ops."""
from __future__ import annotations

import math
from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from convbn.reference.batchnorm2d import (
    BatchNorm2dFunction,
    batch_norm2d_backward,
    batch_norm2d_formula,
    batch_norm2d_reference,
    batch_norm2d_stats,
)
from convbn.reference.tutorial_fused import (
    TutorialFusedConvBN2d,
    TutorialFusedConvBN2dFunction,
    tutorial_conv_bn2d_formula,
    tutorial_fused_conv_bn2d,
)



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


# ------------------------------------------------- the tutorial's fused Conv+BN, built on it

# (N, C_in, H, W, C_out, kernel, stride, padding, eps)
FUSED_CONFIGS = [
    (2, 3, 6, 6, 4, (3, 3), 1, 0, 1e-3),
    (3, 2, 5, 7, 3, (3, 3), 1, 1, 1e-5),
    (2, 2, 7, 6, 3, (3, 2), 2, 1, 0.1),
    (4, 1, 3, 3, 2, (1, 1), 1, 0, 1e-3),
]


def _fused_inputs(config, seed: int = 0):
    n, c_in, h, w, c_out, kernel, stride, padding, eps = config
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c_in, h, w, dtype=torch.float64, generator=gen).requires_grad_(True)
    weight = torch.randn(c_out, c_in, *kernel, dtype=torch.float64, generator=gen)
    return x, weight.requires_grad_(True), eps, stride, padding


@pytest.mark.parametrize("config", FUSED_CONFIGS)
def test_fused_matches_unfused_formula(config) -> None:
    x, w, eps, stride, padding = _fused_inputs(config)
    y = tutorial_fused_conv_bn2d(x, w, eps, stride, padding)
    y_ref = tutorial_conv_bn2d_formula(x, w, eps, stride, padding)
    assert_close(y, y_ref)
    grad_out = torch.randn_like(y)
    for got, expected in zip(
        torch.autograd.grad(y, (x, w), grad_out), torch.autograd.grad(y_ref, (x, w), grad_out)
    ):
        assert_close(got, expected)


@pytest.mark.parametrize("config", FUSED_CONFIGS[1:3])
def test_fused_gradcheck(config) -> None:
    x, w, eps, stride, padding = _fused_inputs(config)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return TutorialFusedConvBN2dFunction.apply(a, b, eps, stride, padding)

    assert torch.autograd.gradcheck(fn, (x, w))


def test_fused_saves_only_conv_input_and_weight() -> None:
    x, w, eps, stride, padding = _fused_inputs(FUSED_CONFIGS[0])
    saved: List[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tutorial_fused_conv_bn2d(x, w, eps, stride, padding)
    assert len(saved) == 2 and saved[0] is x and saved[1] is w


@pytest.mark.parametrize("which", [0, 1])
def test_fused_only_needed_gradient(which: int) -> None:
    x, w, eps, stride, padding = _fused_inputs(FUSED_CONFIGS[1])
    (w if which == 0 else x).requires_grad_(False)
    y = tutorial_fused_conv_bn2d(x, w, eps, stride, padding)
    y.backward(torch.randn_like(y))
    assert (x.grad is not None) == (which == 0) and (w.grad is not None) == (which == 1)


def test_fused_module_matches_formula_and_conv_init() -> None:
    torch.manual_seed(7)
    layer = TutorialFusedConvBN2d(3, 4, 3, dtype=torch.float64)
    torch.manual_seed(7)
    conv = torch.nn.Conv2d(3, 4, 3, bias=False, dtype=torch.float64)
    assert_close(layer.weight, conv.weight)  # kaiming_uniform_(a=sqrt(5)), like nn.Conv2d
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    assert_close(layer(x), tutorial_conv_bn2d_formula(x, layer.weight, 1e-3))
    assert_close(layer.eval()(x), layer.train()(x))  # no running statistics
    assert repr(layer) == "TutorialFusedConvBN2d(3, 4, kernel_size=(3, 3), eps=0.001)"
    padded = TutorialFusedConvBN2d(3, 4, (3, 1), 0.2, 1e-5, stride=2, padding=1)
    assert "stride=(2, 2), padding=(1, 1), eps=1e-05" in repr(padded)
    assert padded.exp_avg_factor == 0.2 and padded.weight.shape == (4, 3, 3, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(in_channels=0), "in_channels"),
        (dict(kernel_size=0), "kernel_size"),
        (dict(exp_avg_factor=1.5), "exp_avg_factor"),
        (dict(eps=-1.0), "eps"),
        (dict(padding=-1), "padding"),
    ],
)
def test_fused_module_bad_arguments(kwargs, match) -> None:
    args = dict(in_channels=2, out_channels=3, kernel_size=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        TutorialFusedConvBN2d(**args)


def test_fused_bad_input() -> None:
    layer = TutorialFusedConvBN2d(2, 3, 3)
    with pytest.raises(ValueError, match="4 channels but weight expects 2"):
        layer(torch.randn(2, 4, 5, 5))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(torch.randn(1, 2, 3, 3))
