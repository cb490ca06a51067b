"""What the demo measured and how it is shown: the results record, the loss comparison,
the table and the two PNGs (saved bytes / exact peak, and one step's memory timeline).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convbn.bench.plotting import pyplot
from convbn.bench.table import require_rich
from convbn.bench.timeline import plot_timelines
from convbn.memory import format_bytes, timeline

__all__ = [
    "CONFIGS",
    "CONFIG_HELP",
    "DemoResult",
    "accuracy_sentence",
    "compare_losses",
    "demo_pyplot",
    "results_table",
    "write_plot",
    "write_timeline_plot",
]

#: The demo's three configurations, in table order: eager, ``convert(strategy="auto")`` and
#: the tutorial's method (``convert(strategy="recompute_conv", chain=False)``).
CONFIGS: Tuple[str, ...] = ("unfused", "auto", "tutorial")
CONFIG_HELP = {
    "unfused": "plain nn.Conv2d -> nn.BatchNorm2d -> nn.ReLU (eager PyTorch)",
    "auto": "convbn.convert(net, strategy='auto'): planned per layer, chained",
    "tutorial": "convbn.convert(net, strategy='recompute_conv', chain=False): the tutorial's method",
}


@dataclass
class DemoResult:
    """What :func:`run_demo` measured, per configuration (keys of :data:`CONFIGS`).

    Attributes:
        step_losses: training loss of every step.
        accuracy: test accuracy after each epoch.
        saved: bytes held for backward at the end of one forward pass (parameters included).
        peak: exact peak memory of one training step above its start: live tensor bytes
            on CPU (:func:`convbn.memory.timeline`, Note: [a step's peak]), the CUDA allocator on a GPU.
        step_time: median seconds of the other training steps (first step left out).
        equality: one sentence per fused configuration: how its losses and gradients compare
            with unfused (the first step where either stops being bit-identical).
        plans: per fused configuration, the strategy of each fused layer.
        batch_size: the batch size used; memory_source: ``"tensors"`` or ``"cuda"``.
        test_images: the number of test images the accuracies are measured on.
        plot: the PNG written, if any.
        timeline_plot: the memory-timeline PNG written next to it, if any.
    """

    step_losses: Dict[str, List[float]] = field(default_factory=lambda: {c: [] for c in CONFIGS})
    accuracy: Dict[str, List[float]] = field(default_factory=lambda: {c: [] for c in CONFIGS})
    saved: Dict[str, int] = field(default_factory=dict)
    peak: Dict[str, int] = field(default_factory=dict)
    batch_fit: Any = None  # convbn.BatchFit with DemoConfig.memory
    step_time: Dict[str, float] = field(default_factory=dict)
    equality: Dict[str, str] = field(default_factory=dict)
    plans: Dict[str, str] = field(default_factory=dict)
    batch_size: int = 0
    test_images: int = 0
    memory_source: str = "tensors"
    plot: Optional[str] = None
    timeline_plot: Optional[str] = None


def compare_losses(
    name: str, losses: Sequence[float], reference: Sequence[float], first_grad_diff: Optional[Tuple[int, float]] = None
) -> str:
    """One sentence saying exactly how ``losses`` compare with the unfused ``reference``.

    Args:
        name: the configuration.
        losses / reference: per-step losses of the configuration and of unfused.
        first_grad_diff: ``(step index, max |grad difference|)`` of the first step whose
            gradients were not bit-identical to unfused's (``None``: they always were).

    Returns:
        Bit-identical at every step when it is so; otherwise the first step whose gradients
        differ and by how much, then the first step whose loss differs, the difference there
        and the largest one -- measured, not assumed.
    """
    n = len(reference)
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    first = next((i for i, d in enumerate(diffs) if d != 0.0), None)
    if first is None and first_grad_diff is None:
        return f"{name}: loss and gradients bit-identical to unfused at every one of the {n} steps"
    text = f"{name}: "
    if first_grad_diff is not None:
        step, gdiff = first_grad_diff
        text += (
            f"gradients bit-identical to unfused for the first {step} of {n} steps; at step {step + 1} they differ by "
            f"at most {gdiff:.1e} (float32 rounding: the fused backward evaluates the same formulas with other "
            f"kernels / summation order), and training amplifies that. "
        )
    if first is None:
        return text + f"Loss bit-identical at every one of the {n} steps"
    return text + (
        f"Loss bit-identical for the first {first} steps; from step {first + 1} it differs "
        f"(|diff| {diffs[first]:.1e} there, at most {max(diffs):.1e})"
    )


def accuracy_sentence(result: DemoResult) -> str:
    """The final test accuracies and how far apart they end, as measured (equal only when they are).

    Example: ``"final test accuracy: unfused 94.4%, auto 94.2%, tutorial 94.4%: not equal, 1 of 359
    test images apart ..."``.
    """
    final = {k: result.accuracy[k][-1] for k in CONFIGS if result.accuracy.get(k)}
    if not final:
        return "no test accuracy measured"
    text = "final test accuracy: " + ", ".join(f"{k} {100 * a:.1f}%" for k, a in final.items())
    spread = max(final.values()) - min(final.values())
    if spread == 0:
        return text + ": equal"
    images = round(spread * result.test_images) if result.test_images else None
    apart = f"{images} of {result.test_images} test images" if images is not None else f"{100 * spread:.1f} points"
    return text + (f": not equal, {apart} apart (the float32 rounding differences above change a few "
                   "predictions; the models are trained alike, not bit for bit)")


def _meter(result: DemoResult) -> str:
    return "CUDA allocator" if result.memory_source == "cuda" else "live tensors, exact"


def results_table(result: DemoResult, device: torch.device) -> Any:
    """A ``rich.table.Table``, one row per configuration: saved bytes, exact peak, step time, accuracy."""
    require_rich("the demo's table")
    from rich.table import Table

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "n/a"

    table = Table(title=f"MNIST net, batch {result.batch_size}, {device}, float32 (ratios: / unfused)")
    for col in ("configuration", "saved for backward", "ratio", f"peak of a step ({_meter(result)})", "ratio",
                "step time", "ratio", "test acc"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    s, p, t = result.saved, result.peak, result.step_time
    for k in CONFIGS:
        table.add_row(
            k, format_bytes(s[k]), ratio(s[k], s["unfused"]), format_bytes(p[k]), ratio(p[k], p["unfused"]),
            f"{1000 * t[k]:.1f} ms", ratio(t[k], t["unfused"]), f"{100 * result.accuracy[k][-1]:.1f}%",
        )
    return table


#: The configurations' names on the plots' axes, in plain words.
PLOT_NAMES = {
    "unfused": "unfused\n(plain PyTorch)",
    "auto": "auto\n(convbn default)",
    "tutorial": "tutorial\n(recompute conv)",
}


def write_plot(result: DemoResult, path: str, device: torch.device) -> None:
    """Bar chart PNG, two panels: memory (saved for backward, peak of a step; MiB) and step time (ms).

    Each bar is labelled with its ratio to unfused; both panels say lower is better.

    Raises:
        ImportError: matplotlib is missing (``pip install 'convbn[demo]'``).
    """
    plt = demo_pyplot()
    import numpy as np  # matplotlib's own dependency

    fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(10, 4.4), gridspec_kw={"width_ratios": [2, 1]})
    xs = np.arange(len(CONFIGS))
    names = [PLOT_NAMES.get(k, k) for k in CONFIGS]
    mib = 1024.0 ** 2
    for offset, values, label in ((-0.2, result.saved, "kept for backward after the forward"),
                                  (0.2, result.peak, f"peak of a training step ({_meter(result)})")):
        bars = ax.bar(xs + offset, [values[k] / mib for k in CONFIGS], width=0.4, label=label)
        ax.bar_label(bars, labels=[f"{values[k] / values['unfused']:.2f}x" for k in CONFIGS], fontsize=9)
    ax.set_xticks(xs, names)
    ax.set_ylim(0, 1.35 * max(max(result.saved.values()), max(result.peak.values())) / mib)  # room for the legend
    ax.set_ylabel("memory (MiB)")
    ax.set_title("Memory: lower is better")
    ax.legend(fontsize=9, loc="upper right")
    times = [1000 * result.step_time[k] for k in CONFIGS]
    bars = ax_t.bar(xs, times, width=0.6, color="tab:grey")
    ax_t.bar_label(bars, labels=[f"{result.step_time[k] / result.step_time['unfused']:.2f}x" for k in CONFIGS],
                   fontsize=9)
    ax_t.set_xticks(xs, list(CONFIGS))  # the memory panel's labels say what each is
    ax_t.set_ylim(0, 1.2 * max(times))
    ax_t.set_ylabel("median time of a training step (ms)")
    ax_t.set_title("Step time: lower is better")
    for a in (ax, ax_t):
        a.tick_params(axis="x", labelsize=9)
    fig.suptitle(f"convbn demo: the tutorial's MNIST net, batch {result.batch_size}, {device}, float32 "
                 "(bar labels: ratio to unfused)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_timeline_plot(models: Dict[str, nn.Module], x: Tensor, plot: str, device: torch.device) -> str:
    """One training step of each trained configuration recorded with
    :func:`convbn.memory.timeline` (exact live tensors on CPU, the CUDA allocator on a GPU)
    and drawn on one chart, each peak marked; written next to ``plot`` as ``*-timeline.png``.

    Copies of the models are stepped (forward, NLL loss, backward): the trained models and
    their running statistics are left as they are.

    Returns:
        The path written.
    """
    stem, ext = os.path.splitext(plot)
    path = f"{stem}-timeline{ext or '.png'}"
    target = torch.zeros(x.shape[0], dtype=torch.long, device=device)
    tls = []
    copies = []
    for name, model in models.items():
        m = copy.deepcopy(model).train()
        tls.append(timeline(m, x, loss_fn=lambda out: F.nll_loss(out, target), label=name))
        copies.append(m)
    plot_timelines(tls, path, title=f"convbn demo: memory during one training step, MNIST net, batch {x.shape[0]}, "
                                    f"{device}", models=copies)
    return path


def demo_pyplot() -> Any:
    """``matplotlib.pyplot`` for the demo's plots (an ImportError that says to pass --no-plot)."""
    return pyplot("the demo's plot", " (or pass --no-plot)", extra="demo")
