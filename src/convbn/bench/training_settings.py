"""What one run of the training benchmark (:func:`convbn.bench.training.run_training_bench`)
measures, as one frozen value: the model, the input, the configurations and the counts."""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from convbn.bench.training_configs import DEFAULT_COMPILE_BUDGETS

__all__ = ["TrainingBenchSettings"]


@dataclass(frozen=True, eq=False)
class TrainingBenchSettings:
    """The settings of one training benchmark run.

    Args:
        spec: a model spec, e.g. ``"mnist"``, ``"monai:resnet18"`` (:func:`convbn.bench.models.build_model`).
        batch_size: batch size of the random input.
        configs: keys of :data:`~convbn.bench.training_configs.CONFIG_KEYS` to run (``None``: all);
            ``eager`` always runs.
        steps: timed rounds (one step of every configuration each); the median is reported.
        warmup: untimed rounds after the first step (which compiles / plans).
        device: where to run.
        dtype: parameter and input dtype.
        plot_path: also write :func:`~convbn.bench.training_output.write_plot` of the rows there.
        budgets: ``memory_budget`` values, one ``convert auto budget=X`` configuration each.
        compile_budgets: ``activation_memory_budget`` values, one ``torch.compile`` configuration each.
        use_compile: ``False`` drops the ``torch.compile`` configurations.
        image_size: overrides the spatial size of the model's default input where the model allows.
        memory_rounds: dedicated rounds measuring the peak memory of one step (median reported).
        lr: SGD learning rate.
        seed: seed of the weights, input and dropout.
        progress: a rich progress bar on stderr: ``None`` where stderr is a terminal, ``True`` always,
            ``False`` never.
        model: benchmark this module (deep-copied, never changed) instead of building ``spec``,
            which then only labels the rows; needs ``input_shape``.
        input_shape: the input shape without the batch dimension, with ``model``.
        peak_budgets: ``peak_budget`` values, one ``convert auto peak=X`` configuration each.

    Raises:
        ValueError: a count out of range.

    Example:
        >>> settings = TrainingBenchSettings("mnist", batch_size=8, steps=2, use_compile=False)
        >>> settings.rounds_per_config
        9
    """

    spec: str
    batch_size: int = 32
    configs: Optional[Sequence[str]] = None
    steps: int = 10
    warmup: int = 2
    device: Any = "cpu"
    dtype: torch.dtype = torch.float32
    plot_path: Optional[str] = None
    _: KW_ONLY
    budgets: Sequence[float] = ()
    compile_budgets: Sequence[float] = DEFAULT_COMPILE_BUDGETS
    use_compile: bool = True
    image_size: Optional[int] = None
    memory_rounds: int = 3
    lr: float = 1e-3
    seed: int = 0
    progress: Optional[bool] = None
    model: Optional[nn.Module] = None
    input_shape: Optional[Sequence[int]] = None
    peak_budgets: Sequence[float] = ()

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0 or self.memory_rounds < 0 or self.batch_size < 1:
            raise ValueError(f"need steps >= 1, warmup >= 0, memory_rounds >= 0 and batch_size >= 1, but got "
                             f"steps={self.steps}, warmup={self.warmup}, memory_rounds={self.memory_rounds}, "
                             f"batch_size={self.batch_size}")

    @property
    def rounds_per_config(self) -> int:
        """Progress steps per configuration: build, saved bytes, warm-up, peak and timed rounds."""
        return 2 + self.warmup + self.memory_rounds + self.steps
