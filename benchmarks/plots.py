"""PNG pictures of live benchmarks' results (``--plot PATH`` on ``openai_burst``, ``migration_skew``, ``planner_shift``
and ``sim_elastic``): CDFs of per-request latencies, a quantity over time per run, side by side in panels. matplotlib
is the optional ``plot`` extra (``make`` installs it; ``simulator.metrics.pyplot`` says how otherwise); a benchmark
asked to plot without it says so and exits 2 after printing its figures.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

import numpy as np

from simulator.metrics import pyplot

logger = logging.getLogger(__name__)


def panels(count: int, title: str, rows: int = 1, width: float = 6.0, height: float = 4.2):
    """``(plt, fig, axes)``: ``rows`` rows of ``count`` panels under ``title`` (Agg backend); ``axes`` row by
    row."""
    plt = pyplot()
    fig, axes = plt.subplots(rows, count, figsize=(width * count, height * rows), squeeze=False)
    fig.suptitle(title)
    return plt, fig, [ax for row in axes for ax in row]


def cdf(ax, series: dict[str, Sequence[float]], xlabel: str, slo: float | None = None, log: bool = False) -> None:
    """One line per label: the fraction of its values at or below x."""
    for label, values in series.items():
        v = np.sort(np.asarray([x for x in values if x is not None], dtype=np.float64))
        if len(v):
            ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{label} (n={len(v)})")
    if slo:
        ax.axvline(slo, color="grey", linestyle="--", label=f"SLO {slo:g}")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def over_time(ax, series: dict[str, tuple[Sequence[float], Sequence[float]]], ylabel: str, steps: bool = False,
              marks: dict[str, Sequence[float]] | None = None) -> None:
    """One line per label through its ``(times, values)``; ``steps``: a step function (a count that changes at
    events); ``marks``: vertical lines at a label's event times (in its line's colour)."""
    for label, (t, y) in series.items():
        line = (ax.step(t, y, where="post", label=label) if steps else ax.plot(t, y, label=label))[0]
        for x in (marks or {}).get(label, ()):
            ax.axvline(x, color=line.get_color(), alpha=0.4, linestyle=":")
    ax.set_xlabel("seconds from the start")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def save(plt, fig, path: str) -> None:
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))   # room for the title
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.warning("wrote %s", path)


def plot_or_exit(draw: Callable[[], None]) -> None:
    """Run ``draw``; without matplotlib, say so on stderr and exit 2 (the figures are printed already)."""
    try:
        draw()
    except RuntimeError as err:
        print(f"--plot: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def cumulative(times: Sequence[float]) -> tuple[list[float], list[int]]:
    """``(sorted times, 1 .. n)``: how many events happened by each time."""
    t = sorted(times)
    return t, list(range(1, len(t) + 1))
