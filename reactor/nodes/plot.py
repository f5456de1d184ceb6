"""Learning curves of a run directory (``reactor plot RUN_DIR``)."""

from __future__ import annotations

import csv
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._files import open_regular, read_small_json, replacing

__all__ = ["NoReturnsError", "curves", "plot_run"]


class NoReturnsError(ValueError):
    """metrics.csv holds no return to plot: its run ended (or is) before any episode or evaluation ended.
    Metrics says so at a run's end without pointing at ``reactor plot``, which cannot draw it either."""


#: What the x axis can show: the column of metrics.csv and its label.
X_AXES = {"env_steps": ("env_steps", "env steps"), "wall": ("wall_s", "wall time (s)")}


def plot_run(run_dir: str | Path, out: str | Path | None = None, *, x: str = "env_steps",
             target: Any = "summary") -> Path:
    """Write a PNG of a run's learning curves: evaluation and training return against env steps
    (or wall time), with the target return marked.

    Args:
        run_dir: a directory written by the Metrics node (it reads ``metrics.csv``).
        out: the PNG's path (default ``RUN_DIR/curves.png``; without a suffix, ``.png`` is added; another
            suffix matplotlib writes, ``.svg`` or ``.pdf``, chooses that format).
        x: ``"env_steps"`` or ``"wall"`` (seconds since training started).
        target: the return to mark with a line (None: none; default: the run's ``target_return``
            from its ``summary.json``, when it has one).

    Returns:
        The path of the file written.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.csv``, or ``out``'s directory does not exist.
        IsADirectoryError: ``out`` is a directory.
        ValueError: the CSV holds no return values to plot, ``x`` is not one of :data:`X_AXES`, or ``out``'s
            suffix is not a format matplotlib writes.
    """
    fig = curves(run_dir, x=x, target=target)
    import matplotlib.pyplot as plt

    try:
        out = Path(out) if out is not None else Path(run_dir) / "curves.png"
        # What savefig did with an ``out`` it cannot take: a missing directory or no permission was a
        # traceback from PIL ("the run failed"); a path without a suffix (or a directory's) got ".png"
        # added, and the path printed was not the file written.
        if out.is_dir():
            raise IsADirectoryError(f"{out} is a directory: name the image file to write (e.g. {out / 'curves.png'})")
        if not out.suffix:
            out = out.with_suffix(".png")
        formats = fig.canvas.get_supported_filetypes()
        if out.suffix[1:].lower() not in formats:
            raise ValueError(f"{out}: matplotlib writes no {out.suffix!r} files; name a .png (or {', '.join(sorted(formats))})")
        if not out.parent.is_dir():
            raise FileNotFoundError(f"{out}: its directory {out.parent} does not exist")
        try:
            with replacing(out) as f:  # (whole or not at all: a full disk left a 0-byte curves.png)
                fig.savefig(f, format=out.suffix[1:].lower(), dpi=100)
        except OSError as e:  # (no permission, a full disk: said as reactor's, in one line)
            raise type(e)(e.errno, f"cannot write {out}: {e.strerror}") if e.errno else type(e)(f"cannot write {out}: {e}") from None
    finally:
        plt.close(fig)
    return out


def curves(run_dir: str | Path, *, x: str = "env_steps", target: Any = "summary") -> Any:
    """The matplotlib Figure :func:`plot_run` writes (see there)."""
    if x not in X_AXES:
        raise ValueError(f"x must be one of {', '.join(X_AXES)}, got {x!r}")
    column, xlabel = X_AXES[x]
    run_dir = Path(run_dir)
    if isinstance(target, str) and target == "summary":
        target = _summary_target(run_dir)
    path = run_dir / "metrics.csv"
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory at {str(run_dir)!r}")
    if not path.is_file():
        if (run_dir / "run.json").is_file():  # (a run's directory, made as it starts: "is it one?" misled)
            raise FileNotFoundError(f"{run_dir} has no metrics.csv yet: its run (run.json) has not started its "
                                    f"metrics; plot it again in a moment")
        raise FileNotFoundError(f"{run_dir} has no metrics.csv: is it a run directory written by a training app?")
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    # A file of another shape, a value that is not a number or bytes that are not text is one line
    # naming the file and the line (it was a KeyError or ValueError traceback, or a line naming nothing).
    with os.fdopen(open_regular(path), newline="", encoding="utf-8") as f:
        try:
            reader = csv.DictReader(_bounded_lines(f, path))
            if reader.fieldnames is None:
                raise ValueError(f"{path} is empty: no values to plot")
            missing = [c for c in ("name", "source", "value", column) if c not in reader.fieldnames]
            if missing:
                raise ValueError(f"{path}: its header {reader.fieldnames} lacks the column(s) {missing}: not a "
                                 f"metrics.csv of the Metrics node")
            for row in reader:
                if row["name"] in ("eval_return", "episode_return"):
                    label = "evaluation" if row["name"] == "eval_return" else f"training ({row['source']})"
                    try:
                        series[label].append((float(row[column]), float(row["value"])))
                    except (TypeError, ValueError):  # (a short row leaves None)
                        raise ValueError(f"{path}, line {reader.line_num}: {column} {row[column]!r} and value "
                                         f"{row['value']!r} are not both numbers") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text: not a metrics.csv of the Metrics node") from None
        except csv.Error as e:
            raise ValueError(f"{path}: not a CSV file ({e})") from None
    if not series:
        raise NoReturnsError(f"{path} holds no eval_return or episode_return values to plot")
    return _figure(series, xlabel, run_dir.name, target)


#: The longest line read from metrics.csv (its rows are ~60 characters; a file's line is read whole
#: before the csv module's field limit applies, so a line of hundreds of MB was that much memory).
MAX_LINE_CHARS = 64 * 1024


def _bounded_lines(f: Any, path: Path) -> Iterator[str]:
    """``f``'s lines, each at most :data:`MAX_LINE_CHARS` characters (``ValueError`` naming the line)."""
    n = 0
    while line := f.readline(MAX_LINE_CHARS + 1):
        n += 1
        if len(line) > MAX_LINE_CHARS:
            raise ValueError(f"{path}, line {n}: longer than {MAX_LINE_CHARS} characters: not a metrics.csv of "
                             f"the Metrics node")
        yield line


def _summary_target(run_dir: Path) -> float | None:
    """The run's target return from its summary.json (None: none, or no summary yet)."""
    try:  # (a regular file only: a FIFO there hung the plot)
        value = read_small_json(run_dir / "summary.json").get("target_return")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _figure(series: dict[str, list[tuple[float, float]]], xlabel: str, title: str, target: float | None) -> Any:
    """The curves' matplotlib Figure (evaluation first and bold, then each actor's training return)."""
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
    if target is not None:
        ax.axhline(float(target), color="tab:green", ls="--", lw=1.2, label=f"target {float(target):g}", zorder=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("episode return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig
