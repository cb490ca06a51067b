"""A custom Linear Function and module, and the ``ctx`` tools of custom Functions.

* :class:`~convbn.reference.linear.Linear` (through ``LinearFunction``) against ``F.linear``:
  outputs and all gradients, with and without bias; ``gradcheck``/``gradgradcheck``.
* ``ctx.needs_input_grad``: a frozen weight gets no gradient computed.
* ``ctx.mark_dirty``: an in-place scaled ReLU.
* ``ctx.mark_non_differentiable``: sort returning int64 indices.
* ``ctx.set_materialize_grads(False)``: ``(sin, cos)`` with only one output used.

Usage: ``python examples/linear_function.py [--out DIR]``
"""
import torch
import torch.nn.functional as F
from _common import check, draw_graph, finish, parse_out_dir

from convbn.reference.ctx_tools import scaled_relu_, sin_cos, sort_with_indices
from convbn.reference.linear import Linear, LinearFunction

__all__ = ["main"]


def main() -> None:
    out_dir = parse_out_dir(__doc__.splitlines()[0])
    torch.manual_seed(0)
    for bias in (True, False):
        layer = Linear(4, 3, bias=bias, dtype=torch.float64)
        print(layer)
        x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
        params = [p for p in (layer.weight, layer.bias) if p is not None]
        y = layer(x)
        y_ref = F.linear(x, layer.weight, layer.bias)
        grad_out = torch.randn_like(y)
        grads = torch.autograd.grad(y, [x, *params], grad_out)
        grads_ref = torch.autograd.grad(y_ref, [x, *params], grad_out)
        check(f"bias={bias}: output and all gradients match F.linear",
              torch.allclose(y, y_ref) and all(torch.allclose(a, b) for a, b in zip(grads, grads_ref)))
        check(f"bias={bias}: gradcheck + gradgradcheck",
              torch.autograd.gradcheck(LinearFunction.apply, (x, *params))
              and torch.autograd.gradgradcheck(LinearFunction.apply, (x, *params)))

    frozen = Linear(4, 3)
    frozen.weight.requires_grad_(False)
    frozen(torch.randn(2, 4, requires_grad=True)).backward(torch.randn(2, 3))
    check("needs_input_grad: frozen weight gets no gradient", frozen.weight.grad is None)

    x = torch.randn(6, requires_grad=True)
    hidden = x * 1.0
    version_before = hidden._version
    out = scaled_relu_(hidden, 2.0)
    out.backward(torch.ones(6))
    check("mark_dirty: returns its modified input", out is hidden and hidden._version > version_before)
    check("mark_dirty: gradient is 2 where x > 0", torch.equal(x.grad, 2.0 * (x > 0).float()))

    v = torch.randn(3, 4, requires_grad=True)
    values, indices = sort_with_indices(v, dim=1)
    check("mark_non_differentiable: indices are int64 without grad",
          indices.dtype == torch.int64 and not indices.requires_grad and values.requires_grad)

    t = torch.randn(5, requires_grad=True)
    s, _unused_cos = sin_cos(t)
    s.backward(torch.ones(5))
    check("set_materialize_grads(False): only sin used, grad is cos", torch.allclose(t.grad, t.detach().cos()))

    xg = torch.randn(2, 4, requires_grad=True)
    draw_graph(Linear(4, 3)(xg), "linear_function", out_dir, params={"x": xg})
    finish()


if __name__ == "__main__":
    main()
