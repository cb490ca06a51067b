"""A converted model trained beside its eager twin: the comparison the capture tests share.

``randomise_batchnorms`` gives every BatchNorm non-trivial affine parameters and running
statistics (so a BatchNorm that is skipped, folded twice or left out shows), and
``assert_steps_match`` trains both models a few steps on the same input and upstream
gradient, comparing outputs, the input's and every parameter's gradient, and every buffer
(running statistics and ``num_batches_tracked``).
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import Tensor, nn
from torch.testing import assert_close

from fusion_checks import assert_chain_ran

__all__ = ["TOL", "randomise_batchnorms", "assert_steps_match"]

#: float64 models: the fused maths agrees with eager to rounding
TOL: Dict[str, Any] = dict(rtol=1e-10, atol=1e-10)


def randomise_batchnorms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Draw each BatchNorm's weight, bias and running statistics (seeded); return the model in float64."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 1.5)
    return model.double()


def assert_steps_match(eager: nn.Module, fast: nn.Module, x: Tensor, *, steps: int = 2, fused: bool = True,
                       tol: Dict[str, Any] = TOL) -> None:
    """``steps`` training steps of both models on ``x``: outputs, input and parameter gradients,
    running statistics and ``num_batches_tracked`` equal; with ``fused``, the fused chain ran in
    every converted step."""
    for step in range(steps):
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_f = eager(xe), fast(xf)
        if fused:
            assert_chain_ran(out_f)
        g = torch.randn(out_e.shape, dtype=out_e.dtype, generator=torch.Generator().manual_seed(step))
        out_e.backward(g)
        out_f.backward(g)
        assert_close(out_f, out_e, **tol)
        assert_close(xf.grad, xe.grad, **tol)
        for (n, p), pe in zip(fast.named_parameters(), eager.parameters()):
            assert_close(p.grad, pe.grad, **tol, msg=n)
            p.grad, pe.grad = None, None
        for (n, b), be in zip(fast.named_buffers(), eager.buffers()):
            assert_close(b, be, **tol, msg=n)
