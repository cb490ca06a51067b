"""Tests of LinearFunction / Linear and the ctx-tool Functions, against eager torch."""
from __future__ import annotations

from typing import Any, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from convbn.reference.ctx_tools import (
    ScaledReLUInplace,
    SinCos,
    SortWithIndices,
    scaled_relu_,
    sin_cos,
    sort_with_indices,
)
from convbn.reference.linear import Linear, LinearFunction, linear_reference



def _randn(*shape: int, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


# ------------------------------------------------------------------ LinearFunction


@pytest.mark.parametrize("lead", [(5,), (2, 3), (4, 1, 2), ()])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_eager(lead, bias: bool) -> None:
    torch.manual_seed(0)
    x, w = _randn(*lead, 4), _randn(3, 4)
    b = _randn(3) if bias else None
    y = linear_reference(x, w, b)
    y_ref = F.linear(x, w, b)
    assert_close(y, y_ref)
    grad_out = torch.randn_like(y)
    leaves = [t for t in (x, w, b) if t is not None]
    for got, expected in zip(
        torch.autograd.grad(y, leaves, grad_out), torch.autograd.grad(y_ref, leaves, grad_out)
    ):
        assert_close(got, expected)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradcheck_and_gradgradcheck(bias: bool) -> None:
    torch.manual_seed(1)
    args = (_randn(2, 3, 4), _randn(3, 4)) + ((_randn(3),) if bias else ())
    assert torch.autograd.gradcheck(LinearFunction.apply, args)
    assert torch.autograd.gradgradcheck(LinearFunction.apply, args)


class _CountMatmul(TorchDispatchMode):
    """Counts matrix-multiply kernels (what each weight/input gradient costs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.matmul):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "needs, expected_matmuls", [((True, False, False), 1), ((False, True, False), 1),
                                ((False, False, True), 0), ((True, True, True), 2)]
)
def test_linear_computes_only_needed_gradients(needs, expected_matmuls: int) -> None:
    x = _randn(5, 4, requires_grad=needs[0])
    w = _randn(3, 4, requires_grad=needs[1])
    b = _randn(3, requires_grad=needs[2])
    y = LinearFunction.apply(x, w, b)
    with _CountMatmul() as counter:
        y.backward(torch.randn_like(y))
    assert counter.calls == expected_matmuls
    for tensor, needed in zip((x, w, b), needs):
        assert (tensor.grad is not None) == needed


@pytest.mark.parametrize(
    "x_shape, w_shape, b_shape, match",
    [
        ((2, 4), (3, 4, 1), None, "2-D weight"),
        ((2, 5), (3, 4), None, "in_features=4"),
        ((2, 4), (3, 4), (4,), "bias of shape"),
    ],
)
def test_linear_bad_shapes(x_shape, w_shape, b_shape, match) -> None:
    b = torch.randn(*b_shape) if b_shape else None
    with pytest.raises(ValueError, match=match):
        linear_reference(torch.randn(*x_shape), torch.randn(*w_shape), b)
    with pytest.raises(TypeError, match="bias must be a Tensor"):
        linear_reference(torch.randn(2, 4), torch.randn(3, 4), 1.0)


# ------------------------------------------------------------------ Linear module


@pytest.mark.parametrize("bias", [True, False])
def test_linear_module_init_and_state_dict_like_nn_linear(bias: bool) -> None:
    torch.manual_seed(123)
    ours = Linear(6, 4, bias=bias, dtype=torch.float64)
    torch.manual_seed(123)
    ref = nn.Linear(6, 4, bias=bias, dtype=torch.float64)
    # Same initialisation scheme and RNG order: identical parameters.
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert_close(ours.state_dict()[key], value)
    assert repr(ours) == repr(ref)
    ours.load_state_dict(ref.state_dict())

    x = _randn(3, 6)
    y, y_ref = ours(x), ref(x)
    assert_close(y, y_ref)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    y_ref.backward(grad_out)
    for p, p_ref in zip(ours.parameters(), ref.parameters()):
        assert_close(p.grad, p_ref.grad)


def test_linear_module_arguments() -> None:
    layer = Linear(2, 3, device="cpu", dtype=torch.float64)
    assert layer.weight.dtype == torch.float64 and layer.bias.shape == (3,)
    assert Linear(2, 3, bias=False).bias is None
    with pytest.raises(ValueError, match="in_features"):
        Linear(-1, 3)
    with pytest.raises(TypeError, match="bias must be a bool"):
        Linear(2, 3, bias="yes")


# ------------------------------------------------------------------ mark_dirty


@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_scaled_relu_inplace_matches_eager(scale: float) -> None:
    x = _randn(4, 5)
    hidden = x * 1.0
    version = hidden._version
    out = scaled_relu_(hidden, scale)
    assert out is hidden and hidden._version > version
    assert out.grad_fn is not None and "ScaledReLUInplace" in type(out.grad_fn).__name__
    y_ref = F.relu(x) * scale
    assert_close(out, y_ref)
    grad_out = torch.randn_like(out)
    assert_close(
        torch.autograd.grad(out, x, grad_out)[0], torch.autograd.grad(y_ref, x, grad_out)[0]
    )


def test_scaled_relu_gradcheck() -> None:
    x = _randn(6)
    x.data[x.data.abs() < 0.1] = 0.5  # keep away from the kink for finite differences
    assert torch.autograd.gradcheck(lambda t: scaled_relu_(t * 1.0, 2.0), (x,))


def test_mark_dirty_invalidates_earlier_saves_of_the_input() -> None:
    x = _randn(5)
    hidden = x * 1.0
    other = hidden.sin()  # saves `hidden` for its backward
    scaled_relu_(hidden, 2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward(torch.randn_like(other))


def test_scaled_relu_bad_input() -> None:
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        scaled_relu_(_randn(3), 2.0)
    with pytest.raises(ValueError, match="scale must be a positive"):
        scaled_relu_(torch.randn(3), 0.0)
    with pytest.raises(TypeError, match="floating-point"):
        scaled_relu_(torch.ones(3, dtype=torch.int64), 1.0)
    assert issubclass(ScaledReLUInplace, torch.autograd.Function)


# ------------------------------------------------------------------ mark_non_differentiable


@pytest.mark.parametrize("shape, dim", [((7,), 0), ((3, 5), 1), ((3, 5), 0), ((2, 3, 4), -1)])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_with_indices_matches_torch_sort(shape, dim: int, descending: bool) -> None:
    x = _randn(*shape)
    values, indices = sort_with_indices(x, dim=dim, descending=descending)
    ref_values, ref_indices = torch.sort(x, dim=dim, descending=descending)
    assert_close(values, ref_values)
    assert torch.equal(indices, ref_indices)
    assert indices.dtype == torch.int64 and not indices.requires_grad
    grad_out = torch.randn_like(values)
    assert_close(
        torch.autograd.grad(values, x, grad_out)[0],
        torch.autograd.grad(ref_values, x, grad_out)[0],
    )


def test_sort_gradcheck_and_bad_dim() -> None:
    x = _randn(3, 4)
    assert torch.autograd.gradcheck(lambda t: SortWithIndices.apply(t, 1, False)[0], (x,))
    assert torch.autograd.gradgradcheck(lambda t: sort_with_indices(t, 0)[0], (x,))
    with pytest.raises(ValueError, match="dim must be in"):
        sort_with_indices(x, dim=2)
    with pytest.raises(ValueError, match="0-d"):
        sort_with_indices(torch.tensor(1.0))


# ------------------------------------------------------------------ set_materialize_grads


class _RecordingSinCos(SinCos):
    """SinCos that records which gradients its backward received."""

    received: List[tuple] = []

    @staticmethod
    def backward(ctx: Any, grad_sin: Optional[torch.Tensor], grad_cos: Optional[torch.Tensor]):
        _RecordingSinCos.received.append((grad_sin is None, grad_cos is None))
        return SinCos.backward(ctx, grad_sin, grad_cos)


@pytest.mark.parametrize("use", ["sin", "cos", "both"])
def test_sin_cos_handles_unused_outputs_as_none(use: str) -> None:
    _RecordingSinCos.received.clear()
    x = _randn(6)
    s, c = _RecordingSinCos.apply(x)
    ref_s, ref_c = torch.sin(x), torch.cos(x)
    assert_close(s, ref_s)
    assert_close(c, ref_c)
    outputs = {"sin": [s], "cos": [c], "both": [s, c]}[use]
    refs = {"sin": [ref_s], "cos": [ref_c], "both": [ref_s, ref_c]}[use]
    grads_out = [torch.randn_like(x) for _ in outputs]
    (got,) = torch.autograd.grad(outputs, x, grads_out)
    (expected,) = torch.autograd.grad(refs, x, grads_out)
    assert_close(got, expected)
    # Unused outputs arrive as None, not as materialised zeros.
    assert _RecordingSinCos.received == [(use == "cos", use == "sin")]


def test_sin_cos_gradcheck() -> None:
    x = _randn(5)
    assert torch.autograd.gradcheck(sin_cos, (x,))
    assert torch.autograd.gradgradcheck(sin_cos, (x,))
    with pytest.raises(TypeError, match="Tensor"):
        sin_cos(1.0)
