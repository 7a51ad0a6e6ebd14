"""``torchtune-pipe report LOG``: what the tuner decided, and whether training waits on data.

Reads a tuning log (the JSON lines a loader built with ``tuning_log=PATH``, or the Lightning
callback's ``log_path=``, writes one decision per tuning interval) and plots, over time: the
throughput delivered to the consumer in its own unit (batches/s for a loader that batches),
the consumer's step time and the share of it spent waiting for data (one line per rank where
several ranks wrote, to one log or to a log each), the workers of every stage (0 while a
stage runs fused in the workers of the one before) and the buffer budget of every stage, with
a dashed line at every allocation change. The title answers "is my training stalled on data?"
from the median share. A spike does not flatten a panel: its axis is clipped at a high
percentile and the points above are marked at the top edge. Needs ``matplotlib`` (the
``plot`` extra: ``pip install "torchtune-pipe[plot]"``).

Example:
    $ torchtune-pipe report out/tuning.jsonl -o out/tuning.png
    $ torchtune-pipe report out/tuning-rank0.jsonl out/tuning-rank1.jsonl
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtune_pipe.tools.watch import wait_words
from torchtune_pipe.tuning.loop import observation, read_log

MiB = 1 << 20
# A panel's axis ends at CLIP_MARGIN times this percentile of its values when some value
# lies past CLIP_FACTOR times it: one spike (an epoch's first interval, a checkpoint) would
# otherwise squash every other point against the axis.
CLIP_PERCENTILE = 95
CLIP_MARGIN = 1.25
CLIP_FACTOR = 1.5
CLIP_MIN_POINTS = 5

PathLike = str | os.PathLike


@dataclass(frozen=True)
class Report:
    """What :func:`plot` drew.

    Attributes:
        path: the PNG written.
        stages: stage names, in pipeline order (each has a line in the workers and buffer
            panels; also written into the PNG's ``Stages`` text field).
        decisions: tuning decisions plotted (every rank's).
        changes: times (s) of the allocation changes marked.
        unit: what one item the consumer takes is (``batches`` or ``items``).
        ranks: the ranks plotted (``[0]`` for a single process).
        data_wait_share: per rank, the median share of the consumer's time spent waiting for
            data (None: not measured in that log).
        clipped: the panels whose axis was clipped at a spike.
    """

    path: Path
    stages: tuple[str, ...]
    decisions: int
    changes: tuple[float, ...]
    unit: str = "items"
    ranks: tuple[int, ...] = (0,)
    data_wait_share: dict[int, float | None] | None = None
    clipped: tuple[str, ...] = ()


def by_rank(logs: Sequence[PathLike]) -> dict[int, list[dict]]:
    """The decisions of ``logs``, by rank: a record's own ``rank``, else its log's position
    when several logs are given (a log per rank), else 0."""
    ranks: dict[int, list[dict]] = {}
    for i, log in enumerate(logs):
        for r in read_log(log):
            ranks.setdefault(int(r.get("rank", i if len(logs) > 1 else 0)), []).append(r)
    return dict(sorted(ranks.items()))


def timeline(records: Sequence[dict]) -> list[float]:
    """Seconds since the first record, continuous across pipelines: ``t`` is the clock of
    the pipeline that made a record, and each epoch of a loader whose workers do not persist
    starts a new one at 0, so a record whose ``t`` goes back is placed that far after the
    one before it."""
    out: list[float] = []
    prev_t, now = None, 0.0
    for r in records:
        t = float(r.get("t", 0.0))
        if prev_t is not None:
            now += t - prev_t if t >= prev_t else t
        out.append(now)
        prev_t = t
    return out


def running_workers(record: dict) -> list[int]:
    """Workers each stage ran as processes under a record's allocation: 0 for a stage fused
    into the one before (its allocation entry is its target for when it is split again)."""
    alloc = record["allocation"]
    fused = alloc.get("fused") or [s.get("fused", False) for s in record["obs"].get("stages", [])]
    return [0 if i < len(fused) and fused[i] else w for i, w in enumerate(alloc["workers"])]


def clip_top(values: Sequence[float]) -> float | None:
    """Where a panel's axis ends so that one spike does not flatten it (None: it need not)."""
    xs = sorted(v for v in values if math.isfinite(v))
    if len(xs) < CLIP_MIN_POINTS:
        return None
    q = xs[(len(xs) - 1) * CLIP_PERCENTILE // 100]  # the lower one: a spike is not in it
    if q <= 0 or xs[-1] <= CLIP_FACTOR * q:
        return None
    return CLIP_MARGIN * q


def median_share(records: Sequence[dict]) -> float | None:
    """The median share of the consumer's time spent waiting for data over ``records``."""
    xs = sorted(s for r in records if (s := r["obs"].get("data_wait_share")) is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _series(records: Sequence[dict], key: str, scale: float = 1.0) -> list[float]:
    """A field of each record's observation (NaN where not measured: None, or a step of 0)."""
    out = []
    for r in records:
        v = r["obs"].get(key)
        out.append(math.nan if v is None or (key == "consumer_step_s" and v <= 0) else v * scale)
    return out


def _draw(ax: Any, lines: dict[int, tuple[list[float], list[float]]], label: bool) -> bool:
    """Lines per rank on ``ax``, clipped at a spike; True when clipped."""
    top = clip_top([v for _, ys in lines.values() for v in ys])
    for rank, (ts, ys) in lines.items():
        ax.plot(ts, ys, label=f"rank {rank}" if label else None)
        if top is not None:
            over = [(t, top) for t, y in zip(ts, ys, strict=True) if y > top]
            if over:
                ax.plot(*zip(*over, strict=True), linestyle="none", marker="^", color="red",
                        clip_on=False)  # fmt: skip
    ax.set_ylim(bottom=0)
    if top is not None:
        ax.set_ylim(top=top)
        ax.text(0.99, 0.97, "clipped: ^ marks values above", transform=ax.transAxes,
                ha="right", va="top", fontsize="small", color="red")  # fmt: skip
    if label:
        ax.legend(loc="upper left", fontsize="small")
    return top is not None


def plot(log: PathLike | Sequence[PathLike], out: PathLike | None = None) -> Report:
    """Plot a tuning log (or one log per rank) to a PNG.

    Args:
        log: the tuning log (JSON lines), or several (a log per rank).
        out: the PNG to write (default: the (first) log's path with ``.png``).

    Returns:
        A :class:`Report` of what was drawn.

    Raises:
        ValueError: a log holds no decision.
        ModuleNotFoundError: ``matplotlib`` is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "torchtune-pipe report needs matplotlib: pip install 'torchtune-pipe[plot]'"
        ) from e
    logs = [log] if isinstance(log, (str, os.PathLike)) else list(log)
    ranks = by_rank(logs)
    first = next(iter(ranks.values()))
    path = Path(out) if out is not None else Path(logs[0]).with_suffix(".png")
    names = tuple(s.name for s in observation(first[-1]).stages)
    unit = first[-1].get("unit", "items")
    times = {rank: timeline(rs) for rank, rs in ranks.items()}
    # The stages' panels show the first rank: every rank runs the same pipeline.
    ts = times[next(iter(ranks))]
    workers = [running_workers(r) for r in first]
    buffers = [[b / MiB for b in r["allocation"]["buffer_bytes"]] for r in first]
    changes = tuple(
        t
        for t, r, prev in zip(ts[1:], first[1:], first[:-1], strict=True)
        if r.get("applied") and r["allocation"] != prev["allocation"]
    )
    tuner = first[-1].get("tuner", "?")
    shares = {rank: median_share(rs) for rank, rs in ranks.items()}
    several = len(ranks) > 1

    fig = Figure(figsize=(10, 13), layout="constrained")
    FigureCanvasAgg(fig)
    ax_thr, ax_step, ax_wait, ax_w, ax_b = fig.subplots(5, 1, sharex=True)
    clipped = []
    if _draw(ax_thr, {k: (times[k], _series(rs, "throughput")) for k, rs in ranks.items()},
             several):  # fmt: skip
        clipped.append("throughput")
    ax_thr.set_ylabel(f"{unit}/s to the consumer")
    fig.suptitle(_wait_title(shares), fontweight="bold")
    ax_thr.set_title(f"tuner {tuner}: {len(first)} decisions, {len(changes)} changes")
    step = {k: (times[k], _series(rs, "consumer_step_s", 1e3)) for k, rs in ranks.items()}
    if _draw(ax_step, step, several):
        clipped.append("consumer step")
    ax_step.set_ylabel("consumer step (ms)")
    for rank, rs in ranks.items():
        ys = _series(rs, "data_wait_share")
        ax_wait.plot(times[rank], ys, label=f"rank {rank}" if several else None)
        ax_wait.fill_between(times[rank], [0 if math.isnan(y) else y for y in ys], alpha=0.15)
    ax_wait.axhline(0.5, color="red", linestyle=":", linewidth=0.8)
    ax_wait.set_ylim(0, 1)
    ax_wait.set_ylabel("share of each step\nwaiting for data")
    if several:
        ax_wait.legend(loc="upper left", fontsize="small")
    for i, name in enumerate(names):
        ax_w.step(ts, [w[i] for w in workers], where="post", label=name)
        ax_b.step(ts, [b[i] for b in buffers], where="post", label=name)
    ax_w.set_ylabel("workers (0: fused)")
    ax_b.set_ylabel("buffer (MiB)")
    ax_b.set_xlabel("seconds tuned (a loader's epochs end to end)")
    for ax in (ax_thr, ax_step, ax_wait, ax_w, ax_b):
        for t in changes:
            ax.axvline(t, color="grey", linestyle="--", linewidth=0.7)
    ax_w.legend(title="stage", loc="upper left", fontsize="small")
    ax_b.legend(title="stage", loc="upper left", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(
        path,
        dpi=100,
        metadata={
            "Title": f"tuning log {', '.join(os.fspath(x) for x in logs)}",
            "Stages": ",".join(names),
        },
    )
    return Report(path, names, sum(len(rs) for rs in ranks.values()), changes, unit,
                  tuple(ranks), shares, tuple(clipped))  # fmt: skip


def _wait_title(shares: dict[int, float | None]) -> str:
    """The figure's answer to "is my training stalled on data?" (the worst rank's)."""
    known = {k: v for k, v in shares.items() if v is not None}
    if not known:
        return "wait for data not measured"
    rank = max(known, key=lambda k: known[k])
    who = f" (rank {rank}, the most)" if len(shares) > 1 else ""
    return f"training waits for data {wait_words(known[rank])}{who}"


def main(argv: Sequence[str] | None = None) -> int:
    """``torchtune-pipe report LOG [LOG...] [-o PNG]``."""
    p = argparse.ArgumentParser(
        prog="torchtune-pipe report",
        description="Plot a tuning log: throughput, the consumer's step and its wait for "
        "data, workers and buffers per stage over time.",
    )
    p.add_argument("log", nargs="+",
                   help="the tuning log (JSON lines) a loader or the callback wrote; several: "
                   "a log per rank")  # fmt: skip
    p.add_argument("-o", "--out", help="the PNG to write (default: the first LOG with .png)")
    args = p.parse_args(argv)
    try:
        report = plot(args.log, args.out)
    except (OSError, ValueError, ModuleNotFoundError) as e:
        print(f"torchtune-pipe report: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {report.path}: {report.decisions} decisions, {len(report.changes)} allocation "
        f"changes, stages {', '.join(report.stages)}; {_wait_title(report.data_wait_share or {})}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
