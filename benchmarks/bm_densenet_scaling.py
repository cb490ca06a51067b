"""DenseNet memory vs depth (issue 11): eager vs convbn vs checkpoint-based memory-efficient variants.

For MONAI's DenseNet-121 / 169 / 201 / 264 (unmodified ``monai.networks.nets`` classes,
small images, small batch) every configuration of :mod:`convbn.bench.training` that matters
for DenseNets runs in one process per depth:

* ``eager``; ``convert auto`` (:func:`convbn.convert`);
* ``checkpoint concat heads (memory-efficient)``: concatenation + BN + ReLU + 1x1 conv of
  every dense layer under :func:`torch.utils.checkpoint.checkpoint` (torchvision's
  ``memory_efficient=True`` recipe, :mod:`convbn.bench.concat_checkpoint`);
* ``checkpoint per block``: one checkpoint per dense block / transition.

Measured: saved activation bytes of one training forward (parameters excluded, exact and
deterministic) and the exact live-tensor peak of one training step (``convbn.memory``),
with the step time for reference. The table lists, per configuration, each depth's bytes
and the *growth* from one depth to the next per added dense layer: a method whose memory
is linear in depth adds about the same bytes per layer whatever the depth, a quadratic one
adds more and more.

Run::

    python benchmarks/bm_densenet_scaling.py --image-size 64 --batch-size 4 \\
        --markdown densenet_scaling.md --plot densenet_scaling.png --json densenet_scaling.json
    python benchmarks/bm_densenet_scaling.py --quick
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Sequence, Tuple

import torch

from convbn.bench.plotting import pyplot
from convbn.bench.table import markdown_table, print_rich_table
from convbn.bench.training import CONCAT_CHECKPOINT, TrainingRow, run_training_bench, rows_to_json
from convbn.memory import format_bytes

#: MONAI class -> number of dense layers (block_config sums): 121 (6, 12, 24, 16) ...
DEPTHS: Dict[str, Tuple[int, ...]] = {
    "DenseNet121": (6, 12, 24, 16),
    "DenseNet169": (6, 12, 32, 32),
    "DenseNet201": (6, 12, 48, 32),
    "DenseNet264": (6, 12, 64, 48),
}
CONFIGS = ("auto", "concat_checkpoint", "checkpoint")
ORDER = ("eager", "convert auto", CONCAT_CHECKPOINT, "checkpoint per block")


def bm_densenet_scaling(names: Sequence[str], batch_size: int, image_size: int, steps: int,
                        memory_rounds: int, progress: bool = True) -> List[TrainingRow]:
    """One :func:`run_training_bench` per MONAI DenseNet (2-D, 3 input channels, 10 classes)."""
    rows: List[TrainingRow] = []
    for name in names:
        spec = f"monai:{name}(spatial_dims=2,in_channels=3,out_channels=10)"
        rows += run_training_bench(spec, batch_size=batch_size, configs=list(CONFIGS), steps=steps, warmup=0,
                                   memory_rounds=memory_rounds, use_compile=False, image_size=image_size,
                                   progress=progress)
    return rows


def _layers(row: TrainingRow) -> int:
    return sum(DEPTHS[row.model.split(":")[1].split("(")[0]])


def _table(rows: Sequence[TrainingRow]) -> Tuple[List[str], List[List[str]]]:
    headers = ["config", "model", "dense layers", "saved excl. params", "/ eager", "growth per added layer",
               "peak (live tensors)", "/ eager", "step ms", "note"]
    cells: List[List[str]] = []
    eager = {r.model: r for r in rows if r.config == "eager"}
    for config in ORDER:
        prev = None
        for r in (r for r in rows if r.config == config):
            growth = "-"
            if prev is not None and r.activation_bytes is not None and prev.activation_bytes is not None:
                growth = format_bytes((r.activation_bytes - prev.activation_bytes) / (_layers(r) - _layers(prev)))
            e = eager[r.model]
            cells.append([
                config, r.model.split(":")[1].split("(")[0], str(_layers(r)),
                "n/a" if r.activation_bytes is None else format_bytes(r.activation_bytes),
                "-" if r.activation_bytes is None else f"{r.activation_bytes / e.activation_bytes:.3f}",
                growth,
                "n/a" if r.peak_bytes is None else format_bytes(r.peak_bytes),
                "-" if r.peak_bytes is None else f"{r.peak_bytes / e.peak_bytes:.3f}",
                "-" if r.median_ms is None else f"{r.median_ms:.0f}",
                r.note,
            ])
            prev = r
    return headers, cells


def write_plot(rows: Sequence[TrainingRow], path: str) -> None:
    """Two panels, saved activation bytes and peak vs number of dense layers, one line per configuration."""
    plt = pyplot("--plot")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, field, label in ((axes[0], "activation_bytes", "saved for backward (excl. parameters)"),
                             (axes[1], "peak_bytes", "peak of a training step (exact live tensors)")):
        for config in ORDER:
            pts = [(_layers(r), getattr(r, field)) for r in rows if r.config == config and getattr(r, field)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] / 2 ** 20 for p in pts], marker="o", label=config)
        ax.set_xlabel("dense layers (DenseNet-121 / 169 / 201 / 264)")
        ax.set_ylabel("MiB")
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    shape = "x".join(map(str, rows[0].input_shape)) if rows else ""
    fig.suptitle(f"MONAI DenseNets, input {shape}, {rows[0].dtype if rows else ''} on {rows[0].device if rows else ''}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEPTHS), help="comma list of MONAI DenseNet classes")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="timed steps (median)")
    parser.add_argument("--memory-rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="DenseNet121 and 169 at 32x32, batch 2")
    parser.add_argument("--markdown", default=None, metavar="PATH")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--plot", default=None, metavar="PATH")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in DEPTHS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(DEPTHS)}")
    if args.quick:
        names, args.batch_size, args.image_size, args.steps = names[:2], 2, 32, 1
    if args.plot:
        pyplot("--plot")
    rows = bm_densenet_scaling(names, args.batch_size, args.image_size, args.steps, args.memory_rounds,
                               progress=not args.no_progress)
    headers, cells = _table(rows)
    right = set(headers[2:9])
    print_rich_table(headers, right, cells, "DenseNet memory vs depth (saved excl. params, exact peak; / eager)",
                     width=200)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(markdown_table(headers, right, cells) + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(rows_to_json(rows) + "\n")
    if args.plot:
        write_plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
