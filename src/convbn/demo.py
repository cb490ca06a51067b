"""Training demo: the MNIST network of the PyTorch tutorial, unfused vs fused two ways.

The network (tutorial "Fusing Convolution and Batch Norm using Custom Function")::

    conv 1->32 3x3 + BN + ReLU -> conv 32->64 3x3 + BN + ReLU -> max-pool 2 -> dropout 0.25
    -> flatten (9216) -> fc 128 -> ReLU -> dropout 0.5 -> fc 10 -> log-softmax

is built once in plain ``torch.nn`` and converted twice from copies with the same
weights: ``convbn.convert(net, strategy="auto")`` (planned per layer, chained) and
``convbn.convert(net, strategy="recompute_conv", chain=False)`` (the tutorial's method).
The three train with Adadelta on the *same* minibatches with the *same* dropout masks (the
RNG state is replayed), so their losses can be compared step by step; the demo says
exactly which equality holds (bit-identical, or where float32 rounding first differs).

Data (:mod:`convbn.demo_data`): ``--mnist-dir DIR`` reads the MNIST IDX files (``train-images-idx3-ubyte`` etc.,
raw or ``.gz``); without it, scikit-learn's bundled 8x8 ``load_digits`` images (real
handwritten digits, no download) are upscaled to 28x28 with bilinear interpolation.

The closing table compares, per configuration: the bytes held for backward at the end of
the forward pass (:func:`convbn.memory.saved_bytes`), the exact peak memory of one
training step (:func:`convbn.memory.timeline`, live tensor bytes, on CPU; the CUDA
allocator on a GPU), the median step time of the other steps (measured side by side in
one process), and the test accuracy. A PNG of the memory figures is written.

Example:
    $ python -m convbn demo
    $ python -m convbn demo --mnist-dir ~/data/MNIST/raw --device cuda --epochs 14
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convbn.cli import (
    Command,
    batch_size,
    device_arg,
    existing_dir,
    memory_size,
    output_path,
    positive_float,
    positive_int,
)
from convbn.largest_batch import max_batch
from convbn.extras import require
from convbn.demo_data import Dataset, load_digits_28, load_mnist, read_idx
from convbn.demo_training import DemoRun, StepStats, grad_difference, train
from convbn.demo_results import (
    CONFIG_HELP,
    CONFIGS,
    DemoResult,
    accuracy_sentence,
    compare_losses,
    demo_pyplot,
    results_table,
    write_plot,
    write_timeline_plot,
)
from convbn.memory import saved_bytes
from convbn.memory.budget import parse_memory
from convbn.nn.fused_conv_bn import FusedConvBN2d
from convbn.passes.convert.api import convert

__all__ = [  # the data loaders (convbn.demo_data) and the results and their output (convbn.demo_results) are re-exported here
    "MnistNet",
    "read_idx",
    "load_mnist",
    "load_digits_28",
    "Dataset",
    "CONFIGS",
    "DemoConfig",
    "DemoResult",
    "build_models",
    "compare_losses",
    "grad_difference",
    "run_demo",
    "write_plot",
    "set_training",
    "StepStats",
    "results_table",
    "add_arguments",
    "check_requirements",
    "main",
    "COMMAND",
]

# --------------------------------------------------------------------------- the network


class MnistNet(nn.Module):
    """The tutorial's MNIST network; ``fused=True`` uses :class:`FusedConvBN2d` pairs.

    Both variants have identical ``state_dict`` keys (``block1.conv.weight``,
    ``block1.bn.running_mean``, ...), so weights move between them with a strict
    ``load_state_dict``.

    Args:
        fused: build the conv-BN-ReLU pairs as fused layers.
        strategy: the fused layers' strategy (ignored when ``fused=False``).

    Example:
        >>> net = MnistNet(fused=True, strategy="recompute_conv")
        >>> net(torch.randn(4, 1, 28, 28)).shape
        torch.Size([4, 10])
    """

    def __init__(self, fused: bool = True, strategy: str = "recompute_conv") -> None:
        super().__init__()
        self.fused = fused
        self.block1 = self._pair(1, 32, fused, strategy)
        self.block2 = self._pair(32, 64, fused, strategy)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(9216, 128)
        self.dropout2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    @staticmethod
    def _pair(c_in: int, c_out: int, fused: bool, strategy: str) -> nn.Module:
        if fused:
            return FusedConvBN2d(c_in, c_out, 3, bias=False, activation="relu", strategy=strategy)
        return nn.Sequential(
            OrderedDict(conv=nn.Conv2d(c_in, c_out, 3, bias=False), bn=nn.BatchNorm2d(c_out), act=nn.ReLU())
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.block2(self.block1(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)

    def pair_output_shapes(self, batch: int, size: int = 28) -> List[Tuple[int, ...]]:
        """Shapes of the two conv outputs for a ``(batch, 1, size, size)`` input."""
        return [(batch, 32, size - 2, size - 2), (batch, 64, size - 4, size - 4)]


# --------------------------------------------------------------------------- training


@dataclass
class DemoConfig:
    """Options of :func:`run_demo` (the CLI flags).

    Attributes:
        epochs: passes over the training images.
        batch_size: minibatch size (capped by the number of training images).
        device: torch device string.
        seed: seeds the initial weights, the shuffling and the dropout masks.
        mnist_dir: directory with the MNIST IDX files; ``None``: scikit-learn's digits.
        limit: use only the first ``limit`` train and test images.
        lr / gamma: Adadelta learning rate and its per-epoch decay (the tutorial's optimiser).
        progress: show a progress bar.
        plot: PNG to write (saved bytes and exact peak per configuration); ``None``: none.
        memory: with a size (``"1GiB"``), the demo ends with the largest batch eager and
            convbn train within it (:func:`convbn.max_batch`, real steps on a fresh model).
    """

    epochs: int = 3
    batch_size: int = 64
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 1
    mnist_dir: Optional[str] = None
    limit: Optional[int] = None
    lr: float = 1.0
    gamma: float = 0.7
    progress: bool = True
    plot: Optional[str] = None
    memory: Optional[str] = None


def set_training(model: nn.Module, frozen_bn: bool = False) -> nn.Module:
    """``model.train()``; with ``frozen_bn`` every BatchNorm normalises with its running
    statistics (eval mode) while the rest trains: the eager meaning of ``strategy='frozen'``."""
    model.train()
    if frozen_bn:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    return model


def build_models(example: Tensor, seed: int, device: torch.device) -> Dict[str, nn.Module]:
    """The three configurations of :data:`CONFIGS`, with identical initial weights.

    The unfused network is built with ``seed``; the fused ones are converted from deep
    copies of it (``example`` is the planner's measuring batch for ``auto``).
    """
    torch.manual_seed(seed)
    plain = MnistNet(fused=False).to(device)
    models = {
        "unfused": plain,
        "auto": convert(copy.deepcopy(plain), strategy="auto", example_inputs=example),
        "tutorial": convert(copy.deepcopy(plain), strategy="recompute_conv", chain=False),
    }
    for m in models.values():
        m.train()
    return models


def _plan(model: nn.Module) -> str:
    report = getattr(model, "convbn_report", None)
    if report is None:
        return "eager"
    chained = report.num_chains < len(report.pairs)
    layers = ", ".join(f"{p.conv.split('.')[0]} {p.strategy}" for p in report.pairs)
    return layers + (" (chained)" if chained else "")


def run_demo(config: DemoConfig, console: Any = None, data: Optional[Dataset] = None) -> DemoResult:
    """Train the unfused, ``auto`` and tutorial-fused MNIST networks side by side and measure them.

    Every step feeds the same minibatch and the same dropout masks (the RNG state is
    replayed) to the three networks in turn. The second step of each is measured for its
    exact peak memory; the others are timed.

    Args:
        config: options (see :class:`DemoConfig`).
        console: a ``rich.console.Console`` to print to (``None``: print nothing).
        data: a dataset to use instead of loading one from ``config``.

    Returns:
        :class:`DemoResult`.

    Raises:
        ValueError: a bad option (the message names it and what is allowed).
        FileNotFoundError: ``mnist_dir`` lacks the MNIST files.

    Example:
        >>> r = run_demo(DemoConfig(epochs=1, limit=64, batch_size=32, progress=False))  # doctest: +SKIP
        >>> r.saved["tutorial"] < r.saved["unfused"]  # doctest: +SKIP
        True
    """
    _check_config(config)
    run = _start(config, data)
    _announce(run, config, console)
    train(run, config.epochs, config.seed, console, config.progress)
    result, models, example, device = run.result, run.models, run.train_x[:run.batch], run.device
    # End-of-forward bytes: one training-mode forward of a copy (the trained models'
    # running statistics stay as they are).
    for name, model in models.items():
        result.saved[name] = saved_bytes(copy.deepcopy(model).train(), example).total
        result.peak[name] = int(run.stats[name][run.peak_step].peak or 0)
        timed = [st.seconds for i, st in enumerate(run.stats[name]) if i not in (0, run.peak_step)] \
            or [run.stats[name][-1].seconds]
        result.step_time[name] = statistics.median(timed)
    for name in CONFIGS[1:]:
        result.equality[name] = compare_losses(
            name, result.step_losses[name], result.step_losses["unfused"], run.first_grad_diff.get(name)
        )
    if config.plot:
        write_plot(result, config.plot, device)
        result.plot = config.plot
        result.timeline_plot = write_timeline_plot(models, example, config.plot, device)
    if console is not None:
        _print_results(result, console, device)
    if config.memory is not None:
        result.batch_fit = _batch_fit(example, config, device)
        if console is not None:
            console.print(result.batch_fit.summary())
    return result


def _check_config(config: DemoConfig) -> None:
    """Raise on a bad option before any data is read or model built."""
    if config.epochs < 1:
        raise ValueError(f"epochs must be at least 1, but got {config.epochs}")
    if config.batch_size < 2:
        raise ValueError(f"batch size must be at least 2 (BatchNorm needs 2 samples), but got {config.batch_size}")
    if config.mnist_dir is not None and not os.path.isdir(config.mnist_dir):
        raise FileNotFoundError(f"--mnist-dir {config.mnist_dir!r} is not a directory")
    if config.memory is not None:
        parse_memory(config.memory)  # a readable size before training, not after


def _start(config: DemoConfig, data: Optional[Dataset]) -> DemoRun:
    """Load the data and build the three networks with their optimizers."""
    device = torch.device(config.device)
    if data is None:
        data = load_mnist(config.mnist_dir) if config.mnist_dir else load_digits_28(config.seed)
    data = data.limit(config.limit)
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    test_x, test_y = data.test_x.to(device), data.test_y.to(device)
    n = len(train_y)
    batch = min(config.batch_size, n)
    steps = n // batch  # drop the last partial batch: BatchNorm needs > 1 sample, shapes stay fixed
    peak_step = 1 if config.epochs * steps > 1 else 0  # the second step: gradients and optimizer state exist
    result = DemoResult(batch_size=batch, memory_source="cuda" if device.type == "cuda" else "tensors")
    models = build_models(train_x[:batch], config.seed, device)
    opts = {k: torch.optim.Adadelta(m.parameters(), lr=config.lr) for k, m in models.items()}
    scheds = {k: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=config.gamma) for k, o in opts.items()}
    result.plans = {k: _plan(m) for k, m in models.items()}
    result.test_images = len(test_y)
    return DemoRun(device, data.source, train_x, train_y, test_x, test_y, batch, steps, peak_step, result,
                    models, opts, scheds, {k: [] for k in models}, {})


def _announce(run: DemoRun, config: DemoConfig, console: Any) -> None:
    """Print the data, the schedule and each configuration's plan."""
    if console is None:
        return
    console.print(
        f"[bold]convbn demo[/bold]: {run.source}; {len(run.train_y)} train / {len(run.test_y)} test images; "
        f"batch {run.batch}; {config.epochs} epoch(s) x {run.steps} step(s); Adadelta lr {config.lr}; "
        f"device {run.device}"
    )
    for k in CONFIGS:
        console.print(f"  {k:<9} {CONFIG_HELP[k]}" + (f" -> {run.result.plans[k]}" if k != "unfused" else ""))


def _print_results(result: DemoResult, console: Any, device: torch.device) -> None:
    """The closing table, each equality, the accuracies and where the plots went."""
    console.print(results_table(result, device))
    for name in CONFIGS[1:]:
        console.print(result.equality[name])
    console.print(accuracy_sentence(result))
    if result.plot:
        console.print(f"plot written to {os.path.abspath(result.plot)}")
    if result.timeline_plot:
        console.print(f"memory timeline of one step written to {os.path.abspath(result.timeline_plot)}")


def _batch_fit(x: Tensor, config: DemoConfig, device: torch.device) -> Any:
    """The largest batch the unfused network and its conversion train in ``config.memory``
    (the demo's optimizer; a fresh model, the trained ones are left as they are)."""
    torch.manual_seed(config.seed)
    net = MnistNet(fused=False).to(device).train()
    return max_batch(net, x, config.memory, optimizer=torch.optim.Adadelta(net.parameters(), lr=config.lr))


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``python -m convbn demo`` and :func:`main`)."""
    d = DemoConfig()
    parser.add_argument("--epochs", type=positive_int, default=d.epochs, help="training epochs")
    parser.add_argument("--batch-size", type=batch_size, default=d.batch_size,
                        help="minibatch size, capped by the number of training images")
    parser.add_argument("--device", type=device_arg, default=d.device, help="torch device: cpu, cuda, cuda:1 ...")
    parser.add_argument("--seed", type=int, default=d.seed, help="seeds weights, shuffling and dropout")
    parser.add_argument("--mnist-dir", type=existing_dir, default=None, metavar="DIR",
                        help="directory with the four MNIST IDX files (raw or .gz); None: scikit-learn's built-in digits")
    parser.add_argument("--limit", type=batch_size, default=None, metavar="N", help="use only the first N train and N test images (None: all)")
    parser.add_argument("--lr", type=positive_float, default=d.lr, help="Adadelta learning rate")
    parser.add_argument("--plot", type=output_path, default="convbn-demo.png", metavar="PATH",
                        help="PNG of saved bytes and exact peak per configuration")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--memory", type=memory_size, default=None, metavar="SIZE",
                        help="end with the largest batch eager and convbn train in SIZE (e.g. 1GiB): "
                             "'in SIZE: eager trains batch A, convbn batch B'")


def check_requirements(mnist_dir: Optional[str], plot: Optional[str]) -> None:
    """Fail before any training when a package the demo will use is missing (one line naming ``convbn[demo]``).

    rich (the console), numpy (the data), scikit-learn (the built-in digits, unless ``mnist_dir``)
    and matplotlib (unless ``plot`` is ``None``).

    Raises:
        ImportError: ``"convbn demo needs scikit-learn: pip install 'convbn[demo]' ..."``.
    """
    require("rich", "convbn demo", "demo")
    require("numpy", "convbn demo", "demo")
    if mnist_dir is None:
        require("sklearn.datasets", "convbn demo", "demo", " (or pass --mnist-dir DIR)")
    if plot:
        demo_pyplot()


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; returns the exit code."""
    plot = None if args.no_plot else args.plot
    check_requirements(args.mnist_dir, plot)  # fail before training, not after
    from rich.console import Console

    config = DemoConfig(
        epochs=args.epochs, batch_size=args.batch_size, device=args.device, seed=args.seed, mnist_dir=args.mnist_dir,
        limit=args.limit, lr=args.lr, progress=not args.no_progress, plot=plot, memory=args.memory,
    )
    run_demo(config, console=Console())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m convbn.demo [options]`` (same as ``python -m convbn demo [options]``).

    Args:
        argv: command-line arguments without the program name.

    Returns:
        The exit code (0 on success, 2 for a bad option).

    Example:
        >>> main(["--epochs", "1", "--limit", "256", "--no-progress", "--no-plot"])  # doctest: +SKIP
        0
    """
    from convbn.cli import main as cli_main

    return cli_main(["demo", *(sys.argv[1:] if argv is None else list(argv))])


COMMAND = Command(
    name="demo",
    help="train the tutorial's MNIST network unfused, fused 'auto' and fused the tutorial's way; "
    "compare losses, saved bytes, exact peak memory and step time (about a minute on 2 CPU cores)",
    add_arguments=add_arguments,
    run=run,
)


if __name__ == "__main__":
    raise SystemExit(main())
