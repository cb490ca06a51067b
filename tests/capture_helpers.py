"""Side-by-side training of a converted model and its eager twin, for the capture tests:
the same steps on both, then outputs, every gradient, running statistics and
``num_batches_tracked`` compared exactly (float64)."""
from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

__all__ = ["twins", "step", "assert_same_state", "assert_same_grads", "TOL"]

TOL = dict(rtol=1e-9, atol=1e-9)


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


def step(model: nn.Module, *args: Any, seed: int = 0, **kwargs: Any) -> Tensor:
    """One forward (``seed`` fixes the RNG) and a backward with a fixed upstream gradient."""
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 100))
    if out.requires_grad:
        out.backward(grad)
    return out.detach()


def assert_same_grads(eager: nn.Module, converted: nn.Module) -> None:
    for (name, p), q in zip(eager.named_parameters(), converted.parameters()):
        if p.grad is None:
            assert q.grad is None, f"{name}: eager has no .grad, the converted model has one"
        else:
            assert q.grad is not None, f"{name}: eager has a .grad, the converted model has none"
            torch.testing.assert_close(q.grad, p.grad, **TOL, msg=f"gradient of {name}")


def assert_same_state(eager: nn.Module, converted: nn.Module) -> None:
    """Every buffer (running statistics, ``num_batches_tracked``) and gradient equal."""
    for (name, b), c in zip(eager.named_buffers(), converted.buffers()):
        torch.testing.assert_close(c, b, **TOL, msg=f"buffer {name}")
    assert_same_grads(eager, converted)
