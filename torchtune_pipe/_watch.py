"""A live per-stage table of a running pipeline (rich), for ``Loader(progress=True)`` and the
``torchtune-pipe watch`` command."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .tuning.base import Observation

MiB = 1 << 20


def render(obs: Observation, title: str = "torchtune_pipe") -> Any:
    """A ``rich`` table of one observation: a row per stage, machine facts in the caption."""
    from rich.table import Table

    table = Table(title=title, caption=_caption(obs))
    for col in ("stage", "workers", "items/s", "busy", "wait in", "wait out", "buffer", "fill"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in obs.stages:
        table.add_row(
            s.name,
            f"{s.workers} [{s.min_workers}..{s.max_workers}]",
            f"{s.items_per_s:,.0f}",
            f"{s.busy:.0%}",
            f"{s.blocked_in:.0%}",
            f"{s.blocked_out:.0%}",
            f"{s.buffer_bytes / MiB:,.1f} MiB",
            f"{s.buffer_fill:.0%}",
        )
    return table


def _caption(obs: Observation) -> str:
    parts = [
        f"{obs.throughput:,.0f} items/s to the consumer",
        f"consumer step {obs.consumer_step_s * 1e3:.1f} ms",
        f"{obs.cpus:g} CPUs",
        f"buffers {obs.memory_used_bytes / MiB:,.1f}/{obs.memory_limit_bytes / MiB:,.0f} MiB",
    ]
    if obs.dram_gbps:
        parts.append(f"DRAM {obs.dram_gbps:.1f} GB/s")
    if obs.cpu_ghz:
        parts.append(f"{obs.cpu_ghz:.2f} GHz")
    return " | ".join(parts)


def watch(
    observe: Callable[[], Observation | None],
    *,
    interval_s: float = 1.0,
    stop: threading.Event | None = None,
    console: Any = None,
    title: str = "torchtune_pipe",
) -> int:
    """Show a live table, refreshed every ``interval_s``, until ``stop`` is set (or Ctrl-C).

    Args:
        observe: returns the next observation (e.g. a Tunable's ``observe``, or
            ``loader.observe``); None skips a refresh.
        interval_s: seconds between refreshes.
        stop: ends the display when set (None: runs until interrupted).
        console: a ``rich.console.Console`` (default: stderr).
        title: the table's title.

    Returns:
        The number of refreshes shown.
    """
    from rich.console import Console
    from rich.live import Live

    stop = stop or threading.Event()
    console = console or Console(stderr=True)
    shown = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while not stop.wait(interval_s):  # a periodic refresh, woken at once by stop
                obs = observe()
                if obs is None:
                    continue
                live.update(render(obs, title), refresh=True)
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
    ):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=watch,
            args=(observe,),
            kwargs={"interval_s": interval_s, "stop": self._stop, "console": console},
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
