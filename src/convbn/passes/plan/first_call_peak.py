"""The "never above eager" safeguard of a chain converted without ``example_inputs``.

Note: [never above eager, without example inputs]
With ``example_inputs``, ``convert(strategy="auto")`` measures the fused step against
eager's and runs the chains as eager modules where the fused one peaks higher (Note: [never
above eager] in auto_plan.py). Without them nothing is measured up front, and a chain whose
weights outweigh its activations (a small ``Linear -> BatchNorm1d -> ReLU`` head: its
weight-gradient buffers and recompute transient are not paid for by what it stops keeping)
would peak above eager. So on its first training call, right after its plan is made, such
a chain measures one training step of itself on that call's input twice -- fused, and as
its eager modules (:class:`convbn.memory.tensor_peak`, exact; loss: the output's mean
square; gradients existing, as from the second step on) -- with its running statistics, gradients and RNG untouched, and unless the fused step peaks at most 90 % of
the eager one it runs as eager modules from then on (the chain alone is not the whole step:
around it the step's own tensors add up differently, measured up to 1.2x eager for chains
whose own fused peak was 0.98-0.99x its eager layers'; 0.9 is the same margin as the
example-inputs path's "within 10 %" check) (``FusedChain.eager``, with the reason the report shows).
Measured: chains of linear layers only (the heads of classifiers, MLPs) whose activations
are under eight times their parameters. A chain of convolutions is not: its weights are
shared over every position, what it stops keeping grows with the image while its
transients do not, and a per-chain measurement at small test sizes would turn off chains
the whole step does not peak in (with ``example_inputs`` the whole step is measured).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Sequence

import torch
from torch import Tensor

from ...memory import tensor_peak
from ...nn.chain import FusedChain
from ..check.validate import buffers_set_aside, seeded

__all__ = ["peak_above_eager"]

#: activations at least this many times a chain's parameters: not measured (Note above)
ACTIVATION_RATIO = 8
#: the fused chain's measured peak must be at most this fraction of its eager layers' (Note above)
MARGIN = 0.9


def _params(chain: FusedChain) -> List[Tensor]:
    found: dict = {}
    for l in chain.layers:
        for t in (l.weight if l.conv is not None else None, l.bias if l.conv is not None else None,
                  getattr(l.bn, "weight", None), getattr(l.bn, "bias", None), *l.tail_params()):
            if isinstance(t, Tensor) and t.requires_grad:
                found.setdefault(id(t), t)
    return list(found.values())


def _measure(chain: FusedChain, fn: Callable[[Tensor], Tensor], x: Tensor, params: Sequence[Tensor]) -> int:
    grads = [p.grad for p in params]
    for p in params:  # as in training from the second step on: gradients exist, backward adds to them
        p.grad = torch.zeros_like(p)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(seeded(0))
            for l in chain.layers:
                if l.bn is not None:
                    stack.enter_context(buffers_set_aside(l.bn))
            x = x.detach().clone().requires_grad_(x.requires_grad)
            with tensor_peak(*params) as tp:
                fn(x).float().square().mean().backward()
            return tp.result.peak
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def peak_above_eager(chain: FusedChain, pieces: Sequence[Tensor]) -> str:
    """Why ``chain`` should run as eager modules (its fused step peaks above :data:`MARGIN` of
    its eager layers' on this input), or ``""`` (Note: [never above eager, without example inputs]).

    Args:
        chain: a chain on its first training call, its plan made.
        pieces: that call's input (one tensor, or a head's pieces).

    Returns:
        The reason for the report, or ``""`` to run fused.
    """
    if any(l.conv is not None and not l.conv.is_linear for l in chain.layers):
        return ""  # a chain of convolutions (Note above)
    params = _params(chain)
    if any(not p.is_leaf for p in params):  # a parametrization's weight: its graph is the call's own
        return ""
    weights = sum(p.numel() * p.element_size() for p in params)
    acts = sum(l.x_bytes() + l.y_bytes() for l in chain.layers)
    if len(pieces) != 1 or acts >= ACTIVATION_RATIO * weights:
        return ""
    x = pieces[0]
    eager = _measure(chain, chain._forward_eager, x, params)
    fused = _measure(chain, lambda t: chain._forward_fused([t], t), x, params)
    if fused <= MARGIN * eager:
        return ""
    return (f"its fused step measured {fused} bytes at its peak on its first training call, above "
            f"{MARGIN:.0%} of its eager layers' {eager}: its layers run as eager modules")
