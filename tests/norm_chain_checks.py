"""One check of the per-sample norm chain's autograd Function, shared by the norm rows' tests."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from convbn.autograd.norm_chain import NormChainFunction, NormLayerSpec, norm_chain_reference


def assert_chain_function_checks(x: Tensor, params: Sequence[Optional[Tensor]], specs: Sequence[NormLayerSpec],
                                 seed: Optional[int] = None) -> None:
    """float64 ``gradcheck`` and ``gradgradcheck`` of :class:`NormChainFunction` over ``specs`` with
    respect to ``x`` and every parameter that is not ``None``; its output made by the Function's
    backward node and equal, bit for bit, to the obviously-right reference. With ``seed``, every
    call (and the reference) starts from that global RNG seed: a dropout draws one mask throughout."""
    idx = [i for i, p in enumerate(params) if p is not None]

    def f(x: Tensor, *ps: Tensor) -> Tensor:
        full = list(params)
        for i, p in zip(idx, ps):
            full[i] = p
        if seed is not None:
            torch.manual_seed(seed)
        return NormChainFunction.apply(x, *full, tuple(specs), ((None, None),) * len(specs))

    given = [params[i] for i in idx]
    assert torch.autograd.gradcheck(f, (x, *given))
    assert torch.autograd.gradgradcheck(f, (x, *given))
    out = f(x, *given)
    assert type(out.grad_fn).__name__ == "NormChainFunctionBackward"
    if seed is not None:
        torch.manual_seed(seed)
    torch.testing.assert_close(out, norm_chain_reference(x, list(params), specs), rtol=0, atol=0)
