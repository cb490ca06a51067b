"""Side-by-side training of a converted model and its eager twin, for the capture tests:
the same steps on both, then outputs, every gradient, running statistics and
``num_batches_tracked`` compared exactly (float64)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from fusion_checks import assert_chain_ran

__all__ = ["twins", "perturbed_twins", "step", "assert_same_state", "assert_same_grads", "TOL", "TIGHT", "randomise_batchnorms",
           "assert_steps_match"]

TOL = dict(rtol=1e-9, atol=1e-9)
#: models whose fused maths agrees with eager to rounding in float64
TIGHT: Dict[str, Any] = dict(rtol=1e-10, atol=1e-10)


def twins(make: Callable[[], nn.Module], seed: int = 0) -> Tuple[nn.Module, nn.Module]:
    """Two identical float64 models (the second one to be converted)."""
    torch.manual_seed(seed)
    eager = make().double()
    with torch.no_grad():
        for m in eager.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return eager, copy.deepcopy(eager)


def perturbed_twins(make: Callable[[], nn.Module], seed: int = 0) -> Tuple[nn.Module, nn.Module]:
    """Two identical float64 models (the second one to be converted) with every parameter moved by
    ``0.1 * N(0, 1)``: a norm's affine parameters away from 1 / 0, whatever the norm."""
    torch.manual_seed(seed)
    eager = make().double()
    with torch.no_grad():
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return eager, copy.deepcopy(eager)


def step(model: nn.Module, *args: Any, seed: int = 0, **kwargs: Any) -> Tensor:
    """One forward (``seed`` fixes the RNG) and a backward with a fixed upstream gradient."""
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 100))
    if out.requires_grad:
        out.backward(grad)
    return out.detach()


def assert_same_grads(eager: nn.Module, converted: nn.Module, tol: Optional[Dict[str, Any]] = None) -> None:
    tol = TOL if tol is None else tol
    for (name, p), q in zip(eager.named_parameters(), converted.parameters()):
        if p.grad is None:
            assert q.grad is None, f"{name}: eager has no .grad, the converted model has one"
        else:
            assert q.grad is not None, f"{name}: eager has a .grad, the converted model has none"
            torch.testing.assert_close(q.grad, p.grad, **tol, msg=f"gradient of {name}")


def assert_same_state(eager: nn.Module, converted: nn.Module, tol: Optional[Dict[str, Any]] = None) -> None:
    """Every buffer (running statistics, ``num_batches_tracked``) and gradient equal."""
    for (name, b), c in zip(eager.named_buffers(), converted.buffers()):
        torch.testing.assert_close(c, b, **(TOL if tol is None else tol), msg=f"buffer {name}")
    assert_same_grads(eager, converted, tol)


def randomise_batchnorms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Draw each BatchNorm's weight, bias *and running statistics* (seeded; a BatchNorm skipped,
    folded twice or left out then shows); return the model in float64."""
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
                       tol: Dict[str, Any] = TIGHT) -> None:
    """``steps`` training steps of both models on ``x``: outputs, the input's and every
    parameter's gradient, running statistics and ``num_batches_tracked`` equal; with ``fused``,
    the fused chain ran in every converted step. Gradients are cleared after each step."""
    for k in range(steps):
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_f = eager(xe), fast(xf)
        if fused:
            assert_chain_ran(out_f)
        g = torch.randn(out_e.shape, dtype=out_e.dtype, generator=torch.Generator().manual_seed(k))
        out_e.backward(g)
        out_f.backward(g)
        torch.testing.assert_close(out_f, out_e, **tol)
        torch.testing.assert_close(xf.grad, xe.grad, **tol)
        assert_same_state(eager, fast, tol)
        for model in (eager, fast):
            model.zero_grad(set_to_none=True)
