"""Tests of the reference Conv2dFunction against eager ``F.conv2d``."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import convbn.reference.conv2d as conv_module
from convbn.reference.conv2d import (
    Conv2dFunction,
    conv2d_input_grad,
    conv2d_reference,
    conv2d_weight_grad,
)



# (N, C_in, H, W, C_out, kernel, stride, padding)
CONFIGS = [
    (2, 3, 6, 6, 4, (3, 3), 1, 0),
    (1, 2, 5, 7, 3, (3, 3), 1, 1),
    (3, 1, 4, 4, 2, (1, 1), 1, 0),
    (2, 2, 7, 6, 3, (3, 2), 2, 1),
    (2, 2, 9, 8, 2, (2, 3), (2, 3), (1, 0)),
]


def _make(config, requires_grad: bool = True, seed: int = 0):
    n, c_in, h, w, c_out, kernel, stride, padding = config
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c_in, h, w, dtype=torch.float64, generator=gen).requires_grad_(requires_grad)
    weight = torch.randn(c_out, c_in, *kernel, dtype=torch.float64, generator=gen)
    return x, weight.requires_grad_(requires_grad), stride, padding


@pytest.mark.parametrize("config", CONFIGS)
def test_output_and_gradients_match_eager(config) -> None:
    x, w, stride, padding = _make(config)
    y = conv2d_reference(x, w, stride=stride, padding=padding)
    y_ref = F.conv2d(x, w, stride=stride, padding=padding)
    assert_close(y, y_ref)
    grad_out = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), grad_out)
    grads_ref = torch.autograd.grad(y_ref, (x, w), grad_out)
    for got, expected in zip(grads, grads_ref):
        assert_close(got, expected)


@pytest.mark.parametrize("config", CONFIGS[:4])
def test_gradcheck_and_gradgradcheck(config) -> None:
    # Smaller channels keep the finite-difference Jacobians cheap.
    n, _c_in, h, w, _c_out, kernel, stride, padding = config
    x, weight, stride, padding = _make((1 if n > 1 else n, 2, h, w, 2, kernel, stride, padding))

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return Conv2dFunction.apply(a, b, stride, padding)

    assert torch.autograd.gradcheck(fn, (x, weight))
    assert torch.autograd.gradgradcheck(fn, (x, weight))


def test_second_derivative_matches_eager() -> None:
    x, w, stride, padding = _make(CONFIGS[3])
    outs = []
    grad_out = None
    for conv in (conv2d_reference, F.conv2d):
        y = conv(x, w, stride=stride, padding=padding)
        if grad_out is None:
            grad_out = torch.randn_like(y)
            probe = (torch.randn_like(x), torch.randn_like(w))
        gx, gw = torch.autograd.grad(y, (x, w), grad_out, create_graph=True)
        # Differentiate the gradients again along random directions (no .sum() loss).
        outs.append(
            torch.autograd.grad((gx, gw), (x, w), probe, allow_unused=True, materialize_grads=True)
        )
    for got, expected in zip(*outs):
        assert_close(got, expected)


@pytest.mark.parametrize("which", [0, 1])
def test_only_needed_gradients_are_computed(which: int, monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, stride, padding = _make(CONFIGS[0], requires_grad=False)
    (x if which == 0 else w).requires_grad_(True)

    def forbidden(*args, **kwargs):
        raise AssertionError("computed a gradient nobody asked for")

    # The gradient of the tensor that does not require grad must never be computed.
    monkeypatch.setattr(conv_module, "conv2d_weight_grad" if which == 0 else "conv2d_input_grad", forbidden)
    y = conv2d_reference(x, w, stride=stride, padding=padding)
    y.backward(torch.randn_like(y))
    assert (x.grad is not None) == (which == 0)
    assert (w.grad is not None) == (which == 1)


def test_gradient_helpers_shapes() -> None:
    x, w, _, _ = _make(CONFIGS[3])
    y = F.conv2d(x, w, stride=2, padding=1)
    g = torch.randn_like(y)
    assert conv2d_weight_grad(x, g, (3, 2), (2, 2), (1, 1)).shape == w.shape
    assert conv2d_input_grad(g, w, x.shape, (2, 2), (1, 1)).shape == x.shape


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(groups=2), ValueError, "groups=1"),
        (dict(dilation=2), ValueError, "dilation=1"),
        (dict(stride=0), ValueError, "stride must be >= 1"),
        (dict(padding=-1), ValueError, "padding must be >= 0"),
        (dict(padding=(1, 2, 3)), TypeError, "pair of ints"),
        (dict(stride=1.5), TypeError, "stride"),
    ],
)
def test_unsupported_options_raise(kwargs, error, match) -> None:
    x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 2, 3, 3)
    groups = kwargs.pop("groups", 1)
    dilation = kwargs.pop("dilation", 1)
    stride = kwargs.pop("stride", 1)
    padding = kwargs.pop("padding", 0)
    with pytest.raises(error, match=match):
        conv_module._check_conv_args(x, w, stride, padding, dilation, groups)
    if groups == 1 and dilation == 1:
        with pytest.raises(error, match=match):
            conv2d_reference(x, w, stride=stride, padding=padding)


@pytest.mark.parametrize(
    "x_shape, w_shape, match",
    [
        ((2, 5, 5), (2, 2, 3, 3), "4-D input"),
        ((1, 2, 5, 5), (2, 2, 3), "4-D weight"),
        ((1, 3, 5, 5), (2, 2, 3, 3), "3 channels but weight expects 2"),
        ((1, 2, 2, 2), (2, 2, 3, 3), "smaller than the kernel"),
    ],
)
def test_bad_shapes_raise_value_error(x_shape, w_shape, match) -> None:
    with pytest.raises(ValueError, match=match):
        conv2d_reference(torch.randn(*x_shape), torch.randn(*w_shape))


def test_non_tensor_raises_type_error() -> None:
    with pytest.raises(TypeError, match="expects tensors"):
        conv2d_reference([[1.0]], torch.randn(1, 1, 1, 1))
