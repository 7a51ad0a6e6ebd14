"""The shape choice of a loader that may read inline (``num_workers="auto"``).

The inline phase of a fast start (:mod:`~torchtune_pipe.loader.faststart`) doubles as a
measurement. Rows that cost less than a hop between processes (a few microseconds of CPU) are
faster read in the calling thread than on workers; torch's best setting for them is
``num_workers=0``. Once the tuner has had time to settle the workers, the delivered rate of the
workers is compared, window by window, with the rate the inline reads would give with the
consumer's measured step time. When inline is clearly faster twice in a row, the executor is
closed and the rest of the epoch (and every later one) is read inline; the items the workers
had in flight are read again, and the bookkeeping of what was delivered keeps it exactly once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Shape choice: tuning intervals given to the tuner before the workers are measured, windows
# measured at most, and how much faster inline must be (twice in a row) to be chosen.
SETTLE_INTERVALS = 2
SETTLE_MIN_S = 1.0
WINDOW_MIN_ITEMS = 16
MAX_WINDOWS = 8
INLINE_GAIN = 1.25
# Inline reads that wait (wall time well past their CPU time) cannot overlap their waits in the
# calling thread, while workers and calls in flight can: such reads are never chosen inline.
INLINE_MAX_WAIT_RATIO = 1.5
# Wall time of inline reads below which their waits are not judged: a few reads at a start
# share the interpreter with the threads starting the workers, which reads as waiting.
WAIT_EVIDENCE_S = 0.1


@dataclass
class ShapeProbe:
    """What the shape choice has measured so far; kept by the loader from epoch to epoch (an
    epoch may end before a choice is made, and the next goes on from where it stopped).

    Attributes:
        inline_s: time reading inline units, less the waits for a CPU.
        inline_cpu_s: CPU time of those reads.
        inline_items: items they gave.
        settle_until: ``perf_counter`` time from which the workers are measured (None: they
            have not run yet).
        windows: windows measured; wins: consecutive windows inline won.
        window_s, window_items, window_waited_s: the window being measured (its seconds,
            items and the consumer's waits for the workers), over as many epochs as it takes.
        decided: ``"inline"`` or ``"workers"`` once chosen.
        units_read: units read one at a time (inline, or alone by a kind probe), in
            ``inline_s``.
        alone_s, alone_units: those of them read while no executor was being built or ran
            (a kind probe's, an epoch read inline whole): the reads' own time.
        serving_s: seconds the last executor took to serve, from its build's start (None:
            none has yet).
        workers_s, workers_units: the consumer's wait for its items over the last epoch read
            whole by an executor that was not the loader's first (a warm start), and its units.
    """

    inline_s: float = 0.0
    inline_cpu_s: float = 0.0
    inline_items: int = 0
    units_read: int = 0
    alone_s: float = 0.0
    alone_units: int = 0
    serving_s: float | None = None
    workers_s: float = 0.0
    workers_units: int = 0
    settle_until: float | None = None
    windows: int = 0
    wins: int = 0
    decided: str | None = None
    window_s: float = 0.0
    window_items: int = 0
    window_waited_s: float = 0.0

    def inline_sooner(self, units: int) -> bool:
        """Whether ``units`` read inline one at a time, each as long as those read alone so
        far on average, take less than the workers would: an executor as quick to serve as the
        last one would serve after them (its workers would read none), or the last warm epoch
        on workers had the consumer wait longer per unit (its fork, build, start and close
        included). False until measured. Reads beside a build are not the measure: the
        build's forks and interpreter time slow them 2-8x."""
        if not self.alone_units:
            return False
        inline_s = units * self.alone_s / self.alone_units
        if self.serving_s is not None and inline_s < self.serving_s:
            return True
        return self.workers_units > 0 and inline_s < units * self.workers_s / self.workers_units


def measured(
    run: Iterator[tuple],
    p: ShapeProbe,
    interval_s: float,
    may_go_inline: Callable[[], bool],
    on_inline: Callable[[str], None],
) -> Iterator[tuple]:
    """The executor's stream ``run``, timed window by window (``interval_s`` long) until a
    shape is chosen (in ``p``); ends early, closing ``run``, when inline is chosen and
    ``may_go_inline()``, after ``on_inline(why)``."""
    in_s_per_item = p.inline_s / p.inline_items
    # A window goes on from epoch to epoch (an epoch shorter than a window would never
    # complete one): this epoch's part of it runs from its first measured item.
    seg_start: float | None = None
    base_s = 0.0
    while True:
        t0 = time.perf_counter()
        try:
            t = next(run)
        except StopIteration:
            return
        now = time.perf_counter()
        if p.decided is None and p.settle_until is not None and now >= p.settle_until:
            if seg_start is None:
                seg_start, base_s = t0, p.window_s
            p.window_waited_s += now - t0  # waiting for the workers; the rest: the consumer
            p.window_items += t[1] >= 0
            p.window_s = span = base_s + (now - seg_start)
            items, waited_s = p.window_items, p.window_waited_s
            if span >= interval_s and items >= WINDOW_MIN_ITEMS:
                consumer_s = max(0.0, span - waited_s)
                workers_rate = items / span
                inline_rate = items / (consumer_s + items * in_s_per_item)
                p.windows += 1
                p.wins = p.wins + 1 if inline_rate > INLINE_GAIN * workers_rate else 0
                log.debug("shape: workers %.1f items/s, inline %.1f", workers_rate, inline_rate)
                if p.wins >= 2 and may_go_inline():
                    yield t
                    p.decided = "inline"
                    # The tuner stops before the executor closes (a tick must not observe
                    # a closed executor); what the workers had in flight is read again.
                    on_inline(
                        f"inline reads ({inline_rate:.0f} items/s with the consumer's "
                        f"{consumer_s / items * 1e3:.2f} ms per item) beat the workers "
                        f"({workers_rate:.0f} items/s)"
                    )
                    run.close()
                    return
                if inline_rate * INLINE_GAIN < workers_rate or p.windows >= MAX_WINDOWS:
                    p.decided = "workers"  # faster, or as fast: keep them
                seg_start, p.window_s, p.window_items, p.window_waited_s = None, 0.0, 0, 0.0
        yield t


__all__ = [
    "INLINE_GAIN", "INLINE_MAX_WAIT_RATIO", "SETTLE_INTERVALS", "SETTLE_MIN_S", "ShapeProbe",
    "WAIT_EVIDENCE_S", "measured",
]  # fmt: skip
