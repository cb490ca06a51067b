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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._compat import pytree
from ..memory import Timeline, format_bytes, timeline
from .plotting import pyplot
from ..passes.convert.api import convert

__all__ = ["TIMELINE_CONFIGS", "PHASE_NAMES", "describe_point", "record_timelines", "plot_timelines",
           "write_bench_timeline"]

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
            v for v in pytree.tree_leaves(out) if isinstance(v, Tensor))
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


#: The phases of a training step, in plain words (x-axis labels).
PHASE_NAMES = {"zero_grad": "zero grad", "forward": "forward", "loss": "loss", "backward": "backward",
               "optimizer": "optimizer step"}


def _plain_op(op: str) -> str:
    """``"ReluBackward0/aten.threshold_backward"`` -> ``"relu"``, ``"aten.convolution.default"`` -> ``"convolution"``."""
    head = op.split("/")[0]
    if head.startswith("ChainFunction"):
        return "fused conv + BN chain"
    head = re.sub(r"Backward\d*$", "", head)
    if head.startswith("aten."):
        head = head.split(".")[1]
    return head.lower()


def describe_point(point: "object", model: Optional[nn.Module] = None) -> str:
    """Where a timeline point falls, in plain words: ``"backward of block2.act (relu)"``.

    A module that is a fused chain of the converted ``model`` is named by the layers it
    fuses (``"backward of fused layers conv1 + conv2"``) rather than by its internal name.
    """
    phase = PHASE_NAMES.get(point.phase, point.phase)  # type: ignore[attr-defined]
    name = point.module  # type: ignore[attr-defined]
    op = _plain_op(point.op)  # type: ignore[attr-defined]
    module = None
    if model is not None and name:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
    layers = getattr(module, "layers", None)
    if layers is not None and all(hasattr(l, "names") for l in layers):
        convs = [l.names[0] for l in layers if l.names and l.names[0]]
        return f"{phase} of fused layers {' + '.join(convs)}"
    chain = re.fullmatch(r"convbn_chain(\d+)", name or "")
    if chain:  # a converted model's fused chain, the model not at hand: its number, counted from 1
        return f"{phase} of fused chain {int(chain.group(1)) + 1}"
    return f"{phase} of {name or 'the model'} ({op})" if op else f"{phase} of {name or 'the model'}"


def plot_timelines(timelines: Sequence[Timeline], path: str, title: Optional[str] = None,
                   models: Optional[Sequence[Optional[nn.Module]]] = None) -> List[str]:
    """Draw ``timelines`` on one chart and write it to ``path`` (PNG).

    The x axis is the training step, phase by phase (forward, loss, backward, optimizer step:
    configurations run different numbers of operators, so each phase spans its share of the
    first timeline's operators). Each peak is marked; the legend gives its size, its ratio to
    the first timeline (the baseline) and where it falls, in plain words.

    Args:
        timelines: one per configuration, the baseline first.
        path: the PNG to write.
        title: the chart's title.
        models: the model each timeline ran (optional): fused chains are then named by the
            layers they fuse.

    Returns:
        The legend's lines, one per timeline.

    Raises:
        ImportError: matplotlib is missing (``pip install matplotlib``).
        ValueError: no timelines.
    """
    if not timelines:
        raise ValueError("plot_timelines needs at least one timeline")
    plt = pyplot("--timeline")
    mib = float(1 << 20)
    base = timelines[0].peak or 1
    fig, ax = plt.subplots(figsize=(10, 6.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    segments = _phase_segments(timelines[0])
    legend: List[str] = []
    for k, tl in enumerate(timelines):
        xs = _aligned_x(tl, segments)
        ys = [p.bytes / mib for p in tl.points]
        c = colours[k % len(colours)]
        i = tl.peak_index
        model = models[k] if models is not None and k < len(models) else None
        where = describe_point(tl.points[i], model)
        ratio = "" if k == 0 else f", {tl.peak / base:.2f}x {timelines[0].label or 'the first'}'s peak"
        legend.append(f"{tl.label or f'config {k}'}: peak {format_bytes(tl.peak)}{ratio}, in the {where}")
        ax.plot(xs, ys, color=c, lw=1.6, label=legend[-1])
        ax.plot([xs[i]], [ys[i]], marker="o", color=c, ms=8, markeredgecolor="black", markeredgewidth=0.6)
    _phase_axis(ax, segments)
    meter = "CUDA allocator" if timelines[0].source == "cuda" else "exact live tensors"
    ax.set_ylabel(f"memory in use above the step's start (MiB, {meter})\nlower is better", fontsize=10)
    ax.set_title(title or "Memory timeline of one training step")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_xlim(0, max(a + b for a, b in segments.values()))
    ax.set_ylim(0, max(p.bytes for tl in timelines for p in tl.points) / mib * 1.08)
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, frameon=False,
              title="one training step, left to right; a dot marks each configuration's peak", title_fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return legend


def _phase_axis(ax: Any, segments: Dict[str, Tuple[float, float]]) -> None:
    """The x axis: one labelled band per phase, alternately shaded, short phases' labels turned."""
    centres, names = [], []
    for j, (phase, (x0, width)) in enumerate(segments.items()):
        if j % 2:
            ax.axvspan(x0, x0 + width, color="0.95", zorder=0, lw=0)
        if j:
            ax.axvline(x0, color="0.75", lw=0.6, zorder=0)
        centres.append(x0 + width / 2)
        names.append(PHASE_NAMES.get(phase, phase))
    ax.set_xticks(centres, names, fontsize=10)
    ax.tick_params(axis="x", length=0)
    for tick, width in zip(ax.get_xticklabels(), (w for _, w in segments.values())):
        if width < 0.06:  # a short phase (loss, zero grad): its label turned, so it does not run into its neighbours
            tick.set_rotation(90)
            tick.set_fontsize(8)


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
