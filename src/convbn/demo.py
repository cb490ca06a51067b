"""Training demo: the MNIST network of the PyTorch tutorial, fused vs unfused.

The network (tutorial "Fusing Convolution and Batch Norm using Custom Function")::

    conv 1->32 3x3 + BN + ReLU -> conv 32->64 3x3 + BN + ReLU -> max-pool 2 -> dropout 0.25
    -> flatten (9216) -> fc 128 -> ReLU -> dropout 0.5 -> fc 10 -> log-softmax

is built twice from the same weights: once with :class:`convbn.nn.fused.FusedConvBN2d`
layers (``--strategy``), once with plain ``nn.Conv2d -> nn.BatchNorm2d -> nn.ReLU``. The
two have the same ``state_dict`` keys, so the unfused model is loaded strictly from the
fused one. Both are trained step by step on the *same* batches with the *same* dropout
masks (the RNG state is replayed for the second model), so their losses track each other
up to float rounding: the maths is the same, only what is kept for backward differs.

Data: ``--mnist-dir DIR`` reads the MNIST IDX files (``train-images-idx3-ubyte`` etc.,
raw or ``.gz``); without it, scikit-learn's bundled 8x8 ``load_digits`` images (real
handwritten digits, no download) are upscaled to 28x28 with bilinear interpolation.

At the end a table compares, fused vs unfused: the bytes held for backward at the end of
the forward pass (:func:`convbn.memory.saved_bytes`, deterministic), the peak memory of a
training step (:class:`convbn.memory.peak_memory`: CUDA allocator, or sampled process RSS
on CPU) and the median step time, both taken from the training steps themselves after the
first (warm-up) step.

Example:
    $ python -m convbn demo --epochs 2
    $ python -m convbn demo --mnist-dir ~/data/MNIST/raw --device cuda
"""
from __future__ import annotations

import argparse
import copy
import gzip
import os
import statistics
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convbn.cli import Command
from convbn.functional.fused import STRATEGIES
from convbn.memory import format_bytes, peak_memory, saved_bytes
from convbn.nn.fused import FusedConvBN2d
from convbn.passes.convert import CONVERT_STRATEGIES, convert

__all__ = [
    "MnistNet",
    "read_idx",
    "load_mnist",
    "load_digits_28",
    "Dataset",
    "DemoConfig",
    "DemoResult",
    "run_demo",
    "set_training",
    "StepStats",
    "results_table",
    "add_arguments",
    "main",
    "COMMAND",
]

#: Normalisation constants of the MNIST training set (as in the PyTorch examples).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081

IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


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


# --------------------------------------------------------------------------- data


@dataclass
class Dataset:
    """Normalised images ``(N, 1, 28, 28)`` float32 and labels ``(N,)`` int64, train and test."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    source: str

    def limit(self, n: Optional[int]) -> "Dataset":
        """The first ``n`` train and first ``n`` test samples (all when ``n`` is ``None``)."""
        if n is None:
            return self
        if n < 2:
            raise ValueError(f"--limit must be at least 2 (BatchNorm needs 2 samples), but got {n}")
        return Dataset(self.train_x[:n], self.train_y[:n], self.test_x[:n], self.test_y[:n], self.source + f" (first {n})")


def _open(path: str) -> Any:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (the MNIST format), raw or gzip-compressed.

    Layout: two zero bytes, a type byte (0x08 = uint8 ...), the number of dimensions, then
    one big-endian ``uint32`` per dimension, then the data in C order.

    Args:
        path: the file (``.gz`` is decompressed).

    Returns:
        The array, e.g. ``(60000, 28, 28)`` ``uint8`` images or ``(60000,)`` labels.

    Raises:
        ValueError: not an IDX file, an unknown type byte, or a truncated file.

    Example:
        >>> read_idx("MNIST/raw/train-labels-idx1-ubyte").shape  # doctest: +SKIP
        (60000,)
    """
    with _open(path) as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (it must start with two zero bytes)")
    type_code, ndim = data[2], data[3]
    if type_code not in IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX type byte 0x{type_code:02x}; expected one of {sorted(IDX_DTYPES)}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(IDX_DTYPES[type_code])
    count = int(np.prod(shape)) if shape else 1
    if len(data) - header < count * dtype.itemsize:
        raise ValueError(f"{path}: expected {count} values of shape {shape}, but the file is truncated")
    return np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find(directory: str, stem: str) -> str:
    """``train-images-idx3-ubyte`` with or without ``.gz``, also the ``train-images.idx3-ubyte`` spelling."""
    dotted = stem.replace("-idx", ".idx")
    for name in (stem, stem + ".gz", dotted, dotted + ".gz"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"no {stem}[.gz] in {directory}; --mnist-dir must hold the four MNIST IDX files "
        f"(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte)"
    )


def _normalise(images: Tensor) -> Tensor:
    return ((images - MNIST_MEAN) / MNIST_STD).unsqueeze(1).contiguous()


def load_mnist(directory: str) -> Dataset:
    """MNIST from the IDX files in ``directory`` (raw or ``.gz``), scaled to [0, 1] and normalised.

    Raises:
        FileNotFoundError: a file is missing (the message lists the four expected names).
        ValueError: image/label counts differ or images are not 28x28.
    """
    parts = []
    for prefix in ("train", "t10k"):
        images = read_idx(_find(directory, f"{prefix}-images-idx3-ubyte"))
        labels = read_idx(_find(directory, f"{prefix}-labels-idx1-ubyte"))
        if images.ndim != 3 or images.shape[1:] != (28, 28):
            raise ValueError(f"{prefix} images must have shape (N, 28, 28), but got {images.shape}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"{prefix}: {images.shape[0]} images but labels of shape {labels.shape}")
        parts.append(_normalise(torch.from_numpy(images.astype(np.float32) / 255.0)))
        parts.append(torch.from_numpy(labels.astype(np.int64)))
    return Dataset(*parts, source=f"MNIST ({directory})")


def load_digits_28(seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's bundled handwritten digits (1797 8x8 images), upscaled to 28x28.

    Pixel values 0..16 are scaled to [0, 1], resized with bilinear interpolation and
    normalised with the MNIST constants; a seeded permutation splits train/test.

    Raises:
        ImportError: scikit-learn is not installed (``pip install scikit-learn``).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - dev installs have it
        raise ImportError(
            "the built-in demo data needs scikit-learn: pip install scikit-learn (or pass --mnist-dir DIR)"
        ) from e
    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False).squeeze(1)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(len(labels) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    x = _normalise(images)
    return Dataset(x[train], labels[train], x[test], labels[test], source="scikit-learn digits, 8x8 -> 28x28")


# --------------------------------------------------------------------------- training


@dataclass
class DemoConfig:
    """Options of :func:`run_demo` (the CLI flags)."""

    epochs: int = 3
    batch_size: int = 2048
    strategy: str = "recompute_conv"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 1
    mnist_dir: Optional[str] = None
    limit: Optional[int] = None
    lr: float = 0.3
    gamma: float = 0.7
    progress: bool = True
    convert: bool = False  # fuse the plain network with convbn.convert() instead of FusedConvBN2d layers


@dataclass
class DemoResult:
    """What :func:`run_demo` measured.

    Attributes:
        step_losses: training loss of every step, ``{"fused": [...], "unfused": [...]}``.
        epochs: per epoch ``{"fused_loss", "unfused_loss", "fused_acc", "unfused_acc"}``.
        saved: bytes held for backward at the end of one forward pass.
        peak: highest peak memory of a training step (bytes above the step's start),
            over the steps after the first (all steps when there is only one).
        step_time: median seconds of a training step, over the same steps.
        batch_size: the batch size used (after capping by the data size).
        memory_source: ``"rss"`` or ``"cuda"``.
    """

    step_losses: Dict[str, List[float]] = field(default_factory=lambda: {"fused": [], "unfused": []})
    epochs: List[Dict[str, float]] = field(default_factory=list)
    saved: Dict[str, int] = field(default_factory=dict)
    peak: Dict[str, int] = field(default_factory=dict)
    step_time: Dict[str, float] = field(default_factory=dict)
    batch_size: int = 0
    memory_source: str = "rss"


def _rng_state(device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: Tuple[Tensor, Optional[Tensor]], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def set_training(model: nn.Module, frozen_bn: bool) -> nn.Module:
    """``model.train()``; with ``frozen_bn`` every BatchNorm normalises with its running
    statistics (eval mode) while the rest trains: the eager meaning of ``strategy='frozen'``."""
    model.train()
    if frozen_bn:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    return model


@dataclass
class StepStats:
    """One measured training step: loss, seconds, peak memory above the start (bytes) and its source."""

    loss: float
    seconds: float
    peak: int
    source: str


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, device: torch.device) -> StepStats:
    """Forward, NLL loss, backward, optimizer step; timed (CUDA events on GPU, ``perf_counter``
    on CPU) and watched by :class:`convbn.memory.peak_memory`."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with peak_memory(device) as pm:
        t0 = time.perf_counter()
        if cuda:
            start.record()
        opt.zero_grad(set_to_none=True)
        loss = F.nll_loss(model(x), y)
        loss.backward()
        opt.step()
        if cuda:
            end.record()
            end.synchronize()
        seconds = start.elapsed_time(end) / 1000.0 if cuda else time.perf_counter() - t0
    return StepStats(float(loss.detach()), seconds, pm.result.peak, pm.result.source)


@torch.no_grad()
def _accuracy(model: nn.Module, x: Tensor, y: Tensor, batch: int, frozen_bn: bool) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(y), batch):
        correct += int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum())
    set_training(model, frozen_bn)
    return correct / max(len(y), 1)


def run_demo(config: DemoConfig, console: Any = None, data: Optional[Dataset] = None) -> DemoResult:
    """Train the fused and the unfused MNIST network side by side and measure both.

    Args:
        config: options (see :class:`DemoConfig`).
        console: a ``rich.console.Console`` to print to (``None``: print nothing).
        data: a dataset to use instead of loading one from ``config``.

    Returns:
        :class:`DemoResult`.

    Example:
        >>> r = run_demo(DemoConfig(epochs=1, limit=64, batch_size=32, progress=False))  # doctest: +SKIP
        >>> r.saved["fused"] < r.saved["unfused"]  # doctest: +SKIP
        True
    """
    allowed = CONVERT_STRATEGIES if config.convert else STRATEGIES
    if config.strategy not in allowed:
        raise ValueError(f"strategy must be one of {allowed}, but got strategy={config.strategy!r}")
    if config.epochs < 1 or config.batch_size < 2:
        raise ValueError(f"need epochs >= 1 and batch_size >= 2, got epochs={config.epochs}, batch_size={config.batch_size}")
    device = torch.device(config.device)
    if data is None:
        data = load_mnist(config.mnist_dir) if config.mnist_dir else load_digits_28(config.seed)
    data = data.limit(config.limit)
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    test_x, test_y = data.test_x.to(device), data.test_y.to(device)
    n = len(train_y)
    batch = min(config.batch_size, n)
    steps = n // batch  # drop the last partial batch: BatchNorm needs > 1 sample, shapes stay fixed
    result = DemoResult(batch_size=batch)

    frozen_bn = config.strategy == "frozen"  # the unfused twin then trains with BN in eval mode
    torch.manual_seed(config.seed)
    if config.convert:
        # one call on the plain network; the planner measures on one batch (state restored)
        plain = MnistNet(fused=False).to(device)
        example = train_x[:batch] if config.strategy == "auto" else None
        fused = convert(plain, strategy=config.strategy, example_inputs=example)
    else:
        fused = MnistNet(fused=True, strategy=config.strategy).to(device)
    unfused = MnistNet(fused=False).to(device)
    unfused.load_state_dict(fused.state_dict(), strict=True)  # identical initial weights
    models = {"fused": set_training(fused, frozen_bn), "unfused": set_training(unfused, frozen_bn)}
    opts = {k: torch.optim.Adadelta(m.parameters(), lr=config.lr) for k, m in models.items()}
    scheds = {k: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=config.gamma) for k, o in opts.items()}
    shuffle = torch.Generator().manual_seed(config.seed)
    stats: Dict[str, List[StepStats]] = {k: [] for k in models}

    if console is not None:
        console.print(
            f"[bold]convbn demo[/bold]: {data.source}; {n} train / {len(test_y)} test images; "
            f"batch {batch}; {config.epochs} epoch(s) x {steps} step(s); strategy={config.strategy!r}; device={device}"
        )
    progress = _progress(console) if (console is not None and config.progress) else None
    task = progress.add_task("training", total=config.epochs * steps) if progress is not None else None
    if progress is not None:
        progress.start()
    try:
        for epoch in range(1, config.epochs + 1):
            perm = torch.randperm(n, generator=shuffle).to(device)
            sums = {k: 0.0 for k in models}
            for step in range(steps):
                idx = perm[step * batch : (step + 1) * batch]
                x, y = train_x[idx], train_y[idx]
                state = _rng_state(device)
                for name, model in models.items():
                    _set_rng_state(state, device)  # same dropout masks for both
                    st = _train_step(model, opts[name], x, y, device)
                    stats[name].append(st)
                    result.step_losses[name].append(st.loss)
                    sums[name] += st.loss
                if progress is not None:
                    progress.update(
                        task,
                        advance=1,
                        description=f"epoch {epoch} loss fused {result.step_losses['fused'][-1]:.4f} "
                        f"unfused {result.step_losses['unfused'][-1]:.4f}",
                    )
            for s in scheds.values():
                s.step()
            row = {
                "fused_loss": sums["fused"] / steps,
                "unfused_loss": sums["unfused"] / steps,
                "fused_acc": _accuracy(fused, test_x, test_y, batch, frozen_bn),
                "unfused_acc": _accuracy(unfused, test_x, test_y, batch, frozen_bn),
            }
            result.epochs.append(row)
            if console is not None:
                console.print(
                    f"epoch {epoch}: train loss fused {row['fused_loss']:.5f} unfused {row['unfused_loss']:.5f} "
                    f"(|diff| {abs(row['fused_loss'] - row['unfused_loss']):.1e}); test accuracy fused "
                    f"{100 * row['fused_acc']:.1f}% unfused {100 * row['unfused_acc']:.1f}%"
                )
    finally:
        if progress is not None:
            progress.stop()

    # End-of-forward bytes: one training-mode forward of a copy (the trained models' running
    # statistics stay as they are). Peak memory and step time: the training steps themselves,
    # both models alternating on the same batches, the first step of each (warm-up:
    # optimizer state, allocator pools) left out when there are more.
    x = train_x[:batch]
    for name, model in models.items():
        result.saved[name] = saved_bytes(set_training(copy.deepcopy(model), frozen_bn), x).total
        warm = stats[name][1:] or stats[name]
        result.peak[name] = max(st.peak for st in warm)
        result.step_time[name] = statistics.median(st.seconds for st in warm)
        result.memory_source = warm[-1].source
    if console is not None:
        console.print(results_table(result, config.strategy, device))
    return result


def _progress(console: Any) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )


def results_table(result: DemoResult, strategy: str, device: torch.device) -> Any:
    """A ``rich.table.Table``: saved bytes, peak step memory and median step time, fused vs unfused."""
    from rich.table import Table

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "n/a"

    mem = "CUDA allocator" if result.memory_source == "cuda" else "process RSS, sampled"
    table = Table(title=f"MNIST net, batch {result.batch_size}, {device}: fused ({strategy}) vs unfused")
    table.add_column("metric")
    table.add_column("fused", justify="right")
    table.add_column("unfused", justify="right")
    table.add_column("fused/unfused", justify="right")
    s, p, t = result.saved, result.peak, result.step_time
    table.add_row("saved bytes at end of forward", format_bytes(s["fused"]), format_bytes(s["unfused"]), ratio(s["fused"], s["unfused"]))
    table.add_row(f"peak memory of a step ({mem})", format_bytes(p["fused"]), format_bytes(p["unfused"]), ratio(p["fused"], p["unfused"]))
    table.add_row(
        "median step time", f"{1000 * t['fused']:.1f} ms", f"{1000 * t['unfused']:.1f} ms", ratio(t["fused"], t["unfused"])
    )
    return table


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``python -m convbn demo`` and :func:`main`)."""
    d = DemoConfig()
    parser.add_argument("--epochs", type=int, default=d.epochs, help=f"training epochs (default {d.epochs})")
    parser.add_argument(
        "--batch-size", type=int, default=d.batch_size, help=f"batch size, capped by the data size (default {d.batch_size})"
    )
    parser.add_argument(
        "--strategy",
        choices=sorted(set(STRATEGIES) | set(CONVERT_STRATEGIES)),
        default=d.strategy,
        help=f"fused strategy (default {d.strategy}; 'auto' needs --convert, 'frozen' needs FusedConvBN2d layers)",
    )
    parser.add_argument(
        "--convert",
        action="store_true",
        help="fuse the plain network with convbn.convert() (chains, planner) instead of FusedConvBN2d layers",
    )
    parser.add_argument("--device", default=d.device, help=f"torch device (default {d.device})")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"random seed (default {d.seed})")
    parser.add_argument("--mnist-dir", default=None, metavar="DIR", help="directory with the MNIST IDX files (raw or .gz); default: scikit-learn digits")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="use only the first N train and N test images")
    parser.add_argument(
        "--lr",
        type=float,
        default=d.lr,
        help=f"Adadelta learning rate (default {d.lr}; the tutorial's 1.0 suits many steps on full MNIST)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; returns the exit code."""
    from rich.console import Console

    config = DemoConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        strategy=args.strategy,
        device=args.device,
        seed=args.seed,
        mnist_dir=args.mnist_dir,
        limit=args.limit,
        lr=args.lr,
        progress=not args.no_progress,
        convert=args.convert,
    )
    run_demo(config, console=Console())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m convbn.demo [options]`` (same as ``python -m convbn demo [options]``).

    Args:
        argv: command-line arguments without the program name.

    Returns:
        The exit code (0 on success).

    Example:
        >>> main(["--epochs", "1", "--limit", "256", "--no-progress"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="convbn demo", description=COMMAND.help)
    add_arguments(parser)
    return run(parser.parse_args(None if argv is None else list(argv)))


COMMAND = Command(
    name="demo",
    help="train the tutorial's MNIST network fused vs unfused; print losses, memory and step time",
    add_arguments=add_arguments,
    run=run,
)


if __name__ == "__main__":
    raise SystemExit(main())
