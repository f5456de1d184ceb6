"""Learning curves of a run directory (``reactor plot RUN_DIR``)."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

__all__ = ["plot_run"]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write a PNG of a run's learning curves: evaluation and training return against env steps.

    Args:
        run_dir: a directory written by the Metrics node (it reads ``metrics.csv``).
        out: the PNG's path (default ``RUN_DIR/curves.png``).

    Returns:
        The path of the PNG.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.csv``.
        ValueError: the CSV holds no return values to plot.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.csv: is it a run directory written by a training app?")
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["name"] in ("eval_return", "episode_return"):
                label = "evaluation" if row["name"] == "eval_return" else f"training ({row['source']})"
                series[label].append((float(row["env_steps"]), float(row["value"])))
    if not series:
        raise ValueError(f"{path} holds no eval_return or episode_return values to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label in sorted(series, key=lambda s: (s != "evaluation", s)):
        xs, ys = zip(*series[label])
        if label == "evaluation":
            ax.plot(xs, ys, "o-", color="black", lw=2, label=label, zorder=3)
        else:
            ax.plot(xs, ys, lw=1, alpha=0.6, label=label)
    ax.set_xlabel("env steps")
    ax.set_ylabel("episode return")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
