"""Inference benchmark: unfused eager vs ``torch.fx`` ``fuse`` vs ``convbn.fold`` (+ script / compile).

Everything runs in one process, on the same input, in eval mode without grad. Variants
are timed in interleaved rounds (one call of each variant per round, the order rotating
from round to round) so that load from other processes hits them alike. Reported: the
median time over rounds with its interquartile range, the *paired* ratio to the unfused
model and to ``torch.fx``'s ``fuse`` (median over rounds of the two times measured in the
same round), the largest absolute output difference from the unfused model, and how many
BatchNorm modules are left.

Run::

    convbn bench --inference --model monai:resnet18 --model mnist --batch-size 8

(see :func:`add_inference_arguments` / :func:`main_inference`).
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from convbn.bench.common import DTYPES, add_output_arguments, progress_bar, first_tensor, fmt, rows_to_json, short_error, write_outputs
from convbn.bench.models import build_model, check_input
from convbn.cli_model import load_checkpoint
from convbn.bench.plotting import pyplot
from convbn.bench.table import markdown_table, print_rich_table
from convbn.passes.fold.api import fold

__all__ = [
    "InferenceRow",
    "run_inference_bench",
    "print_table",
    "rows_to_markdown",
    "rows_to_json",
    "write_plot",
    "add_inference_arguments",
    "main_inference",
    "DEFAULT_MODELS",
]

DEFAULT_MODELS = ("monai:resnet18", "monai:resnet50", "efficientnet:b0", "mnist")
VARIANTS = ("unfused", "fx fuse", "convbn.fold", "fold + jit.script", "fold + torch.compile")


@dataclass
class InferenceRow:
    """One (model, variant) measurement. ``median_ms`` is ``None`` when the variant failed."""

    model: str
    variant: str
    input_shape: Tuple[int, ...]
    median_ms: Optional[float] = None
    iqr_ms: Optional[Tuple[float, float]] = None  # 25th and 75th percentile
    ratio: Optional[float] = None          # median over rounds of time / unfused time in the same round
    ratio_to_fuse: Optional[float] = None  # the same against torch.fx's fuse (None if fuse failed)
    max_abs_diff: Optional[float] = None   # vs the unfused output
    batchnorms_left: Optional[int] = None  # BatchNorm modules left in the variant
    note: str = ""


def _randomize_bn(model: nn.Module, seed: int) -> None:
    """Non-trivial running statistics, so folding changes weights measurably."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_((torch.rand(m.running_mean.shape, generator=g) - 0.5) * 0.2)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) * 0.5 + 0.75)


def _count_bn(model: Any) -> Optional[int]:
    if not isinstance(model, nn.Module) or isinstance(model, torch.jit.ScriptModule):
        return None
    return sum(isinstance(m, _BatchNorm) for m in model.modules())


def _make_variants(model: nn.Module, x: Tensor, use_compile: bool) -> List[Tuple[str, Optional[Callable], str]]:
    """``(name, callable or None, note)`` for each variant; building is not timed."""
    from torch.fx.experimental.optimization import fuse

    variants: List[Tuple[str, Optional[Callable], str]] = [("unfused", model, "")]
    try:
        variants.append(("fx fuse", fuse(model), ""))
    except Exception as exc:  # noqa: BLE001 - record why fuse cannot handle the model
        variants.append(("fx fuse", None, short_error(exc, 100)))
    folded = fold(model, example_inputs=x, check=False)
    report = folded.convbn_report
    variants.append(("convbn.fold", folded, f"{len(report.folded)} folded, {len(report.skipped)} skipped"))
    try:
        with warnings.catch_warnings():
            # TorchScript's compiler warns about annotations it cannot use (and that it is
            # deprecated); the variant's note says when it fell back, which is what matters here.
            warnings.simplefilter("ignore")
            scripted = torch.jit.script(folded)
        variants.append(("fold + jit.script", scripted, ""))
    except Exception as exc:  # noqa: BLE001 - fall back to tracing and say so
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TracerWarnings: the note says it was traced
                traced = torch.jit.trace(folded, (x,), check_trace=False)
            variants.append(("fold + jit.script", traced, f"script failed ({short_error(exc, 100)}); used jit.trace"))
        except Exception as exc2:  # noqa: BLE001
            variants.append(("fold + jit.script", None, f"script and trace failed: {short_error(exc2, 100)}"))
    if use_compile:
        try:
            compiled = torch.compile(folded)
            with torch.no_grad():
                compiled(x)  # compile now, outside the timed rounds
            variants.append(("fold + torch.compile", compiled, ""))
        except Exception as exc:  # noqa: BLE001
            variants.append(("fold + torch.compile", None, short_error(exc, 100)))
    return variants


def run_inference_bench(
    specs: Sequence[str] = DEFAULT_MODELS,
    batch_size: int = 8,
    repeats: int = 20,
    warmup: int = 3,
    *,
    image_size: Optional[int] = None,
    use_compile: bool = False,
    seed: int = 0,
    progress: Optional[bool] = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    checkpoint: Optional[str] = None,
) -> List[InferenceRow]:
    """Benchmark inference of each model spec (see :mod:`convbn.bench.models`).

    Args:
        specs: model specs, e.g. ``"monai:resnet18"``, ``"mnist"``.
        batch_size: batch size of the random input.
        repeats: timed rounds (one call of every variant per round); the median is reported.
        warmup: untimed rounds first (TorchScript's profiling executor needs >= 2).
        image_size: overrides every spatial size of the model's default input.
        use_compile: also time ``torch.compile`` of the folded model (slow to compile).
        seed: seed of the weights, BatchNorm statistics and input.
        progress: a rich progress bar on stderr: ``None`` where stderr is a terminal, ``True`` always,
            ``False`` never.
        device / dtype: where and in which dtype the model and input live.
        checkpoint: load these weights (:func:`convbn.cli_model.load_checkpoint`) into every
            model instead of randomising its BatchNorm statistics.

    Returns:
        One :class:`InferenceRow` per (model, variant).
    """
    rows: List[InferenceRow] = []
    with torch.no_grad(), progress_bar(progress) as bar:
        task = bar.add_task("inference benchmark", total=len(specs) * (warmup + repeats))
        for spec in specs:
            bar.update(task, description=f"{spec}: building")
            model, x = _model_and_input(spec, batch_size, image_size, seed, checkpoint, device, dtype)
            variants = _make_variants(model, x, use_compile)
            reference = first_tensor(model(x))
            diffs: Dict[str, float] = {}
            for name, fn, _ in variants:
                if fn is not None:
                    diffs[name] = (first_tensor(fn(x)) - reference).abs().max().item()
            live = [(name, fn) for name, fn, _ in variants if fn is not None]
            times = _time_rounds(live, x, warmup, repeats, lambda r: bar.update(
                task, description=f"{spec}: round {r + 1}/{warmup + repeats}"), lambda: bar.advance(task))
            rows += _variant_rows(spec, tuple(x.shape), variants, times, diffs)
    return rows


def _model_and_input(spec: str, batch_size: int, image_size: Optional[int], seed: int, checkpoint: Optional[str],
                     device: str, dtype: torch.dtype) -> Tuple[nn.Module, Tensor]:
    """``spec``'s model in eval mode (random BatchNorm statistics, or ``checkpoint``'s
    weights) and a random input batch, resized to ``image_size`` where the model takes it."""
    torch.manual_seed(seed)
    model, shape = build_model(spec)
    if checkpoint is None:
        _randomize_bn(model, seed)
    else:
        load_checkpoint(model, checkpoint)
    model.eval().to(device=device, dtype=dtype)
    x = torch.randn(batch_size, *shape).to(device=device, dtype=dtype)
    if image_size is not None and len(shape) > 1:
        resized = torch.randn(batch_size, shape[0], *((image_size,) * (len(shape) - 1))).to(device=device, dtype=dtype)
        try:
            model(resized[:1])
            x = resized
        except Exception as exc:  # noqa: BLE001 - fixed-size model (e.g. mnist): keep its size, say so
            warnings.warn(f"{spec}: --image-size {image_size} does not fit this model ({short_error(exc, 100)}); "
                          f"using its own input size {tuple(shape)}", stacklevel=3)
    check_input(model, x, spec, "pass --image-size with a size the model takes")
    return model, x


def _time_rounds(live: List[Tuple[str, Callable[[Tensor], Any]]], x: Tensor, warmup: int, repeats: int,
                 start_round: Callable[[int], None], end_round: Callable[[], None]) -> Dict[str, List[float]]:
    """Milliseconds per call of each variant, one call of every variant per round, the order
    rotated each round; the first ``warmup`` rounds untimed."""
    times: Dict[str, List[float]] = {name: [] for name, _ in live}
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for round_ in range(warmup + repeats):
        start_round(round_)
        shift = round_ % len(live)  # rotate the order: no variant always runs first
        for name, fn in live[shift:] + live[:shift]:
            sync()
            start = time.perf_counter()
            fn(x)
            sync()
            elapsed = time.perf_counter() - start
            if round_ >= warmup:
                times[name].append(elapsed * 1e3)
        end_round()
    return times


def _variant_rows(spec: str, shape: Tuple[int, ...], variants: List[Tuple[str, Any, str]],
                  times: Dict[str, List[float]], diffs: Dict[str, float]) -> List[InferenceRow]:
    """One row per variant: median and quartiles, ratios to the unfused model and to fx's fuse."""
    def paired(name: str, against: str) -> Optional[float]:
        # Ratios within a round cancel slow drifts in machine load (shared CPUs).
        if against not in times:
            return None
        return statistics.median(a / b for a, b in zip(times[name], times[against]))

    rows = []
    for name, fn, note in variants:
        row = InferenceRow(spec, name, shape, note=note)
        if fn is not None:
            row.median_ms = statistics.median(times[name])
            q = statistics.quantiles(times[name], n=4) if len(times[name]) > 1 else [row.median_ms] * 3
            row.iqr_ms = (q[0], q[2])
            row.ratio = paired(name, "unfused")
            row.ratio_to_fuse = paired(name, "fx fuse")
            row.max_abs_diff = diffs[name]
            row.batchnorms_left = _count_bn(fn)
        rows.append(row)
    return rows


def _cells(row: InferenceRow) -> List[str]:
    return [
        row.model,
        row.variant,
        "x".join(map(str, row.input_shape)),
        fmt(row.median_ms, ".2f"),
        "-" if row.iqr_ms is None else f"{row.iqr_ms[0]:.2f}-{row.iqr_ms[1]:.2f}",
        fmt(row.ratio, ".3f"),
        fmt(row.ratio_to_fuse, ".3f"),
        fmt(row.max_abs_diff, ".2e"),
        "-" if row.batchnorms_left is None else str(row.batchnorms_left),
        row.note,
    ]


_HEADERS = ["model", "variant", "input", "median ms", "IQR ms", "ratio to unfused", "ratio to fx fuse", "max abs diff", "BN left", "note"]


_RIGHT = ("median ms", "IQR ms", "ratio to unfused", "ratio to fx fuse", "max abs diff", "BN left")


_KEY = ["model", "variant", "median ms", "ratio to unfused", "ratio to fx fuse", "max abs diff", "BN left"]


def print_table(rows: Sequence[InferenceRow], title: Optional[str] = None, wide: bool = False) -> None:
    """Print the rows as a rich table: the key columns (fits 120 columns), every column with ``wide``."""
    title = title or "Inference: unfused vs fx fuse vs convbn.fold (eval, no grad)"
    headers = _HEADERS if wide else _KEY
    keep = [_HEADERS.index(h) for h in headers]
    print_rich_table(headers, _RIGHT, [[c[i] for i in keep] for c in map(_cells, rows)], title,
                     width=200 if wide else 120)


def write_plot(rows: Sequence[InferenceRow], path: str) -> None:
    """Bar chart PNG of each variant's time relative to unfused, grouped by model (colour per variant).

    Raises:
        ImportError: matplotlib is missing.
    """
    plt = pyplot("--plot")
    models = list(dict.fromkeys(r.model for r in rows))
    variants = [v for v in VARIANTS if any(r.variant == v for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models) + 2), 4.5))
    width = 0.8 / max(len(variants), 1)
    for j, v in enumerate(variants):
        vals = [next((r.ratio or 0.0 for r in rows if r.model == m and r.variant == v), 0.0) for m in models]
        ax.bar([i + (j - (len(variants) - 1) / 2) * width for i in range(len(models))], vals, width=width, label=v)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xticks(range(len(models)), models, fontsize=8)
    ax.set_ylabel("time / unfused (lower: faster)")
    batch = ", ".join(sorted({str(r.input_shape[0]) for r in rows}))
    import platform

    ax.set_title(f"Inference on {platform.node() or 'this machine'} ({torch.get_num_threads()} threads), batch {batch}",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rows_to_markdown(rows: Sequence[InferenceRow]) -> str:
    """The rows as a GitHub markdown table."""
    return markdown_table(_HEADERS, _RIGHT, [_cells(r) for r in rows])


class _DeprecatedModels(argparse.Action):
    """``--models A B`` (the old spelling): adds to ``--model`` and warns once."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        warnings.warn("--models SPEC... is deprecated; repeat --model SPEC instead (the same flag in every bench mode)",
                      FutureWarning, stacklevel=2)
        namespace.model = list(getattr(namespace, "model", None) or []) + list(values)


def add_inference_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the inference benchmark's options to ``parser`` (for ``convbn bench --inference``)."""
    from convbn.cli import device_arg, existing_file, non_negative_int, positive_int

    parser.add_argument("--model", action="append", default=None, metavar="SPEC",
                        help="model spec, repeatable, e.g. monai:resnet18 'monai:resnet50(spatial_dims=2)' "
                             "efficientnet:b0 mnist, or module:callable (a function of yours returning the model) "
                             f"(default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--checkpoint", type=existing_file, default=None, metavar="PATH",
                        help="load these weights (a state_dict or a checkpoint holding one) into the model")
    parser.add_argument("--models", nargs="+", action=_DeprecatedModels, metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=positive_int, default=8, help="batch size")
    parser.add_argument("--image-size", type=positive_int, default=None,
                        help="override the spatial size of every input (a warning where a model does not allow it)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="torch device: cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter and input dtype")
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed rounds before timing")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the folded model (slow)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads before timing")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, BatchNorm statistics and input")
    add_output_arguments(parser, plot_help="write a time-ratio bar chart PNG")
    return parser


def main_inference(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed arguments, print the table; returns an exit code.

    Raises:
        ValueError / ImportError: a bad spec (``convbn`` prints it as one line, exit 2).
    """
    from .models import build_model as _check

    specs = args.model or list(DEFAULT_MODELS)
    for spec in specs:  # a bad spec fails before any timing
        _check(spec)
    if args.plot:
        pyplot("--plot")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = run_inference_bench(
        specs, args.batch_size, args.repeats, args.warmup, image_size=args.image_size,
        use_compile=args.compile, seed=args.seed, progress=args.progress,
        device=args.device, dtype=DTYPES[args.dtype], checkpoint=args.checkpoint,
    )
    print_table(rows, title=f"Inference: unfused vs fx fuse vs convbn.fold ({args.device} {args.dtype}, eval, no grad)",
                wide=args.wide)
    write_outputs(args, rows, rows_to_markdown, rows_to_json, write_plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_inference(add_inference_arguments(argparse.ArgumentParser(description=__doc__)).parse_args()))
