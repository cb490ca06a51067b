"""``ComputedWeight``: a convolution weight the model computes from its own parameters and buffers.

Weight-standardised convolutions (timm's ``StdConv2d`` / ``ScaledStdConv2d``, BiT's and
lucidrains' ``WeightStandardizedConv2d``) do not convolve with a stored parameter: their
forward computes the weight (``(w - w.mean) / w.std``, ``F.batch_norm`` over the weight's
rows, a gain) and calls ``F.conv2d`` with the result. A fused chain takes such a weight as
it takes a parametrized one (``torch.nn.utils.parametrize``: reading ``conv.weight`` runs
the parametrization): the layer *reads* its weight by running the model's own computation,
here the part of the traced graph that computes it, on the model's parameters read at that
moment. The chain's Function receives the computed tensor as its weight input and returns
its gradient; autograd carries it back through the model's computation to the parameters.

Note: [a computed weight is read once per call]
A chain reads a layer's weight several times in one call (input checks, planning, the
Function); eager computes it once. :func:`computed_weights_cached` (entered by
``FusedChain.forward``, as ``parametrize.cached()`` is for parametrizations) keeps each
layer's weight for the rest of the call, per thread (another thread may call the model in
another grad mode); under ``torch.compile`` nothing is kept (the compiler removes the
repeated reads).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import Tensor, nn

__all__ = ["ComputedWeight", "computed_weights_cached"]

_local = threading.local()


@contextlib.contextmanager
def computed_weights_cached() -> Iterator[None]:
    """Within this block (this thread), each :class:`ComputedWeight` is computed once
    (Note: [a computed weight is read once per call])."""
    if torch.compiler.is_compiling() or getattr(_local, "cache", None) is not None:
        yield
        return
    _local.cache = {}
    try:
        yield
    finally:
        _local.cache = None


class ComputedWeight:
    """The model's own computation of a weight from its parameters / buffers, run on demand.

    Args:
        program: the traced computation, one placeholder per source, in order, returning the weight.
        sources: ``(module, attribute name)`` of each parameter or buffer the computation reads,
            looked up at every call (a re-assigned parameter is read).
        name: for messages and reports (the node that computed it).

    Example:
        >>> import torch.fx as fx
        >>> g = fx.Graph(); w = g.placeholder("w"); g.output(g.call_method("mul", (w, 2.0)))
        >>> conv = nn.Conv2d(1, 1, 1)
        >>> cw = ComputedWeight(fx.GraphModule(nn.Module(), g), [(conv, "weight")], "double")
        >>> bool((cw() == conv.weight * 2).all())
        True
    """

    def __init__(self, program: fx.GraphModule, sources: Sequence[Tuple[nn.Module, str]], name: str) -> None:
        self.program = program
        self.sources = [(m, str(a)) for m, a in sources]
        self.name = name

    def inputs(self) -> Tuple[Tensor, ...]:
        """The parameters / buffers the computation reads, as the model holds them now."""
        return tuple(getattr(m, a) for m, a in self.sources)

    def compute(self) -> Tensor:
        """The weight, computed now (differentiable in its sources)."""
        out = self.program(*self.inputs())
        if not isinstance(out, Tensor):
            raise TypeError(f"the weight computed by {self.name} is a {type(out).__name__}, not a Tensor")
        return out

    def __call__(self) -> Tensor:
        """The weight: computed once per :func:`computed_weights_cached` block, else now."""
        if torch.compiler.is_compiling():
            return self.compute()
        cache: Optional[Dict[int, Tensor]] = getattr(_local, "cache", None)
        if cache is None:
            return self.compute()
        key = id(self)
        if key not in cache:
            cache[key] = self.compute()
        return cache[key]

    def __repr__(self) -> str:
        return f"ComputedWeight({self.name}, reads {[a for _, a in self.sources]})"
