"""Charts for docs/img (matplotlib, headless)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def bar_plot(
    path: str | os.PathLike[str],
    categories: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    title: str,
    ylabel: str,
    ceilings: Sequence[float | None] | None = None,
    ceiling_label: str = "compute ceiling",
    log_y: bool = False,
) -> Path:
    """Grouped bar chart: one group per category, one bar per series.

    ``None`` values leave a gap (backend skipped or failed). ``ceilings`` draws one short
    horizontal line per category (e.g. a compute-bound tokens/s ceiling).
    """
    plt = _pyplot()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_series = max(len(series), 1)
    width = 0.8 / n_series
    fig, ax = plt.subplots(figsize=(max(7.0, 1.0 * len(categories) + 4), 4.5))
    xs = list(range(len(categories)))
    for i, (name, values) in enumerate(series.items()):
        pos = [x - 0.4 + width * (i + 0.5) for x in xs]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(pos, heights, width=width, label=name)
        for bar, v in zip(bars, values, strict=True):
            label = "n/a" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"
            ax.annotate(
                label,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90 if len(categories) * n_series > 16 else 0,
            )
    if ceilings is not None:
        first = True
        for x, c in zip(xs, ceilings, strict=True):
            if c is None:
                continue
            ax.hlines(
                c,
                x - 0.45,
                x + 0.45,
                colors="k",
                linestyles="--",
                linewidth=1,
                label=ceiling_label if first else "_nolegend_",
            )
            first = False
    ax.set_xticks(xs)
    ax.set_xticklabels(categories, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
        tops = [v for vals in series.values() for v in vals if v] + [
            c for c in (ceilings or []) if c
        ]
        if tops:
            ax.set_ylim(top=max(tops) * 3)  # room for the value labels
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, out)


def line_plot(
    path: Path,
    xs: list[int],
    series: dict[str, list[float | None]],
    title: str,
    xlabel: str,
    ylabel: str,
    log_y: bool = True,
) -> Path:
    """One line per series over ``xs`` on a log2 x axis; ``None`` points are left out."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in series.items():
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
