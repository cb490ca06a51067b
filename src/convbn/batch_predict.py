"""Predicting a training step's peak at any batch from steps recorded at two small ones.

# Note: [predicting the batch]
# For a fixed model and plan the live bytes after every operator of a step are affine in
# the batch (Note: [planner inputs are affine in the batch] in
# passes/plan/plan_inputs.py), as long as the step runs the same operators; the step's
# peak is the most of those lines, exact at every batch. :class:`StepLines` holds them for
# the eager step. The converted model's plan is made for its batch, so there the lines are
# the planner's inputs (:func:`~convbn.passes.plan.plan_inputs.plan_inputs_at`), and at each
# batch the planner makes the plan ``convert(memory_limit=...)`` would make and predicts its
# peak. Both are recorded at batches 2 and 4 and checked at a third, 3: the eager step
# there must equal its prediction point for point, and the converted model, planned for 3
# as predicted, must peak as predicted; else :func:`convbn.max_batch` measures instead.
# Near the answer the prediction is confirmed by real steps at the answer and the batch
# above it where that is affordable.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .memory.kernel_scratch import scratch_bytes
from .memory.timelines import Timeline, default_loss

__all__ = ["StepLines", "largest_fitting", "step_flops", "PROBE_BATCHES"]

#: the batches a prediction is recorded at, and the one it is checked at
PROBE_BATCHES = (2, 4, 3)


class StepLines:
    """A step's timeline as one line per operator: bytes in use after it against the batch.

    Args:
        a / b: the same step recorded at two batches.
        batch_a / batch_b: those batches.

    Raises:
        ValueError: the two steps ran different operators (no lines).

    Example:
        >>> from convbn.memory.timelines import TimelinePoint
        >>> tl = lambda n: Timeline([TimelinePoint(0, "forward", "", "start"), TimelinePoint(10 * n + 4, "forward", "", "op")])
        >>> StepLines(tl(2), 2, tl(4), 4).peak_at(100)
        1004
    """

    def __init__(self, a: Timeline, batch_a: int, b: Timeline, batch_b: int) -> None:
        if batch_a == batch_b:
            raise ValueError(f"StepLines needs two different batches, but got {batch_a} twice")
        if _ops(a) != _ops(b):
            raise ValueError(f"the steps at batch {batch_a} and {batch_b} ran different operators: "
                             "their memory is not a line in the batch")
        self.batches = (batch_a, batch_b)
        self.ends = [(p.bytes, q.bytes) for p, q in zip(a.points, b.points)]
        #: the convolutions' calls at both batches, for their kernel scratch at another
        #: (Note: [kernel scratch]: the row is chosen again at each batch)
        self.calls = [(i, p.call, q.call) for i, (p, q) in enumerate(zip(a.points, b.points))
                      if p.call is not None and q.call is not None]

    def at(self, batch: int) -> List[int]:
        """Bytes in use after each operator at ``batch``."""
        ba, bb = self.batches
        return [round(u + Fraction(v - u, bb - ba) * (batch - ba)) for u, v in self.ends]

    def peak_at(self, batch: int) -> int:
        """The step's peak at ``batch``."""
        return max(self.at(batch), default=0)

    def scratch_at(self, batch: int) -> List[int]:
        """Each operator's kernel scratch at ``batch`` (0 where none was recorded): its call with
        the samples on the line through the two recorded calls."""
        ba, bb = self.batches
        out = [0] * len(self.ends)
        for i, ca, cb in self.calls:
            n = round(ca.x_shape[0] + Fraction(cb.x_shape[0] - ca.x_shape[0], bb - ba) * (batch - ba))
            out[i] = scratch_bytes(ca.at_batch(n)) if n > 0 else 0
        return out

    def process_peak_at(self, batch: int) -> int:
        """The step's peak at ``batch`` with its kernels' scratch (:attr:`Timeline.process_peak`)."""
        return max((u + s for u, s in zip(self.at(batch), self.scratch_at(batch))), default=0)

    def agrees(self, tl: Timeline, batch: int) -> bool:
        """Whether ``tl``, recorded at ``batch``, is on the lines point for point (its kernel
        scratch too)."""
        return len(tl.points) == len(self.ends) and [p.bytes for p in tl.points] == self.at(batch) \
            and [p.scratch for p in tl.points] == self.scratch_at(batch)


def _ops(tl: Timeline) -> List[Tuple[str, str]]:
    return [(p.phase, p.op.rpartition("/")[2]) for p in tl.points]


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest ``b`` in ``[1, upper]`` with ``fits(b)`` (0 where ``fits(1)`` is false),
    ``fits`` being true up to some batch and false above it; about ``2 log2(upper)`` calls.

    Example:
        >>> largest_fitting(lambda b: b <= 37, 1 << 16)
        37
    """
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= upper and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, upper + 1)  # lo fits, hi does not (or is past upper)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def step_flops(model: nn.Module, inputs: Tuple[Any, ...], loss_fn: Optional[Callable[[Any], Tensor]] = None) -> int:
    """Floating-point operations of one forward and backward of ``model`` on ``inputs``, as
    ``torch.utils.flop_counter.FlopCounterMode`` counts them (convolutions, matrix products,
    attention: the work that sets a step's time); the gradients it makes are set to None after.

    Example:
        >>> step_flops(nn.Linear(8, 4, bias=False), (torch.randn(2, 8),))  # 2*8*4 forward + 2*8*4 weight grad
        256
    """
    from torch.utils.flop_counter import FlopCounterMode  # public since torch 2.1

    with FlopCounterMode(display=False) as counter, torch.enable_grad():
        out = model(*inputs)
        (default_loss(out) if loss_fn is None else loss_fn(out)).backward()
    for p in model.parameters():
        p.grad = None
    return int(counter.get_total_flops())
