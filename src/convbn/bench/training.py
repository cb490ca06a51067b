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
import copy
import ctypes
import gc
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.modules.dropout import _DropoutNd

from convbn.bench.checkpointing import CheckpointBlock, checkpoint_blocks, find_blocks
from convbn.progress import progress_scope
from convbn.bench.common import DTYPES, add_output_arguments, progress_bar, first_tensor, projection_loss, short_error, timed_ms, write_outputs
from convbn.bench.concat_checkpoint import NoConcatHead
from convbn.bench.models import build_model, check_input, check_spec
from convbn.bench.plotting import pyplot
from convbn.bench.training_configs import (
    CONCAT_CHECKPOINT,
    CONFIG_KEYS,
    DEFAULT_COMPILE_BUDGETS,
    TrainingConfig,
    budget_backend,
    build_config,
    config_names,
)
from convbn.bench.training_settings import TrainingBenchSettings
from convbn.bench.training_output import TrainingRow, print_table, rows_to_json, rows_to_markdown, write_plot
from convbn.memory import peak_memory, timeline, track_saved

# The runner's public API; the configurations, checkpointing and output live in
# training_configs.py, checkpointing.py and training_output.py.
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


def _step(cfg: TrainingConfig, x: Tensor, proj: Tensor) -> Tensor:
    cfg.optimizer.zero_grad(set_to_none=True)
    with cfg.context():
        out = first_tensor(cfg.model(x))
        projection_loss(out, proj).backward()
    cfg.optimizer.step()
    return out.detach()


_LIBC: Any = None


def _release_freed_memory(device: torch.device) -> None:
    """Give freed heap pages back to the OS so RSS-based peaks start from a comparable floor."""
    global _LIBC
    gc.collect()
    if device.type == "cuda":
        return
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:  # pragma: no cover - not glibc
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _max_diff(a: Optional[Tensor], b: Optional[Tensor]) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _max_abs(t: Optional[Tensor]) -> float:
    return 0.0 if t is None or not t.numel() else t.abs().max().item()


def _saved_bytes(cfg: TrainingConfig, x: Tensor) -> Tuple[int, int]:
    """``(saved bytes, saved bytes without parameters)`` of one training forward.

    Note: [Activation bytes]
        :func:`convbn.memory.saved_bytes` counts a parameter when an op saves it (eager conv
        saves its weight), but convbn's fused layers hold weights by reference and checkpointed
        blocks save only their inputs, so at small inputs the totals mostly compare parameter
        bookkeeping. The second figure drops parameter storages. It still counts tensors derived
        from parameters: inductor on CPU saves channels-last copies of conv weights for backward
        (layout optimization), which are real extra memory held by ``torch.compile`` configurations.
    """
    with torch.enable_grad(), track_saved(cfg.model, per_module=False) as rec:
        out = cfg.model(x)
    del out
    return rec.result.total, rec.result.activation_bytes


# --------------------------------------------------------------------------- the benchmark


def _make_input(model: nn.Module, shape: Tuple[int, ...], batch_size: int, image_size: Optional[int],
                spec: str, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    if image_size is not None and len(shape) > 1:
        resized = (shape[0],) + (image_size,) * (len(shape) - 1)
        if resized != tuple(shape):
            modes = [(m, m.training) for m in model.modules()]
            try:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(1, *resized, generator=gen).to(device, dtype))
                shape = resized
            except Exception as exc:  # noqa: BLE001 - a fixed-size model (e.g. mnist) keeps its size
                warnings.warn(f"{spec}: --image-size {image_size} does not fit this model ({short_error(exc)}); "
                              f"keeping its input size {tuple(shape[1:])}", stacklevel=3)
            finally:
                for m, t in modes:
                    m.training = t
    x = torch.randn(batch_size, *shape, generator=gen).to(device, dtype)
    check_input(model, x, spec, "pass --image-size with a size the model takes")
    return x


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
    return _TrainingBench(settings).run()


class _TrainingBench:
    """One run of the training benchmark: the model and input every configuration shares,
    and the rows as the phases of :meth:`run` fill them."""

    def __init__(self, settings: TrainingBenchSettings) -> None:
        s = self.settings = settings
        self.names = config_names(s.configs, s.budgets, s.compile_budgets, s.use_compile, s.peak_budgets)
        self.device = torch.device(s.device)
        if s.model is not None:
            if s.input_shape is None:
                raise ValueError("run_training_bench(model=...) needs input_shape=(C, H, W) (without the batch dimension)")
            base, shape = copy.deepcopy(s.model), tuple(s.input_shape)
        else:
            torch.manual_seed(s.seed)
            base, shape = build_model(s.spec)
        self.base = base.to(device=self.device, dtype=s.dtype).train()
        self.gen = torch.Generator().manual_seed(s.seed)
        self.x = _make_input(self.base, tuple(shape), s.batch_size, s.image_size, s.spec, self.device, s.dtype,
                             self.gen)
        dtype_name = str(s.dtype).replace("torch.", "")
        self.rows: Dict[str, TrainingRow] = {n: TrainingRow(s.spec, n, tuple(self.x.shape), str(self.device),
                                                            dtype_name) for n in self.names}
        self.cfgs: List[TrainingConfig] = []
        self.proj: Optional[Tensor] = None  # the loss's projection, drawn once eager's output shape is known
        self.eager: Optional[Tuple[Tensor, List[Optional[Tensor]], List[Tensor]]] = None  # first step's out, grads, buffers
        self.peaks: Dict[str, List[int]] = {}
        self.times: Dict[str, List[float]] = {}

    def run(self) -> List[TrainingRow]:
        """Build + first step, saved bytes, warm-up, peak and timed rounds; then the ratios."""
        s, x = self.settings, self.x
        with progress_scope("bench", False), progress_bar(s.progress) as bar:  # the bar, not convert's lines
            self.bar, self.task = bar, bar.add_task(f"{s.spec}: building", total=len(self.names) * s.rounds_per_config)
            for name in list(self.names):  # same weights, input and seed -> differences from eager
                self._build(name)
            for cfg in self.cfgs:
                self._saved(cfg)
            assert self.proj is not None  # eager ran
            self._rounds(s.warmup, "warm-up", lambda cfg, r: _step(cfg, x, self.proj))
            self.peaks = {c.name: [] for c in self.cfgs}
            self._rounds(s.memory_rounds, "peak memory", self._measure_peak)
            self.times = {c.name: [] for c in self.cfgs}
            self._rounds(s.steps, "timed step",
                         lambda cfg, r: self.times[cfg.name].append(timed_ms(lambda: _step(cfg, x, self.proj), self.device)))
        return self._summary()

    def _note(self, name: str, text: str) -> None:
        row = self.rows[name]
        row.note += f"{'; ' if row.note else ''}{text}"

    def _build(self, name: str) -> None:
        """Build configuration ``name`` and run its first step; a failure is noted in its row."""
        s, row = self.settings, self.rows[name]
        self.bar.update(self.task, description=f"{s.spec}: {name}: build + first step")
        t0 = time.perf_counter()
        try:
            cfg = build_config(name, self.base, self.x, s.lr)
            if self.proj is None:
                with torch.no_grad():
                    probe = first_tensor(copy.deepcopy(self.base).eval()(self.x[:1]))
                self.proj = torch.randn(probe.shape[1:], generator=self.gen).to(self.device)
            torch.manual_seed(s.seed + 1)
            out = _step(cfg, self.x, self.proj)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - report the failure in the row, keep going
            if name == "eager":
                raise
            if isinstance(exc, NoConcatHead) and s.configs is None:
                del self.rows[name]  # not asked for by name: a model without concatenations has no such row
                self.names.remove(name)
            else:
                row.note = f"failed: {short_error(exc)}"
            self.bar.advance(self.task, s.rounds_per_config)
            return
        row.setup_s = time.perf_counter() - t0
        self._compare_to_eager(cfg, row, out)
        row.note = cfg.note
        self.cfgs.append(cfg)
        self.bar.advance(self.task)

    def _compare_to_eager(self, cfg: TrainingConfig, row: TrainingRow, out: Tensor) -> None:
        """Record the first step's differences from eager's (eager itself: keep them)."""
        # zero_grad(set_to_none) at the next step start; these grads are the first step's
        grads = [None if p.grad is None else p.grad.detach().clone() for p in cfg.params]
        buffers = [b.detach().clone() for b in cfg.buffers if b.is_floating_point()]
        if cfg.name == "eager":
            self.eager = (out.clone(), grads, buffers)
            return
        ref_out, ref_grads, ref_buffers = self.eager
        row.max_out_diff = _max_diff(out, ref_out)
        row.max_grad_diff = max((_max_diff(g, r) for g, r in zip(grads, ref_grads)), default=0.0)
        scale = max((_max_abs(r) for r in ref_grads), default=0.0)
        row.max_grad_rel_diff = row.max_grad_diff / scale if scale > 0 else None
        buf = max((_max_diff(b, r) for b, r in zip(buffers, ref_buffers)), default=0.0)
        if buf > 1e-4:
            cfg.note += f"{'; ' if cfg.note else ''}running stats differ from eager by {buf:.1e}"
        if (cfg.name.startswith("torch.compile") and
                any(isinstance(m, _DropoutNd) and m.p > 0 for m in self.base.modules())):
            cfg.note += f"{'; ' if cfg.note else ''}dropout RNG differs under compile"

    def _saved(self, cfg: TrainingConfig) -> None:
        """Saved bytes of one training forward (see Note: [Saved bytes under torch.compile])."""
        self.bar.update(self.task, description=f"{self.settings.spec}: {cfg.name}: saved bytes")
        try:
            with cfg.context():
                self.rows[cfg.name].saved_bytes, self.rows[cfg.name].activation_bytes = _saved_bytes(cfg, self.x)
        except Exception as exc:  # noqa: BLE001
            self._note(cfg.name, f"saved bytes failed: {short_error(exc)}")
        self.bar.advance(self.task)

    def _rounds(self, n: int, label: str, body: Callable[[TrainingConfig, int], None]) -> None:
        """``n`` rounds of ``body`` over every live configuration (see Note: [Round-robin timing])."""
        for r in range(n):
            self.bar.update(self.task, description=f"{self.settings.spec}: {label} {r + 1}/{n}")
            live = [c for c in self.cfgs if not c.failed]
            k = r % max(len(live), 1)
            for cfg in live[k:] + live[:k]:
                try:
                    body(cfg, r)
                except Exception as exc:  # noqa: BLE001
                    cfg.failed = True
                    self._note(cfg.name, f"failed in {label}: {short_error(exc)}")
                self.bar.advance(self.task)

    def _measure_peak(self, cfg: TrainingConfig, r: int) -> None:
        # Note: [peak on CPU] exact live-tensor bytes (timeline, the one definition) where possible;
        # compiled graphs run outside Python dispatch, so for them fall back to
        # sampled process RSS and say so in the row.
        device, x, proj = self.device, self.x, self.proj
        _release_freed_memory(device)
        if "torch.compile" not in cfg.name:
            with cfg.context():
                tl = timeline(cfg.model, x, loss_fn=lambda out: projection_loss(first_tensor(out), proj),
                              optimizer=cfg.optimizer)
            self.peaks[cfg.name].append(tl.peak)
            return
        if device.type == "cpu" and r == 0:
            self._note(cfg.name, "peak: sampled RSS")
        cfg.optimizer.zero_grad(set_to_none=True)  # as timeline: freed gradients are not the step's
        _release_freed_memory(device)
        with peak_memory(device) as meter:
            _step(cfg, x, proj)
        self.peaks[cfg.name].append(meter.result.peak)

    def _summary(self) -> List[TrainingRow]:
        """Medians and ratios to eager, in configuration order; the plot where asked."""
        rows = self.rows
        for cfg in self.cfgs:
            row = rows[cfg.name]
            if self.peaks[cfg.name] and not cfg.failed:
                row.peak_bytes = int(statistics.median(self.peaks[cfg.name]))
            if self.times[cfg.name] and not cfg.failed:
                row.median_ms = statistics.median(self.times[cfg.name])
        eager = rows["eager"]
        for row in rows.values():
            if row.saved_bytes is not None and eager.saved_bytes:
                row.saved_ratio = row.saved_bytes / eager.saved_bytes
            if row.activation_bytes is not None and eager.activation_bytes:
                row.activation_ratio = row.activation_bytes / eager.activation_bytes
            if row.peak_bytes is not None and eager.peak_bytes:
                row.peak_ratio = row.peak_bytes / eager.peak_bytes
            if row.median_ms is not None and eager.median_ms:
                row.time_ratio = row.median_ms / eager.median_ms
        result = [rows[n] for n in self.names]
        if self.settings.plot_path:
            write_plot(result, self.settings.plot_path)
        return result


# --------------------------------------------------------------------------- command line


def add_training_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the training benchmark's options to ``parser`` (for ``convbn bench``)."""
    from convbn.cli import (batch_size, device_arg, existing_file, fraction, non_negative_int, output_path,
                            positive_float, positive_int)

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
    parser.add_argument("--budget", type=fraction, action="append", default=[], metavar="X",
                        help="add 'convert auto budget=X' (fraction in (0, 1] of eager saved bytes), repeatable")
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
    for flag, given in (("--budget", args.budget), ("--peak-budget", args.peak_budget)):
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
