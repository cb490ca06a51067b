"""The training benchmark's rows and how they are shown: rich table, markdown, JSON, plot."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from convbn.bench.common import fmt, rows_to_json
from convbn.bench.plotting import pyplot
from convbn.bench.table import markdown_table, print_rich_table
from convbn.memory import format_bytes

__all__ = ["KEY_HEADERS", "TrainingRow", "peak_meter", "print_table", "rows_to_json", "rows_to_markdown", "write_plot"]


@dataclass
class TrainingRow:
    """One (model, configuration) measurement; a field is ``None`` where it could not be measured.

    Ratios are to the ``eager`` row of the same model and run (< 1: less memory / faster).
    """

    model: str
    config: str
    input_shape: Tuple[int, ...]
    device: str = "cpu"
    dtype: str = "float32"
    saved_bytes: Optional[int] = None
    saved_ratio: Optional[float] = None
    activation_bytes: Optional[int] = None   # saved_bytes without parameter storages ("saved excl. params")
    activation_ratio: Optional[float] = None
    peak_bytes: Optional[int] = None
    peak_ratio: Optional[float] = None
    median_ms: Optional[float] = None
    time_ratio: Optional[float] = None
    max_out_diff: Optional[float] = None
    max_grad_diff: Optional[float] = None
    max_grad_rel_diff: Optional[float] = None  # max_grad_diff / the largest |eager gradient| of any parameter
    setup_s: Optional[float] = None  # building + the first (untimed) step, compile included
    note: str = ""


def _bytes(n: Optional[int]) -> str:
    return "n/a" if n is None else format_bytes(n)


_HEADERS = ["model", "config", "input", "saved", "saved ratio", "saved excl. params", "excl. ratio", "peak",
            "peak ratio", "step ms", "time ratio", "max |Δout|", "max |Δgrad|", "Δgrad rel", "setup s", "note"]
_RIGHT = set(_HEADERS[3:15])
#: The default table's columns (fits 120 columns); ``--wide`` prints all of :data:`_HEADERS`.
KEY_HEADERS = ["model", "config", "saved excl. params", "excl. ratio", "peak", "peak ratio", "step ms", "time ratio",
               "max |Δgrad|"]
_RSS_NOTE = "peak: sampled RSS"


def peak_meter(rows: Sequence[TrainingRow]) -> str:
    """The one peak meter a table of ``rows`` shows: the CUDA allocator or exact live tensors."""
    return "CUDA allocator" if any(r.device.startswith("cuda") for r in rows) else "live tensors, exact"


def _cells(row: TrainingRow) -> List[str]:
    # Note: [one peak meter per table] on CPU, compiled graphs run outside Python dispatch,
    # so their peak could only be sampled RSS: a different meter, not comparable with the
    # exact live-tensor peaks of the other rows. The table leaves those cells empty ("n/a");
    # the JSON keeps the RSS figure with its note.
    rss = _RSS_NOTE in row.note
    return [
        row.model,
        row.config,
        "x".join(map(str, row.input_shape)),
        _bytes(row.saved_bytes),
        fmt(row.saved_ratio, ".3f"),
        _bytes(row.activation_bytes),
        fmt(row.activation_ratio, ".3f"),
        "n/a" if rss else _bytes(row.peak_bytes),
        "n/a" if rss else fmt(row.peak_ratio, ".2f"),
        fmt(row.median_ms, ".1f"),
        fmt(row.time_ratio, ".2f"),
        "-" if row.config == "eager" else fmt(row.max_out_diff, ".1e"),
        "-" if row.config == "eager" else fmt(row.max_grad_diff, ".1e"),
        "-" if row.config == "eager" else fmt(row.max_grad_rel_diff, ".1e"),
        fmt(row.setup_s, ".1f"),
        row.note,
    ]


def _columns(rows: Sequence[TrainingRow], wide: bool) -> Tuple[List[str], List[List[str]]]:
    headers = _HEADERS if wide else KEY_HEADERS
    keep = [_HEADERS.index(h) for h in headers]
    cells = [[c[i] for i in keep] for c in (_cells(r) for r in rows)]
    return [f"peak ({peak_meter(rows)})" if h == "peak" else h for h in headers], cells


def print_table(rows: Sequence[TrainingRow], title: Optional[str] = None, wide: bool = False) -> None:
    """Print the rows as a rich table: the key columns (fits 120 columns), all with ``wide``."""
    where = ", ".join(sorted({f"{r.device} {r.dtype}" for r in rows}))
    title = title or (f"Training step: eager vs convbn.convert vs checkpoint vs torch.compile ({where}; "
                      f"peak meter: {peak_meter(rows)}; ratios: / eager)")
    headers, cells = _columns(rows, wide)
    right = {h for h in headers if h not in ("model", "config", "note")}
    print_rich_table(headers, right, cells, title, width=240 if wide else 120)
    if any(_RSS_NOTE in r.note for r in rows) and not wide:
        print("peak n/a: compiled graphs on CPU run outside Python dispatch, so their exact peak cannot be counted "
              "(their sampled-RSS figure is in --json)")


def rows_to_markdown(rows: Sequence[TrainingRow], wide: bool = True) -> str:
    """The rows as a GitHub markdown table (for BENCHMARKS.md); all columns unless ``wide=False``."""
    headers, cells = _columns(rows, wide)
    return markdown_table(headers, {h for h in headers if h not in ("model", "config", "note")}, cells)


def write_plot(rows: Sequence[TrainingRow], path: str, x: str = "activation") -> None:
    """Scatter of saved-bytes ratio (x) vs step-time ratio (y), one point per configuration.

    Colour per configuration (method), marker per model; labels are the legend's, so
    nothing is written over the points. The title names the machine, dtype and batch.
    ``x="activation"`` plots :attr:`TrainingRow.activation_ratio` (parameters excluded, see
    Note: [Activation bytes]); ``x="saved"`` plots :attr:`TrainingRow.saved_ratio`.

    Raises:
        ImportError: matplotlib is missing (``pip install matplotlib``).
    """
    plt = pyplot("--plot")
    import platform

    if x not in ("activation", "saved"):
        raise ValueError(f"x must be 'activation' or 'saved', but got x={x!r}")
    field = "activation_ratio" if x == "activation" else "saved_ratio"
    fig, ax = plt.subplots(figsize=(9, 6))
    models = list(dict.fromkeys(r.model for r in rows))
    configs = list(dict.fromkeys(r.config for r in rows))
    markers = "os^Dv<>pP*X"
    colours = plt.get_cmap("tab10").colors  # 10 clearly different colours, one per configuration
    for r in rows:
        if getattr(r, field) is None or r.time_ratio is None:
            continue
        ax.scatter(getattr(r, field), r.time_ratio, s=60, alpha=0.85,
                   color=colours[configs.index(r.config) % len(colours)],
                   marker=markers[models.index(r.model) % len(markers)], edgecolors="black", linewidths=0.4)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker="o", color=colours[i % len(colours)], label=c) for i, c in enumerate(configs)]
    handles += [Line2D([], [], ls="", marker=markers[i % len(markers)], color="grey", label=m) for i, m in enumerate(models)]
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), title="colour: config, marker: model",
              title_fontsize=7)
    ax.axvline(1.0, color="grey", lw=0.5)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("saved activation bytes / eager (parameters excluded; lower: less held for backward)"
                  if x == "activation" else "saved bytes / eager (lower: less memory held for backward)")
    ax.set_ylabel("step time / eager (lower: faster)")
    devices = ", ".join(sorted({r.device for r in rows}))
    dtypes = ", ".join(sorted({r.dtype for r in rows}))
    batches = ", ".join(sorted({str(r.input_shape[0]) for r in rows if r.input_shape}))
    ax.set_title(f"Training: memory held for backward vs step time\n{platform.node() or 'this machine'} "
                 f"({devices}, {torch.get_num_threads()} threads), {dtypes}, batch {batches}", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
