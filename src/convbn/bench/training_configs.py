"""The training benchmark's configurations: their names, and each built from the same model.

:data:`CONFIG_KEYS` are what ``--configs`` accepts; :func:`config_names` turns keys and
budgets into display names in run order; :func:`build_config` builds one configuration
(a deep copy of the model, transformed, with its own SGD optimizer);
:func:`budget_backend` gives ``torch.compile`` one backend per activation-memory budget
(see Note: [One dynamo cache entry per budget] in :mod:`convbn.bench.training`).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from convbn.bench.checkpointing import CheckpointBlock, checkpoint_blocks, find_blocks
from convbn.bench.compile_budget import activation_memory_budget, budget_backend
from convbn.bench.concat_checkpoint import checkpoint_concat_heads
from convbn.passes.convert.api import convert

__all__ = ["CONFIG_KEYS", "CONCAT_CHECKPOINT", "DEFAULT_COMPILE_BUDGETS", "TrainingConfig", "budget_backend",
           "build_config", "config_names"]

#: Keys accepted by ``configs=`` / ``--configs`` (``eager`` is always run: it is the baseline).
CONFIG_KEYS = ("eager", "auto", "budget", "tutorial", "recompute_bn", "checkpoint", "concat_checkpoint", "compile",
               "convert+compile")
#: The display name of the ``concat_checkpoint`` configuration.
CONCAT_CHECKPOINT = "checkpoint concat heads (memory-efficient)"
DEFAULT_COMPILE_BUDGETS = (0.5, 0.3, 0.1)


def _fmt_budget(b: float) -> str:
    return format(b, "g")


def config_names(
    configs: Optional[Sequence[str]] = None,
    budgets: Sequence[float] = (),
    compile_budgets: Sequence[float] = DEFAULT_COMPILE_BUDGETS,
    use_compile: bool = True,
    peak_budgets: Sequence[float] = (),
) -> List[str]:
    """Display names of the configurations selected by ``configs`` (keys of :data:`CONFIG_KEYS`;
    ``None``: all), in run order; ``eager`` always comes first. ``budgets`` (``memory_budget``,
    saved bytes) and ``peak_budgets`` (``peak_budget``, the step's peak) add ``convert auto
    budget=X`` and ``convert auto peak=X`` configurations with ``"budget"`` or ``"auto"``.

    Raises:
        ValueError: an unknown key, or a non-positive budget.
    """
    keys = list(CONFIG_KEYS) if configs is None else [k.strip() for k in configs if k.strip()]
    unknown = [k for k in keys if k not in CONFIG_KEYS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; choose from {list(CONFIG_KEYS)}")
    for b in list(budgets) + list(peak_budgets) + list(compile_budgets):
        if not isinstance(b, (int, float)) or not b > 0:
            raise ValueError(f"budgets must be positive fractions, but got {b!r}")
    names = ["eager"]
    if "auto" in keys:
        names.append("convert auto")
    if "budget" in keys or "auto" in keys:
        names += [f"convert auto budget={_fmt_budget(b)}" for b in budgets]
        names += [f"convert auto peak={_fmt_budget(b)}" for b in peak_budgets]
    if "tutorial" in keys:
        names.append("convert recompute_conv (tutorial)")
    if "recompute_bn" in keys:
        names.append("convert recompute_bn")
    if "checkpoint" in keys:
        names.append("checkpoint per block")
    if "concat_checkpoint" in keys:
        names.append(CONCAT_CHECKPOINT)
    if "compile" in keys and use_compile:
        names += [f"torch.compile budget={_fmt_budget(b)}" for b in compile_budgets]
    if "convert+compile" in keys and use_compile:
        names += [f"convert auto + torch.compile budget={_fmt_budget(b)}" for b in compile_budgets]
    return list(dict.fromkeys(names))


@dataclass
class TrainingConfig:
    """One configuration under test: the transformed model, its parameters / buffers and optimizer."""

    name: str
    model: nn.Module
    params: List[nn.Parameter]
    buffers: List[Tensor]
    optimizer: torch.optim.Optimizer
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    note: str = ""
    failed: bool = False


def build_config(name: str, base: nn.Module, x: Tensor, lr: float) -> TrainingConfig:
    """A deep copy of ``base`` transformed as ``name`` says, with its own optimizer."""
    model = copy.deepcopy(base).train()
    params, buffers = list(model.parameters()), list(model.buffers())  # same objects after the transform
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    note = ""
    if name.startswith("convert auto + torch.compile"):
        budget = float(name.rpartition("=")[2])
        model = convert(model, strategy="auto", example_inputs=x)
        report = model.convbn_report
        note = f"{len(report.pairs)} pairs in {report.num_chains} chains"
        model = torch.compile(model, backend=budget_backend(budget))
        context = lambda: activation_memory_budget(budget)  # noqa: E731
    elif name.startswith("convert"):
        if "budget=" in name:
            budget = float(name.rpartition("=")[2])
            model = convert(model, strategy="auto", memory_budget=budget, example_inputs=x)
        elif "peak=" in name:
            model = convert(model, strategy="auto", peak_budget=float(name.rpartition("=")[2]), example_inputs=x)
        elif "tutorial" in name:
            model = convert(model, strategy="recompute_conv", chain=False, example_inputs=x)
        elif "recompute_bn" in name:
            model = convert(model, strategy="recompute_bn", example_inputs=x)
        else:
            model = convert(model, strategy="auto", example_inputs=x)
        report = getattr(model, "convbn_report", None)
        if report is not None:
            note = f"{len(report.pairs)} pairs in {report.num_chains} chains"
            if report.skipped:
                note += f", {len(report.skipped)} norms skipped"
    elif name == "checkpoint per block":
        blocks = find_blocks(model)
        checkpoint_blocks(model, blocks)
        n_bn = sum(isinstance(m, _BatchNorm) for b in model.modules() if isinstance(b, CheckpointBlock)
                   for m in b.modules())
        note = f"{len(blocks)} blocks" + (f" ({n_bn} BN inside)" if n_bn else "")
    elif name == CONCAT_CHECKPOINT:
        model = checkpoint_concat_heads(model)
        note = f"{model.num_concat_heads} heads checkpointed"
    elif name.startswith("torch.compile"):
        budget = float(name.rpartition("=")[2])
        model = torch.compile(model, backend=budget_backend(budget))
        # see Note: [One dynamo cache entry per budget]; the patch also covers lazy (re)compiles
        context = lambda: activation_memory_budget(budget)  # noqa: E731
    elif name != "eager":
        raise ValueError(f"unknown configuration {name!r}")
    optimizer = torch.optim.SGD(params, lr=lr)
    return TrainingConfig(name, model, params, buffers, optimizer, context, note)
