"""See a pipeline's stages live: ``Loader(progress=True)`` in the training process, or
``torchtune-pipe watch LOG`` (``python -m torchtune_pipe.tools.watch LOG``) from another terminal.

A row per stage: workers (and the tuner's bounds; 0 for a stage fused into the one before,
whose workers run it), items/s, busy and waiting shares, buffer budget and fill; the caption
holds the throughput to the consumer in its own unit (batches/s for a loader that batches),
the consumer's step time and the share of it spent waiting for data (is training stalled on
data?), CPUs and memory. With ``rich`` installed the table is redrawn in place; without it the
same figures are printed as plain text.

``watch`` follows a tuning log, the JSON lines that a loader built with ``tuning_log=PATH``
(or the Lightning callback's ``log_path=``) appends one decision to per tuning interval.

Example:
    $ torchtune-pipe watch out/tuning.jsonl           # live, until Ctrl-C
    $ torchtune-pipe watch out/tuning.jsonl --once    # the latest decision, then exit
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from torchtune_pipe.tuning.base import Observation
from torchtune_pipe.tuning.loop import observation, read_log

MiB = 1 << 20
# A consumer waiting at least this share of its time is stalled on data; at most this one,
# the pipeline keeps up (a few percent is the hand-over of each batch).
STALLED_SHARE = 0.5
KEEPS_UP_SHARE = 0.05
_COLUMNS = ("stage", "workers", "items/s", "busy", "wait in", "wait out", "buffer", "fill")


def has_rich() -> bool:
    """True when ``rich`` can be imported (the live table; plain text otherwise)."""
    return importlib.util.find_spec("rich") is not None


def rows(obs: Observation) -> list[tuple[str, ...]]:
    """The table's cells, one tuple per stage, in the order of its columns. A fused stage
    runs no workers of its own: 0, and which stage's workers run it."""
    return [
        (
            s.name,
            _workers(obs, i),
            f"{s.items_per_s:,.0f}",
            f"{s.busy:.0%}",
            f"{s.blocked_in:.0%}",
            f"{s.blocked_out:.0%}",
            f"{s.buffer_bytes / MiB:,.1f} MiB",
            f"{s.buffer_fill:.0%}",
        )
        for i, s in enumerate(obs.stages)
    ]


def _workers(obs: Observation, i: int) -> str:
    s = obs.stages[i]
    bounds = f"[{s.min_workers}..{s.max_workers}]"
    if not s.fused:
        return f"{s.workers} {bounds}"
    host = i
    while host > 0 and obs.stages[host].fused:
        host -= 1
    return f"0 {bounds} fused in {obs.stages[host].name}"


def render(obs: Observation, title: str = "torchtune_pipe", unit: str = "items") -> Any:
    """A ``rich`` table of one observation: a row per stage, machine facts in the caption
    (``unit``: what one item the consumer takes is)."""
    from rich.table import Table

    table = Table(title=title, caption=caption(obs, unit))
    for col in _COLUMNS:
        table.add_column(col, justify="left" if col == "stage" else "right")
    for row in rows(obs):
        table.add_row(*row)
    return table


def render_text(obs: Observation, title: str = "torchtune_pipe", unit: str = "items") -> str:
    """The same table as plain text (no ``rich`` needed)."""
    cells = [_COLUMNS, *rows(obs)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]
    lines = [f"{title} @ {obs.t:.1f} s"]
    for r in cells:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    lines.append(caption(obs, unit))
    return "\n".join(lines)


def caption(obs: Observation, unit: str = "items") -> str:
    """Throughput in the consumer's ``unit``, its step and the share of its time spent
    waiting for data, CPUs (and the consumer process's own use of them), the pipeline's
    memory and its limit (and DRAM, clock where measured)."""
    parts = [
        f"{obs.throughput:,.0f} {unit}/s to the consumer",
        f"consumer step {obs.consumer_step_s * 1e3:.1f} ms",
        f"waits for data {wait_words(obs.data_wait_share)}",
        f"{obs.cpus:g} CPUs ({obs.consumer_cpus:.2f} used by the consumer)",
        f"memory {obs.memory_used_bytes / MiB:,.1f}/{obs.memory_limit_bytes / MiB:,.0f} MiB",
    ]
    if obs.dram_gbps:
        parts.append(f"DRAM {obs.dram_gbps:.1f} GB/s")
    if obs.cpu_ghz:
        parts.append(f"{obs.cpu_ghz:.2f} GHz")
    return " | ".join(parts)


def wait_words(share: float | None) -> str:
    """The consumer's wait for data in words: its share of the time, and what that means."""
    if share is None:
        return "(not measured)"
    if share >= STALLED_SHARE:
        return f"{share:.0%} of the time: stalled on data"
    if share <= KEEPS_UP_SHARE:
        return f"{share:.0%} of the time: data keeps up"
    return f"{share:.0%} of the time"


def watch(
    observe: Callable[[], Observation | None],
    *,
    interval_s: float = 1.0,
    stop: threading.Event | None = None,
    console: Any = None,
    title: str = "torchtune_pipe",
    plain: bool | None = None,
    out: IO[str] | None = None,
    unit: str | Callable[[], str] = "items",
) -> int:
    """Show a live table, refreshed every ``interval_s``, until ``stop`` is set (or Ctrl-C).

    Args:
        observe: returns the next observation (e.g. a Tunable's ``observe``, or
            ``loader.observe``); None skips a refresh.
        interval_s: seconds between refreshes.
        stop: ends the display when set (None: runs until interrupted).
        console: a ``rich.console.Console`` (default: stderr).
        title: the table's title.
        plain: print plain text instead of a ``rich`` table (None: when ``rich`` is missing).
        out: where plain text goes (default: stderr).
        unit: what one item the consumer takes is (or a function saying it at each refresh).

    Returns:
        The number of refreshes shown.
    """
    stop = stop or threading.Event()
    if plain is None:
        plain = not has_rich()
    unit_now = unit if callable(unit) else lambda: unit
    if plain:
        return _watch_plain(observe, interval_s, stop, title, out or sys.stderr, unit_now)
    from rich.console import Console
    from rich.live import Live

    console = console or Console(stderr=True)
    shown = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while not stop.wait(interval_s):  # a periodic refresh, woken at once by stop
                obs = observe()
                if obs is None:
                    continue
                live.update(render(obs, title, unit_now()), refresh=True)
                shown += 1
        except KeyboardInterrupt:
            pass
    return shown


def _watch_plain(
    observe: Callable[[], Observation | None],
    interval_s: float,
    stop: threading.Event,
    title: str,
    out: IO[str],
    unit: Callable[[], str],
) -> int:
    shown = 0
    try:
        while not stop.wait(interval_s):
            obs = observe()
            if obs is None:
                continue
            print(render_text(obs, title, unit()), file=out, end="\n\n", flush=True)
            shown += 1
    except KeyboardInterrupt:
        pass
    return shown


class Watcher:
    """Runs :func:`watch` on a daemon thread; :meth:`stop` ends it."""

    def __init__(
        self,
        observe: Callable[[], Observation | None],
        interval_s: float = 1.0,
        console: Any = None,
        unit: str = "items",
    ):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=watch,
            args=(observe,),
            kwargs={
                "interval_s": interval_s,
                "stop": self._stop,
                "console": console,
                "unit": unit,
            },
            name="ttp-watch",
            daemon=True,
        )

    def start(self) -> Watcher:
        """Start the display thread. Returns self."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the display and join its thread."""
        self._stop.set()
        self._thread.join(timeout_s)


class LogFollower:
    """The newest observation of a tuning log that is still being written.

    Each call reads the lines appended since the last one (a line cut short is read again
    once complete) and returns the newest decision's observation, or None when none came;
    :attr:`unit` is what its consumer takes (the log's ``unit``, "items" in older logs).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self.unit = "items"
        self._offset = 0

    def __call__(self) -> Observation | None:
        try:
            f = open(self.path, encoding="utf-8")
        except FileNotFoundError:
            return None  # the loader has not started tuning yet
        with f:
            f.seek(self._offset)
            newest = None
            for line in _complete_lines(f):
                self._offset += len(line.encode("utf-8"))
                newest = line
        if newest is None:
            return None
        try:
            record = _decision(newest)
        except ValueError:
            return None
        self.unit = record.get("unit", "items")
        return observation(record)


def _complete_lines(f: IO[str]) -> Iterator[str]:
    for line in f:
        if not line.endswith("\n"):
            return
        yield line


def _decision(line: str) -> dict:
    import json

    record = json.loads(line)
    if not isinstance(record, dict) or "obs" not in record:
        raise ValueError("not a decision")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """``torchtune-pipe watch LOG``: follow a tuning log and show its stages live."""
    p = argparse.ArgumentParser(
        prog="torchtune-pipe watch",
        description="Show a running loader's stages live, from its tuning log (tuning_log=).",
    )
    p.add_argument("log", help="the tuning log (JSON lines) a loader or the callback writes")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="show the latest decision and exit")
    p.add_argument("--plain", action="store_true", help="plain text even when rich is installed")
    args = p.parse_args(argv)
    title = f"torchtune_pipe: {args.log}"
    if args.once:
        try:
            record = read_log(args.log)[-1]
        except (OSError, ValueError) as e:
            print(f"torchtune-pipe watch: {e}", file=sys.stderr)
            return 2
        obs, unit = observation(record), record.get("unit", "items")
        if args.plain or not has_rich():
            print(render_text(obs, title, unit))
        else:
            from rich.console import Console

            Console().print(render(obs, title, unit))
        return 0
    print(f"following {args.log} (Ctrl-C to stop)", file=sys.stderr)
    follow = LogFollower(args.log)
    watch(follow, interval_s=args.interval_s, title=title, plain=args.plain or None,
          unit=lambda: follow.unit)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
