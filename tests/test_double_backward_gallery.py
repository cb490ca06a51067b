"""Tests of the double-backward gallery: first and second derivatives against analytic ones."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch.testing import assert_close

from convbn.reference.double_backward import (
    Cube,
    CubeBackward,
    CubeOnceDifferentiable,
    Exp,
    Sinh,
    SinhWrong,
    Square,
    _cube_grad_numpy,
    cube,
    exp,
    sinh,
    sinh_wrong,
    square,
)



Fn = Callable[[torch.Tensor], torch.Tensor]

# name -> (function, eager equivalent, analytic first derivative, analytic second derivative)
CASES = {
    "square": (square, lambda x: x * x, lambda x: 2 * x, lambda x: 2 * torch.ones_like(x)),
    "exp": (exp, torch.exp, torch.exp, torch.exp),
    "sinh": (sinh, torch.sinh, torch.cosh, torch.sinh),
    "cube": (cube, lambda x: x * x * x, lambda x: 3 * x**2, lambda x: 6 * x),
}


def _x(shape=(3, 4), seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_(True)


def _first_and_second(fn: Fn, x: torch.Tensor, v: torch.Tensor, u: torch.Tensor):
    """First derivative along ``v``, then its derivative along ``u`` (no .sum() loss)."""
    (first,) = torch.autograd.grad(fn(x), x, v, create_graph=True)
    (second,) = torch.autograd.grad(
        first, x, u, allow_unused=True, materialize_grads=True, retain_graph=True
    )
    return first, second


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 1, 3)])
def test_first_and_second_derivatives_are_analytic(name: str, shape) -> None:
    fn, eager, d1, d2 = CASES[name]
    x = _x(shape)
    assert_close(fn(x), eager(x))
    v = torch.randn_like(x, requires_grad=True)
    u = torch.randn_like(x)
    first, second = _first_and_second(fn, x, v, u)
    assert_close(first, d1(x.detach()) * v.detach())
    assert_close(second, d2(x.detach()) * v.detach() * u)
    # ... and the same as autograd through the eager op, including the grad wrt v.
    first_ref, second_ref = _first_and_second(eager, x, v, u)
    assert_close(second, second_ref)
    (gv,) = torch.autograd.grad(first, v, u)
    (gv_ref,) = torch.autograd.grad(first_ref, v, u)
    assert_close(gv, gv_ref)


@pytest.mark.parametrize("fn", [square, exp, sinh, cube, Square.apply, Exp.apply, Cube.apply])
def test_gradcheck_and_gradgradcheck_pass(fn: Fn) -> None:
    x = _x((4,))
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_sinh_extra_outputs_are_differentiable() -> None:
    x = _x((6,))
    outs = Sinh.apply(x)
    refs = (torch.sinh(x), torch.exp(x), torch.exp(-x))
    for out, ref in zip(outs, refs):
        assert_close(out, ref)
    grads_out = [torch.randn_like(x) for _ in outs]
    assert_close(
        torch.autograd.grad(outs, x, grads_out)[0], torch.autograd.grad(refs, x, grads_out)[0]
    )
    assert torch.autograd.gradgradcheck(lambda t: Sinh.apply(t), (x,))


def test_exp_saves_its_output_not_its_input() -> None:
    x = _x((4,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = Exp.apply(x)
    assert len(saved) == 1 and saved[0] is y


def test_sinh_wrong_first_derivative_is_right_but_second_is_wrong() -> None:
    x = _x((5,))
    v = torch.randn_like(x, requires_grad=True)
    u = torch.randn_like(x)
    first, second = _first_and_second(sinh_wrong, x, v, u)
    assert_close(first, torch.cosh(x.detach()) * v.detach())
    analytic = torch.sinh(x.detach()) * v.detach() * u
    # The stashed exp(x), exp(-x) are constants to autograd: the x-dependence is lost.
    assert torch.count_nonzero(second) == 0
    assert not torch.allclose(second, analytic)
    assert torch.autograd.gradcheck(SinhWrong.apply, (x,))


def test_gradgradcheck_catches_sinh_wrong() -> None:
    x = _x((4,))
    assert torch.autograd.gradgradcheck(sinh_wrong, (x,), raise_exception=False) is False
    with pytest.raises(RuntimeError, match="Jacobian mismatch"):
        torch.autograd.gradgradcheck(SinhWrong.apply, (x,))


def test_cube_backward_is_untraceable_on_its_own() -> None:
    x = _x((3,))
    g = torch.randn_like(x, requires_grad=True)
    result = _cube_grad_numpy(g, x)
    assert_close(result, 3 * x.detach() ** 2 * g.detach())
    assert result.grad_fn is None and not result.requires_grad


def test_cube_backward_function_checks_to_third_order() -> None:
    g, x = _x((3,), seed=1), _x((3,), seed=2)
    assert torch.autograd.gradcheck(CubeBackward.apply, (g, x))
    assert torch.autograd.gradgradcheck(CubeBackward.apply, (g, x))
    # Third derivative of x**3 is 6, reached through CubeBackward's own backward.
    x = _x((4,))
    (d1,) = torch.autograd.grad(cube(x), x, torch.ones_like(x), create_graph=True)
    (d2,) = torch.autograd.grad(d1, x, torch.ones_like(x), create_graph=True)
    (d3,) = torch.autograd.grad(d2, x, torch.ones_like(x))
    assert_close(d3, torch.full_like(x, 6.0))


def test_once_differentiable_cube_refuses_double_backward() -> None:
    x = _x((4,))
    assert torch.autograd.gradcheck(CubeOnceDifferentiable.apply, (x,))
    grad_out = torch.randn_like(x, requires_grad=True)
    (first,) = torch.autograd.grad(CubeOnceDifferentiable.apply(x), x, grad_out, create_graph=True)
    assert_close(first, 3 * x.detach() ** 2 * grad_out.detach())
    with pytest.raises(RuntimeError, match="once_differentiable"):
        first.backward(torch.randn_like(first))


@pytest.mark.parametrize("fn", [square, exp, sinh, sinh_wrong, cube])
def test_bad_input_raises_type_error(fn: Fn) -> None:
    with pytest.raises(TypeError, match="Tensor"):
        fn([1.0, 2.0])
    with pytest.raises(TypeError, match="floating-point"):
        fn(torch.ones(2, dtype=torch.int64))
