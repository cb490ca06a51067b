"""The (peak, time) plane drawn: every point, the frontier joined, the time-budget choice ringed."""
from __future__ import annotations

from typing import Sequence

from convbn.bench.frontier import FrontierPoint
from convbn.bench.plotting import pyplot

__all__ = ["plot_frontier"]


def plot_frontier(points: Sequence[FrontierPoint], path: str, title: str = "") -> str:
    """Draw ``points`` as step peak (MiB) against step time (ms) into ``path`` (PNG); the
    frontier's points joined by a line, compiled configurations as squares. Needs matplotlib
    (the ``[plot]`` extra); returns ``path``."""
    plt = pyplot("the frontier plot", " (leave out --plot for a table)")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for p in points:
        if p.peak != p.peak or p.time != p.time:
            continue
        marker = "s" if "compile" in p.name else "o"
        color = "tab:red" if p.on_frontier else "tab:gray"
        ax.scatter(p.time * 1e3, p.peak / 2**20, marker=marker, color=color, zorder=3)
        ax.annotate(p.name, (p.time * 1e3, p.peak / 2**20), fontsize=7, xytext=(4, 3), textcoords="offset points")
        if p.chosen:
            ax.scatter(p.time * 1e3, p.peak / 2**20, s=220, facecolors="none", edgecolors="tab:blue", zorder=4)
    front = sorted((p for p in points if p.on_frontier), key=lambda p: p.peak)
    ax.step([p.time * 1e3 for p in front], [p.peak / 2**20 for p in front], where="post", color="tab:red",
            alpha=0.6, label="frontier (no point lower on both)")
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("step peak (MiB)")
    ax.set_title(title or "training step: peak against time")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
