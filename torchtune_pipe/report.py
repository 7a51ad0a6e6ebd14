"""``torchtune-pipe report LOG``: what the tuner decided, as a picture.

Reads a tuning log (the JSON lines a loader built with ``tuning_log=PATH``, or the Lightning
callback's ``log_path=``, writes one decision per tuning interval) and plots, over time:
the throughput delivered to the consumer, the workers of every stage and the buffer budget of
every stage, with a dashed line at every allocation change. Needs ``matplotlib`` (the
``plot`` extra: ``pip install "torchtune-pipe[plot]"``).

Example:
    $ torchtune-pipe report out/tuning.jsonl -o out/tuning.png
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .tuning.loop import observation, read_log

MiB = 1 << 20


@dataclass(frozen=True)
class Report:
    """What :func:`plot` drew.

    Attributes:
        path: the PNG written.
        stages: stage names, in pipeline order (each has a line in the workers and buffer
            panels; also written into the PNG's ``Stages`` text field).
        decisions: tuning decisions plotted.
        changes: times (s) of the allocation changes marked.
    """

    path: Path
    stages: tuple[str, ...]
    decisions: int
    changes: tuple[float, ...]


def plot(log: str | os.PathLike, out: str | os.PathLike | None = None) -> Report:
    """Plot a tuning log to a PNG.

    Args:
        log: the tuning log (JSON lines).
        out: the PNG to write (default: the log's path with ``.png``).

    Returns:
        A :class:`Report` of what was drawn.

    Raises:
        ValueError: the log holds no decision.
        ModuleNotFoundError: ``matplotlib`` is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "torchtune-pipe report needs matplotlib: pip install 'torchtune-pipe[plot]'"
        ) from e
    records = read_log(log)
    path = Path(out) if out is not None else Path(log).with_suffix(".png")
    names = tuple(s.name for s in observation(records[-1]).stages)
    # "t" is the pipeline's clock (continuous across epochs); "wall_s" restarts with every loop.
    t0 = records[0].get("t", 0.0)
    times = [r.get("t", 0.0) - t0 for r in records]
    workers = [r["allocation"]["workers"] for r in records]
    buffers = [[b / MiB for b in r["allocation"]["buffer_bytes"]] for r in records]
    changes = tuple(
        t
        for t, r, prev in zip(times[1:], records[1:], records[:-1], strict=True)
        if r.get("applied") and r["allocation"] != prev["allocation"]
    )
    tuner = records[-1].get("tuner", "?")

    fig = Figure(figsize=(10, 8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_thr, ax_w, ax_b = fig.subplots(3, 1, sharex=True)
    ax_thr.plot(times, [r["obs"]["throughput"] for r in records], color="black")
    ax_thr.set_ylabel("items/s to the consumer")
    ax_thr.set_title(f"tuner {tuner}: {len(records)} decisions, {len(changes)} changes")
    for i, name in enumerate(names):
        ax_w.step(times, [w[i] for w in workers], where="post", label=name)
        ax_b.step(times, [b[i] for b in buffers], where="post", label=name)
    ax_w.set_ylabel("workers")
    ax_b.set_ylabel("buffer (MiB)")
    ax_b.set_xlabel("seconds since tuning started")
    for ax in (ax_thr, ax_w, ax_b):
        for t in changes:
            ax.axvline(t, color="grey", linestyle="--", linewidth=0.7)
    ax_w.legend(title="stage", loc="upper left", fontsize="small")
    ax_b.legend(title="stage", loc="upper left", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(
        path, dpi=100, metadata={"Title": f"tuning log {os.fspath(log)}", "Stages": ",".join(names)}
    )
    return Report(path, names, len(records), changes)


def main(argv: Sequence[str] | None = None) -> int:
    """``torchtune-pipe report LOG [-o PNG]``."""
    p = argparse.ArgumentParser(
        prog="torchtune-pipe report",
        description="Plot a tuning log: throughput, workers and buffers per stage over time.",
    )
    p.add_argument("log", help="the tuning log (JSON lines) a loader or the callback wrote")
    p.add_argument("-o", "--out", help="the PNG to write (default: LOG with .png)")
    args = p.parse_args(argv)
    try:
        report = plot(args.log, args.out)
    except (OSError, ValueError, ModuleNotFoundError) as e:
        print(f"torchtune-pipe report: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {report.path}: {report.decisions} decisions, {len(report.changes)} allocation "
        f"changes, stages {', '.join(report.stages)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
