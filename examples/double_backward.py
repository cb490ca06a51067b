"""Double backward through custom Functions: the cases that work and the mistake.

For each Function of :mod:`convbn.reference.double_backward` this runs ``gradcheck`` and
``gradgradcheck``, compares the second derivative with the analytic one, and draws the
graph of the first derivative (built with ``create_graph=True``), which is the graph
autograd differentiates the second time:

1. saving an input (``x**2``);
2. saving an output (``exp``);
3. saving intermediates by returning them as extra outputs (``sinh`` from
   ``exp(x)`` and ``exp(-x)``);
4. the wrong way: intermediates stashed on ``ctx`` -- the second derivative is silently
   wrong and ``gradgradcheck`` catches it;
5. a backward autograd cannot trace (NumPy) wrapped in its own Function (``x**3``).

Usage: ``python examples/double_backward.py [--out DIR]``
"""
import torch
from _common import check, draw_graph, finish, parse_out_dir

from convbn.reference.double_backward import (
    CubeOnceDifferentiable,
    cube,
    exp,
    sinh,
    sinh_wrong,
    square,
)

# (name, function, analytic second derivative, expected to pass gradgradcheck)
CASES = [
    ("save_input_square", square, lambda x: 2 * torch.ones_like(x), True),
    ("save_output_exp", exp, torch.exp, True),
    ("save_intermediate_sinh", sinh, torch.sinh, True),
    ("wrong_ctx_stash_sinh", sinh_wrong, torch.sinh, False),
    ("untraceable_backward_cube", cube, lambda x: 6 * x, True),
]

__all__ = ["main"]


def main() -> None:
    out_dir = parse_out_dir(__doc__.splitlines()[0])
    torch.manual_seed(0)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    for name, fn, second, supports_double in CASES:
        print(f"--- {name}")
        check(f"{name}: gradcheck", torch.autograd.gradcheck(fn, (x,)))
        ggc = torch.autograd.gradgradcheck(fn, (x,), raise_exception=False)
        if supports_double:
            check(f"{name}: gradgradcheck passes", ggc)
        else:
            check(f"{name}: gradgradcheck detects the missing second-order graph", not ggc)

        # d/dx (dy/dx * v) = y'' * v for an element-wise function. The upstream gradient v
        # requires grad, as in gradgradcheck, so the first derivative always has a graph;
        # in the wrong case that graph reaches v but never x.
        v = torch.randn_like(x, requires_grad=True)
        (first,) = torch.autograd.grad(fn(x), x, v, create_graph=True)
        # Draw before differentiating again: that frees the graph's saved tensors.
        draw_graph(first, f"double_backward_{name}", out_dir, params={"x": x, "v": v})
        (second_got,) = torch.autograd.grad(first, x, torch.ones_like(x), allow_unused=True,
                                            materialize_grads=True)
        right = torch.allclose(second_got, second(x.detach()) * v.detach())
        print(f"second derivative {'matches' if right else 'DIFFERS FROM'} the analytic one: "
              f"got {second_got.tolist()}")
        check(f"{name}: second derivative is {'right' if supports_double else 'wrong, as expected'}",
              right == supports_double)

    print("--- once_differentiable_cube (no wrapper Function)")
    check("once_differentiable: gradcheck", torch.autograd.gradcheck(CubeOnceDifferentiable.apply, (x,)))
    grad_out = torch.randn_like(x, requires_grad=True)
    (first,) = torch.autograd.grad(CubeOnceDifferentiable.apply(x), x, grad_out, create_graph=True)
    try:
        first.backward(torch.ones_like(first))
        raised = False
    except RuntimeError as error:
        raised = True
        print(f"double backward refused: {error}")
    check("once_differentiable: double backward raises instead of being wrong", raised)
    finish()


if __name__ == "__main__":
    main()
