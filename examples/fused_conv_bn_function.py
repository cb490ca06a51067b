"""The tutorial's fused Conv2d + BatchNorm2d: keep the conv input, recompute the conv.

Builds :class:`~convbn.reference.tutorial_fused.TutorialFusedConvBN2d`, compares it with the same
maths run unfused in eager ops (outputs and the gradients of input and weight, for a
random upstream gradient), runs :func:`convbn.gradcheck.gradcheck_module` on it, shows
how much less it keeps alive for backward, and draws its graph.

Usage: ``python examples/fused_conv_bn_function.py [--out DIR]``
"""
import torch
from _common import check, draw_graph, finish, parse_out_dir

from convbn.gradcheck import gradcheck_module
from convbn.memory import format_bytes, track_saved
from convbn.reference.tutorial_fused import TutorialFusedConvBN2d, tutorial_conv_bn2d_formula

__all__ = ["main"]


def main() -> None:
    out_dir = parse_out_dir(__doc__.splitlines()[0])
    torch.manual_seed(0)
    layer = TutorialFusedConvBN2d(3, 4, 3, dtype=torch.float64)
    print(layer)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    y_ref = tutorial_conv_bn2d_formula(x, layer.weight, layer.eps)
    grad_out = torch.randn_like(y)
    # retain_graph: the graphs are drawn at the end, and drawing reads saved tensors.
    grads = torch.autograd.grad(y, (x, layer.weight), grad_out, retain_graph=True)
    grads_ref = torch.autograd.grad(y_ref, (x, layer.weight), grad_out, retain_graph=True)
    check("output matches unfused conv + tutorial BatchNorm", torch.allclose(y, y_ref))
    check("dX and dW match", all(torch.allclose(a, b) for a, b in zip(grads, grads_ref)))

    small = TutorialFusedConvBN2d(2, 3, 3)
    report = gradcheck_module(small, torch.randn(2, 2, 4, 4), check_grad_grad=False)
    print(report)
    check("gradcheck_module (input and weight)", report.first_order)

    big_layer = TutorialFusedConvBN2d(16, 32, 3)
    big = torch.randn(8, 16, 32, 32, requires_grad=True)
    with track_saved() as fused:
        out_fused = big_layer(big)
    with track_saved() as eager:
        out_eager = tutorial_conv_bn2d_formula(big, big_layer.weight, big_layer.eps)
    print(f"kept for backward: fused {format_bytes(fused.result.total)}, "
          f"unfused {format_bytes(eager.result.total)}")
    check("fused keeps less for backward", fused.result.total < eager.result.total)
    del out_fused, out_eager

    draw_graph(y, "fused_conv_bn", out_dir, params={"X": x, "W": layer.weight})
    draw_graph(y_ref, "unfused_conv_bn", out_dir, params={"X": x, "W": layer.weight})
    finish()


if __name__ == "__main__":
    main()
