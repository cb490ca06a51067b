"""Conv2d as a custom autograd Function, checked against ``F.conv2d``.

Runs the reference :class:`~convbn.reference.conv2d.Conv2dFunction` (backward written
as ``conv2d(X^T, G^T)^T`` for the weight and ``conv_transpose2d(G, W)`` for the input),
compares output and both gradients with eager ``F.conv2d`` for a random upstream
gradient, runs ``gradcheck`` and ``gradgradcheck`` in float64, and draws the graph.

Usage: ``python examples/conv2d_function.py [--out DIR]``
"""
import torch
import torch.nn.functional as F
from _common import check, draw_graph, finish, parse_out_dir

from convbn.reference.conv2d import Conv2dFunction, conv2d_reference

__all__ = ["main"]


def main() -> None:
    out_dir = parse_out_dir(__doc__.splitlines()[0])
    torch.manual_seed(0)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)

    for stride, padding in [(1, 0), (1, 1), (2, 1)]:
        y = conv2d_reference(x, w, stride=stride, padding=padding)
        y_ref = F.conv2d(x, w, stride=stride, padding=padding)
        grad_out = torch.randn_like(y)
        grads = torch.autograd.grad(y, (x, w), grad_out)
        grads_ref = torch.autograd.grad(y_ref, (x, w), grad_out)
        same = torch.allclose(y, y_ref) and all(
            torch.allclose(a, b) for a, b in zip(grads, grads_ref)
        )
        check(f"stride={stride} padding={padding}: output, dX, dW match F.conv2d", same)

        def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return Conv2dFunction.apply(a, b, stride, padding)

        check(f"stride={stride} padding={padding}: gradcheck", torch.autograd.gradcheck(fn, (x, w)))
        check(
            f"stride={stride} padding={padding}: gradgradcheck (backward is differentiable)",
            torch.autograd.gradgradcheck(fn, (x, w)),
        )

    y = conv2d_reference(x, w, padding=1)
    draw_graph(y, "conv2d_forward", out_dir, params={"X": x, "W": w})
    # The backward graph itself: dX as a function of X, W and the upstream gradient.
    grad_out = torch.randn_like(y, requires_grad=True)
    grad_x, = torch.autograd.grad(y, x, grad_out, create_graph=True)
    draw_graph(grad_x, "conv2d_grad_input", out_dir, params={"X": x, "W": w, "G": grad_out})
    finish()


if __name__ == "__main__":
    main()
