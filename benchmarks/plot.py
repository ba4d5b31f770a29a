"""The plot of a results file: speedup and step compression per method."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from figures import noisy_rows


def render_plot(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str],
                title: str | None = None) -> Path:
    """Bar charts: per (model, dtype, batch size) one row of two panels,
    speedup over vanilla and step compression S, methods on the x axis and
    one bar per dataset. Errors leave their bar out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # --repeat: the overall rows (the pass rows are in the table and JSON)
    rows = [r for r in rows if not r.get("pass")]
    panels: dict[tuple, list[dict]] = {}
    for row in rows:
        panels.setdefault((row.get("model"), row.get("dtype"), row.get("batch_size")), []).append(row)
    if not panels:
        panels[("no results", "", "")] = []
    noisy = noisy_rows(rows)
    if noisy:
        title = (title + "\n" if title else "") + (
            "hatched speedup bars: timed while other processes kept the CPU busy (unreliable)")
    n = len(panels)
    fig, axes = plt.subplots(n, 2, figsize=(13, 3.4 * n + 0.8), squeeze=False)
    for (model, dtype, bs), axrow in zip(panels, axes):
        members = panels[(model, dtype, bs)]
        methods = list(dict.fromkeys(r.get("method") for r in members))
        datasets = list(dict.fromkeys(r.get("dataset") for r in members))
        width = 0.8 / max(1, len(datasets))
        for ax, key, ylabel in ((axrow[0], "ratio", "speedup vs vanilla (tok/s ratio)"),
                                (axrow[1], "step_compression", "step compression S")):
            for j, ds in enumerate(datasets):
                xs, ys, hatches = [], [], []
                for i, m in enumerate(methods):
                    row = next((r for r in members if r.get("method") == m
                                and r.get("dataset") == ds), None)
                    value = None if row is None or row.get("error") else row.get(key)
                    if value is not None and math.isfinite(value):
                        xs.append(i - 0.4 + width * (j + 0.5))
                        ys.append(value)
                        hatches.append("//" if key == "ratio" and row in noisy else None)
                bars = ax.bar(xs, ys, width, label=ds, color=f"C{j}")
                for bar, hatch in zip(bars, hatches):
                    bar.set_hatch(hatch)
                ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xticks(range(len(methods)))
            ax.set_xticklabels(methods, rotation=20, ha="right", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=9)
            ax.set_title(f"{model} {dtype}, batch size {bs}", fontsize=10)
            ax.margins(y=0.15)
            if datasets:
                ax.legend(fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
