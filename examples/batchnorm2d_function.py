"""The tutorial's training-mode BatchNorm2d as a custom Function with a lean backward.

Checks :class:`~convbn.reference.batchnorm2d.BatchNorm2dFunction` (eps outside the
square root, unbiased variance, affine=False) against the same formula written with
plain differentiable ops, for outputs and input gradients; runs ``gradcheck``; shows
that its in-place backward is ``once_differentiable`` (double backward raises); and
compares what each version keeps alive for backward.

Usage: ``python examples/batchnorm2d_function.py [--out DIR]``
"""
import torch
from _common import check, draw_graph, finish, parse_out_dir

from convbn.reference.batchnorm2d import (
    BatchNorm2dFunction,
    batch_norm2d_formula,
    batch_norm2d_reference,
)
from convbn.memory import format_bytes, track_saved

__all__ = ["main"]


def main() -> None:
    out_dir = parse_out_dir(__doc__.splitlines()[0])
    torch.manual_seed(0)
    for shape in [(2, 3, 4, 4), (5, 2, 3, 1)]:
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        y = batch_norm2d_reference(x)
        y_ref = batch_norm2d_formula(x)
        grad_out = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, grad_out)
        (gx_ref,) = torch.autograd.grad(y_ref, x, grad_out)
        check(f"{shape}: output and dX match the eager formula",
              torch.allclose(y, y_ref) and torch.allclose(gx, gx_ref))
        check(f"{shape}: gradcheck", torch.autograd.gradcheck(BatchNorm2dFunction.apply, (x,)))

    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    y = batch_norm2d_reference(x)
    grad_out = torch.randn_like(y, requires_grad=True)
    (gx,) = torch.autograd.grad(y, x, grad_out, create_graph=True)
    try:
        gx.backward(torch.randn_like(gx))
        raised = False
    except RuntimeError as error:
        raised = True
        print(f"double backward refused, as intended: {str(error).splitlines()[0]}")
    check("double backward raises (once_differentiable)", raised)

    big = torch.randn(8, 16, 32, 32, requires_grad=True)
    with track_saved() as lean:
        out_lean = batch_norm2d_reference(big)
    with track_saved() as eager:
        out_eager = batch_norm2d_formula(big)
    print(f"kept for backward: custom Function {format_bytes(lean.result.total)}, "
          f"eager formula {format_bytes(eager.result.total)} (input is {format_bytes(big.nbytes)})")
    check("custom Function keeps less than the eager formula", lean.result.total < eager.result.total)
    del out_lean, out_eager

    draw_graph(y, "batchnorm2d_forward", out_dir, params={"X": x})
    finish()


if __name__ == "__main__":
    main()
