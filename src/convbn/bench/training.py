"""Training benchmark: eager vs ``convbn.convert`` strategies vs checkpointing vs ``torch.compile``.

For one model spec (see :mod:`convbn.bench.models`) every configuration is a deep copy
of the same freshly initialised model (same weights, train mode), with its own SGD
optimizer, fed the same input. All run in one process:

* ``eager`` — the baseline; every ratio is to it;
* ``convert auto`` — :func:`convbn.convert` with the default target (the tutorial's memory,
  least recompute), ``convert auto budget=X`` for each ``--budget X`` (saved bytes) and
  ``convert auto peak=X`` for each ``--peak-budget X`` (the step's peak);
* ``convert recompute_conv (tutorial)`` — ``strategy="recompute_conv", chain=False``: every
  fused layer keeps its own conv input and recomputes its conv (the PyTorch tutorial);
* ``convert recompute_bn`` — keep conv outputs, recompute BN + activation element-wise;
* ``checkpoint per block`` — :func:`torch.utils.checkpoint.checkpoint` (non-reentrant)
  around each block (see :func:`find_blocks`; a DenseNet's dense blocks and transitions);
* ``checkpoint concat heads (memory-efficient)`` — the checkpoint-based memory-efficient
  DenseNet (torchvision's ``memory_efficient=True``) for any traceable model:
  concatenation + BN + act + conv of each dense layer under checkpointing
  (:func:`convbn.bench.concat_checkpoint.checkpoint_concat_heads`); only for models that
  have such heads (with ``configs=None`` the row is left out for the others);
* ``torch.compile budget=B`` — ``torch.compile`` with
  ``torch._functorch.config.activation_memory_budget = B`` (default 0.5, 0.3, 0.1).

Measured per configuration:

* **saved bytes** of one training forward (:func:`convbn.memory.saved_bytes`, SPEC §3), and
  the same without parameter storages (**saved excl. params**, see Note: [Activation bytes]);
* **peak**: the training step's peak as convbn defines it everywhere
  (:func:`convbn.memory.timeline`, Note: [a step's peak]): the standard loop, above the
  parameters, buffers and optimizer state live before it, weight gradients counted;
  the CUDA allocator on GPU, exact live tensor bytes on CPU, except for compiled graphs,
  which run outside Python dispatch and get sampled RSS after the same ``zero_grad``
  (:class:`convbn.memory.peak_memory`, noted in the row); median of a few dedicated,
  untimed rounds;
* **step time**: forward + loss + backward + ``SGD.step()``, median over ``steps`` timed
  rounds after ``warmup`` untimed ones;
* **max |Δout|**, **max |Δgrad|**: largest absolute difference of the first step's output
  and parameter gradients from eager's (same input, same RNG seed, same weights);
  **Δgrad rel** divides the latter by the largest absolute eager gradient.

Note: [Round-robin timing]
    Each round runs one step of every configuration, the order rotated by one each round,
    so load from other processes (and position in the round) hits every configuration
    alike. Compilation happens in the untimed first step; its duration is reported as
    ``setup_s`` (an FX-graph cache on disk makes repeated runs compile faster).

Note: [Saved bytes under torch.compile]
    A compiled training graph runs as one ``autograd.Function`` (AOTAutograd's
    ``CompiledFunction``) whose forward calls ``ctx.save_for_backward`` on exactly the
    tensors the partitioner chose to keep, so ``saved_tensors_hooks`` *do* see them
    (checked: the bytes fall as ``activation_memory_budget`` falls, and entering the hooks
    triggers no recompilation). They are measured exactly like eager. What a compiled graph
    keeps differs in kind, though: on CPU inductor saves channels-last copies of the conv
    weights (not the parameters' storages), so its "saved excl. params" includes them.

Note: [One dynamo cache entry per budget]
    Dynamo guards do not depend on the module instance (``inline_inbuilt_nn_modules``), so a
    second ``torch.compile`` of a deep copy silently reuses the first copy's compiled graph,
    whatever ``activation_memory_budget`` says. Each budget therefore gets its own backend
    callable (:func:`budget_backend`): dynamo's BACKEND_MATCH guard keeps one cache entry per
    backend, and the backend applies the budget while AOTAutograd partitions the graph.

Note: [Checkpoint and BatchNorm]
    Non-reentrant checkpointing re-runs each block's forward in backward, so BatchNorm
    running statistics inside checkpointed blocks are updated twice per step; the row's
    note reports the running-statistics difference from eager after the first step.

Run::

    python -m convbn.bench.training --model monai:resnet18 --batch-size 4 --image-size 64
"""
from __future__ import annotations

import argparse
import warnings
from typing import Any, Dict, List, Optional, Union

import torch

from convbn.bench.checkpointing import CheckpointBlock, checkpoint_blocks, find_blocks
from convbn.bench.common import DTYPES, add_output_arguments, write_outputs
from convbn.bench.models import check_spec
from convbn.bench.plotting import pyplot
from convbn.bench.training_configs import (
    CONCAT_CHECKPOINT,
    CONFIG_KEYS,
    DEFAULT_COMPILE_BUDGETS,
    budget_backend,
    config_names,
)
from convbn.bench.training_run import TrainingRun
from convbn.bench.training_settings import TrainingBenchSettings
from convbn.bench.training_output import TrainingRow, print_table, rows_to_json, rows_to_markdown, write_plot

# The runner's public API; its settings, one run's phases, the configurations, checkpointing
# and output live in training_settings.py, training_run.py, training_configs.py,
# checkpointing.py and training_output.py.
__all__ = [
    "TrainingRow",
    "CheckpointBlock",
    "find_blocks",
    "budget_backend",
    "checkpoint_blocks",
    "config_names",
    "run_training_bench",
    "TrainingBenchSettings",
    "print_table",
    "rows_to_markdown",
    "rows_to_json",
    "write_plot",
    "add_training_arguments",
    "main_training",
    "CONFIG_KEYS",
    "CONCAT_CHECKPOINT",
    "DEFAULT_COMPILE_BUDGETS",
    "DEFAULT_MODELS",
]

DEFAULT_MODELS = ("mnist",)


# --------------------------------------------------------------------------- one step


def run_training_bench(spec: Union[str, TrainingBenchSettings], *args: Any, **kwargs: Any) -> List[TrainingRow]:
    """Benchmark training steps of a model under every selected configuration, in one process.

    Args:
        spec: a :class:`~convbn.bench.training_settings.TrainingBenchSettings`, or a model spec
            followed by its other fields as arguments (``run_training_bench("mnist",
            batch_size=8, steps=2)``): ``batch_size``, ``configs``, ``steps``, ``warmup``,
            ``device``, ``dtype``, ``plot_path`` by position or keyword, the rest by keyword.
        *args: the settings' fields after ``spec``, by position, when ``spec`` is a spec.
        **kwargs: the settings' fields, by keyword, when ``spec`` is a spec.

    Returns:
        One :class:`TrainingRow` per configuration, ``eager`` first. A configuration that fails
        to build or run gets a row with the error in ``note`` instead of stopping the run.

    Raises:
        ValueError: bad spec, configuration key, budget or counts.
        ImportError: the spec's package is missing.

    Example:
        >>> rows = run_training_bench("mnist", batch_size=4, steps=1, use_compile=False)  # doctest: +SKIP
        >>> rows[0].config
        'eager'
    """
    if isinstance(spec, TrainingBenchSettings):
        if args or kwargs:
            raise TypeError("run_training_bench(settings) takes no other arguments, but got "
                            f"{len(args)} positional and {sorted(kwargs)} keyword ones; use dataclasses.replace")
        settings = spec
    else:
        settings = TrainingBenchSettings(spec, *args, **kwargs)
    return TrainingRun(settings).run()


# --------------------------------------------------------------------------- command line


def add_training_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the training benchmark's options to ``parser`` (for ``convbn bench``)."""
    from convbn.cli import (add_renamed_option, batch_size, device_arg, existing_file, fraction, non_negative_int,
                            output_path, positive_float, positive_int)

    parser.add_argument("--model", action="append", default=None, metavar="SPEC",
                        help="model spec, repeatable: mnist, monai:resnet18, 'monai:resnet50(spatial_dims=2)', "
                             "efficientnet:b0 ..., or module:callable (a function of yours returning the model) "
                             f"(default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--checkpoint", type=existing_file, default=None, metavar="PATH",
                        help="load these weights (a state_dict or a checkpoint holding one) into the model "
                             "(one --model only)")
    parser.add_argument("--batch-size", type=batch_size, default=64, help="batch size")
    parser.add_argument("--image-size", type=positive_int, default=None,
                        help="override the spatial size where the model allows (a warning where it does not)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed rounds after the first (compiling) step")
    parser.add_argument("--memory-rounds", type=positive_int, default=3, help="rounds measuring peak memory (median)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="torch device: cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter and input dtype")
    parser.add_argument("--memory-budget", dest="budget", type=fraction, action="append", default=[], metavar="X",
                        help="add 'convert auto budget=X' (convert's memory_budget: a fraction in (0, 1] of eager "
                             "saved bytes), repeatable")
    add_renamed_option(parser, "--budget", "--memory-budget", append=True, type=fraction, dest="budget")
    parser.add_argument("--peak-budget", type=fraction, action="append", default=[], metavar="X",
                        help="add 'convert auto peak=X' (fraction in (0, 1] of the eager step's peak), repeatable")
    parser.add_argument("--compile-budget", type=fraction, action="append", default=None, metavar="B",
                        help="torch.compile activation_memory_budget values in (0, 1], repeatable "
                             f"(default: {' '.join(map(str, DEFAULT_COMPILE_BUDGETS))})")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile configurations")
    parser.add_argument("--configs", default=None, metavar="LIST",
                        help=f"comma list of configurations to run, from {','.join(CONFIG_KEYS)} (default: all)")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="SGD learning rate")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads before running")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and inputs")
    add_output_arguments(parser, plot_help="write a saved-ratio vs time-ratio PNG")
    parser.add_argument("--timeline", type=output_path, default=None, metavar="PATH",
                        help="also write a memory-timeline PNG of one step per configuration (convbn.bench.timeline)")
    return parser


def _check_configs(text: Optional[str]) -> Optional[List[str]]:
    if text is None:
        return None
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIG_KEYS]
    if bad or not names:
        raise ValueError(f"--configs {text!r}: unknown configuration(s) {bad}; choose from {','.join(CONFIG_KEYS)}")
    return names


def main_training(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed arguments and print the table; returns an exit code.

    Raises:
        ValueError / ImportError: a bad spec or option (``convbn`` prints it as one line, exit 2).
    """
    configs = _check_configs(args.configs)
    if args.no_compile and args.compile_budget is not None:
        warnings.warn("--compile-budget is ignored with --no-compile", stacklevel=2)
    for flag, given in (("--memory-budget", args.budget), ("--peak-budget", args.peak_budget)):
        if given and configs is not None and not {"budget", "auto"} & set(configs):
            warnings.warn(f"{flag} is ignored: --configs {args.configs} includes neither 'budget' nor 'auto'",
                          stacklevel=2)
    if args.compile_budget is not None and configs is not None and not {"compile", "convert+compile"} & set(configs):
        warnings.warn(f"--compile-budget is ignored: --configs {args.configs} has no compile configuration", stacklevel=2)
    for flag, path in (("--plot", args.plot), ("--timeline", getattr(args, "timeline", None))):
        if path:
            pyplot(flag)  # fail before the run, not after it
    specs = args.model or list(DEFAULT_MODELS)
    for spec in specs:  # a bad spec fails before any model runs
        check_spec(spec)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded: Dict[str, Any] = {}
    if args.checkpoint is not None:
        if len(specs) != 1:
            raise ValueError(f"--checkpoint loads into one model, but got {len(specs)} --model specs: {specs}")
        from convbn.cli_model import load_model

        torch.manual_seed(args.seed)
        model, shape = load_model(specs[0], args.checkpoint)
        loaded = dict(model=model, input_shape=shape)
    rows: List[TrainingRow] = []
    for spec in specs:
        rows += run_training_bench(
            spec, args.batch_size, configs, args.steps, args.warmup, args.device, DTYPES[args.dtype], **loaded,
            budgets=args.budget, peak_budgets=args.peak_budget,
            compile_budgets=DEFAULT_COMPILE_BUDGETS if args.compile_budget is None else args.compile_budget,
            use_compile=not args.no_compile, image_size=args.image_size, memory_rounds=args.memory_rounds,
            lr=args.lr, seed=args.seed, progress=args.progress,
        )
    print_table(rows, wide=args.wide)
    write_outputs(args, rows, rows_to_markdown, rows_to_json, write_plot)
    if getattr(args, "timeline", None):
        from convbn.bench.timeline import write_bench_timeline

        write_bench_timeline(args.model or list(DEFAULT_MODELS), args.batch_size, args.timeline,
                             image_size=args.image_size, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_training(add_training_arguments(argparse.ArgumentParser(description=__doc__)).parse_args()))
