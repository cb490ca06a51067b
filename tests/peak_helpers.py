"""The exact live-tensor peak of a training step, as the peak tests measure it."""
from __future__ import annotations

from torch import Tensor, nn

from convbn.memory import tensor_peak


def step_peak(model: nn.Module, x: Tensor) -> int:
    """Peak live tensor bytes of the second of two forward + backward steps (gradients exist
    from the first on, as in real training)."""
    def step() -> None:
        model(x).float().square().mean().backward()

    step()
    with tensor_peak(model) as tp:
        step()
    return tp.result.peak
