"""Memory timelines of one training step, eager vs converted, on one chart.

``convbn bench --timeline PATH`` (or ``python -m convbn.bench.training --timeline PATH``)
records :func:`convbn.memory.timeline` for each configuration of the benchmarked model and
draws them with matplotlib: live bytes against the fraction of the step done, each
configuration's peak marked and labelled with its size, its ratio to eager and where it
falls (phase, module, operator).

Example:
    >>> from convbn.bench.timeline import record_timelines, plot_timelines  # doctest: +SKIP
    >>> tls = record_timelines(model, x)                                    # doctest: +SKIP
    >>> plot_timelines(tls, "timeline.png", title="MNIST, batch 2048")      # doctest: +SKIP
"""
from __future__ import annotations

import copy
import os
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..memory import Timeline, format_bytes, timeline
from .plotting import pyplot
from ..passes.convert import convert

__all__ = ["TIMELINE_CONFIGS", "record_timelines", "plot_timelines", "write_bench_timeline"]

#: configuration name -> ``convert`` keyword arguments (``None``: the eager model itself)
TIMELINE_CONFIGS: Dict[str, Optional[Dict[str, object]]] = {
    "eager": None,
    "convert auto": {"strategy": "auto"},
    "convert recompute_conv (tutorial)": {"strategy": "recompute_conv", "chain": False},
    "convert recompute_bn": {"strategy": "recompute_bn"},
}


def _projection_loss(seed: int) -> Callable[[object], Tensor]:
    """A loss with O(1) gradients for any output: a fixed random projection per sample
    (the same kind as the training benchmark's)."""
    cache: Dict[Tuple[int, ...], Tensor] = {}

    def loss(out: object) -> Tensor:
        t = out if isinstance(out, Tensor) else next(
            v for v in torch.utils._pytree.tree_leaves(out) if isinstance(v, Tensor))
        if t.shape not in cache:
            g = torch.Generator().manual_seed(seed)
            cache[t.shape] = torch.randn(t.shape, generator=g).to(t.device)
        return (t.float() * cache[t.shape]).sum() / t.shape[0]

    return loss


def record_timelines(
    model: nn.Module,
    x: Tensor,
    configs: Sequence[str] = tuple(TIMELINE_CONFIGS),
    lr: float = 1e-3,
    seed: int = 0,
) -> List[Timeline]:
    """One training step's :class:`convbn.memory.Timeline` per configuration.

    Each configuration gets its own deep copy of ``model`` and an SGD optimizer, takes one
    warm-up step (so gradients exist, as in training), then one recorded step
    (``zero_grad``, forward, loss, backward, ``step``).

    Args:
        model: the eager model (not modified).
        x: one input batch.
        configs: names from :data:`TIMELINE_CONFIGS`.
        lr: SGD learning rate.
        seed: seeds the model copies' RNG and the loss projection.

    Returns:
        The timelines, labelled with the configuration names, in ``configs`` order.
    """
    unknown = [c for c in configs if c not in TIMELINE_CONFIGS]
    if unknown:
        raise ValueError(f"timeline configurations must be among {list(TIMELINE_CONFIGS)}, but got {unknown}")
    loss_fn = _projection_loss(seed)
    out: List[Timeline] = []
    for name in configs:
        kwargs = TIMELINE_CONFIGS[name]
        m = copy.deepcopy(model).train()
        if kwargs is not None:
            extra = {"example_inputs": x} if kwargs.get("strategy") == "auto" else {}
            m = convert(m, **kwargs, **extra)  # type: ignore[arg-type]
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr)
        torch.manual_seed(seed)
        opt.zero_grad(set_to_none=True)
        loss_fn(m(x)).backward()
        opt.step()
        torch.manual_seed(seed)
        out.append(timeline(m, x, loss_fn=loss_fn, optimizer=opt, label=name))
        del m, opt
    return out


def plot_timelines(timelines: Sequence[Timeline], path: str, title: Optional[str] = None) -> None:
    """Draw ``timelines`` on one chart and write it to ``path`` (PNG).

    The x axis is the fraction of the step's operators done (configurations run different
    numbers of operators); each peak is marked and labelled with its size, its ratio to the
    first timeline (the baseline) and where it falls.

    Raises:
        ImportError: matplotlib is missing (``pip install matplotlib``).
        ValueError: no timelines.
    """
    if not timelines:
        raise ValueError("plot_timelines needs at least one timeline")
    plt = pyplot("--timeline")
    mib = float(1 << 20)
    base = timelines[0].peak or 1
    fig, ax = plt.subplots(figsize=(10, 6.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    segments = _phase_segments(timelines[0])
    for k, tl in enumerate(timelines):
        xs = _aligned_x(tl, segments)
        ys = [p.bytes / mib for p in tl.points]
        c = colours[k % len(colours)]
        i = tl.peak_index
        p = tl.points[i]
        where = f"{p.phase}: {p.module or '<root>'}, {p.op.split('/')[0]}"
        ax.plot(xs, ys, color=c, lw=1.2,
                label=f"{tl.label or f'config {k}'}: peak {format_bytes(tl.peak)} ({tl.peak / base:.2f}x) at {where}")
        ax.plot([xs[i]], [ys[i]], marker="o", color=c, ms=7, markeredgecolor="black", markeredgewidth=0.5)
        ax.annotate(f"{format_bytes(tl.peak)} ({tl.peak / base:.2f}x)", (xs[i], ys[i]), textcoords="offset points",
                    xytext=(6, 4 + 11 * k), fontsize=8, color=c, fontweight="bold")  # staggered: peaks may tie
    first = timelines[0]
    for phase, (x0, _) in segments.items():
        ax.axvline(x0, color="grey", lw=0.4, ls=":")
        ax.text(x0, 1.0, f" {phase}", transform=ax.get_xaxis_transform(), fontsize=7, color="grey", va="top",
                rotation=90 if phase in ("zero_grad", "loss") else 0)
    ax.set_xlabel("operators of the training step (each phase scaled to its share of "
                  f"{first.label or 'the first configuration'}'s operators)")
    ax.set_ylabel("live bytes above the step's start (MiB)" + (" [CUDA allocator]" if first.source == "cuda" else
                                                              " [exact live tensors]"))
    ax.set_title(title or "Memory timeline of one training step")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(top=max(p.bytes for tl in timelines for p in tl.points) / mib * 1.1)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _phase_segments(tl: Timeline) -> Dict[str, Tuple[float, float]]:
    """Each phase's ``(start, length)`` on the x axis: its share of ``tl``'s operators."""
    counts: Dict[str, int] = {}
    for p in tl.points:
        counts[p.phase] = counts.get(p.phase, 0) + 1
    total, at, out = max(1, len(tl.points)), 0.0, {}
    for phase, n in counts.items():
        out[phase] = (at, n / total)
        at += n / total
    return out


def _aligned_x(tl: Timeline, segments: Dict[str, Tuple[float, float]]) -> List[float]:
    """x of each point: its rank within its phase, spread over that phase's segment, so the
    phases of configurations running different numbers of operators line up."""
    counts: Dict[str, int] = {}
    for p in tl.points:
        counts[p.phase] = counts.get(p.phase, 0) + 1
    end = max((a + b for a, b in segments.values()), default=0.0)
    seen: Dict[str, int] = {}
    xs = []
    for p in tl.points:
        j = seen.get(p.phase, 0)
        seen[p.phase] = j + 1
        if p.phase not in segments:  # a phase the baseline did not run: after everything
            segments[p.phase] = (end, 0.05)
            end += 0.05
        a, b = segments[p.phase]
        xs.append(a + b * j / counts[p.phase])
    return xs


def _input_for(shape: Tuple[int, ...], batch_size: int, image_size: Optional[int]) -> Tensor:
    if image_size is not None:
        shape = (shape[0], *([image_size] * (len(shape) - 1)))
    return torch.randn(batch_size, *shape)


def _path_for(path: str, spec: str, n_models: int) -> str:
    if n_models <= 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-{re.sub(r'[^A-Za-z0-9]+', '_', spec).strip('_')}{ext or '.png'}"


def write_bench_timeline(specs: Sequence[str], batch_size: int, path: str, image_size: Optional[int] = None,
                         seed: int = 0, configs: Sequence[str] = tuple(TIMELINE_CONFIGS)) -> List[str]:
    """``--timeline PATH``: record and plot the timelines of each model spec (one PNG per
    model; with several models the spec is appended to ``PATH``'s stem). Prints each
    configuration's peak and where it falls.

    Returns:
        The paths written.
    """
    from .models import build_model

    written = []
    for spec in specs:
        torch.manual_seed(seed)
        model, shape = build_model(spec)
        x = _input_for(shape, batch_size, image_size)
        tls = record_timelines(model, x, configs, seed=seed)
        out = _path_for(path, spec, len(specs))
        plot_timelines(tls, out, title=f"{spec}, batch {batch_size}, input {tuple(x.shape[1:])}: one SGD step")
        for tl in tls:
            print(f"timeline {spec} {tl.label}: peak {format_bytes(tl.peak)} ({tl.peak / max(1, tls[0].peak):.3f}x)"
                  f" at {tl.where()}")
        print(f"timeline written to {out}")
        written.append(out)
    return written
