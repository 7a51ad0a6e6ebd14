"""Units read side by side in one source worker: calls in flight across unit boundaries.

A source worker at concurrency ``c`` runs a unit's calls ``c`` at a time on its threads
(:mod:`multiproc.concurrency`). A unit holds only so many calls (a map-style dataset's unit is
one batch: its samples), so a worker whose concurrency is above a unit's calls would still
wait one call's latency per unit, and keeping more reads in flight would cost another process.
Here the worker reads the next units it already holds (the executor sends a worker up to
``ExecutorSpec.credits`` of them) on threads of its own while it frames, runs the fused stages
over and commits the unit before them: ``ceil(c / calls per unit)`` units being read at once,
so that a worker's calls in flight are what its concurrency says, as the simulator models it.
A unit whose reads are done no longer counts while it waits for its commit (a fused collate,
say): the next unit starts reading then, not after the commit (two workers of remote reads of
4 ms with a 2 ms collate fused: 10.5k -> 17k rows/s).

Units are still committed one at a time, in the order they came, each exactly as if it had
been read alone (the same items, frames, skips and errors). The source decides whether its
units may be read side by side: the stage function's ``calls_per_unit(unit)`` says how many
calls one unit runs at once, or None when its units must be read one at a time (a map-style
dataset whose ``__getitem__`` draws from the global random generators, say).
"""

from __future__ import annotations

import collections
import contextvars
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import concurrency, intraop, stats
from . import protocol as P
from .link import Link
from .poller import Poller

_ns = time.perf_counter_ns
_cpu_ns = time.thread_time_ns
_mono_ns = time.monotonic_ns  # the clock of stats.IN_FN_SINCE_NS

# Units one worker reads at once, at most (each has a thread; the executor's credits bound it
# too).
MAX_UNITS = 8
# Start the next unit once the one before is read, while it is committed (False: after it is
# committed, the rule before; ``benchmarks/readahead.py`` runs both side by side).
READ_DURING_COMMIT = True


class _UnitCalls:
    """The worker's call pool as one unit's reading thread sees it: its bookkeeping marks
    (:func:`multiproc.concurrency.not_an_item`) are counted per unit, the rest is the pool's."""

    def __init__(self, pool: concurrency.CallPool):
        self._pool = pool
        self.not_items = 0

    def add_not_items(self, n: int) -> None:
        self.not_items += n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class Read:
    """One unit being read: what the worker got (``unit_id``, ``unit``, ``skip_frames``), the
    items read so far with the marks said before each, and the exception that ended the read."""

    __slots__ = ("unit_id", "unit", "skip_frames", "items", "error", "done")

    def __init__(self, unit_id: Any, unit: Any, skip_frames: int):
        self.unit_id = unit_id
        self.unit = unit
        self.skip_frames = skip_frames
        self.items: list[tuple[int, Any]] = []
        self.error: Exception | None = None
        self.done = False


# Commits one unit read: (unit_id, unit, skip_frames, its items, units read at once).
Commit = Callable[[Any, Any, int, Iterator[Any], int], None]


class ReadAhead:
    """Reads a source worker's units on threads of their own and commits them in order (see
    the module docstring).

    Args:
        pool: the worker's call pool: its width is the worker's concurrency, and the CPU time
            of the reading threads is added to it.
        link: the worker's pipe to the router: the units it holds wait in ``deferred``.
        cell: the worker's counter row as a memoryview (what it works on, since when).
        on_control: handles a message that needs no stage work while units are read; False
            for one that must wait its turn.
        commit: frames and commits a unit read, as if it had been read alone.
        count_time: counts the wall and CPU time since ``(t0, c0)`` as the stage's.
    """

    def __init__(
        self,
        pool: concurrency.CallPool,
        link: Link,
        cell: memoryview,
        on_control: Callable[[Any], bool],
        commit: Commit,
        count_time: Callable[[int, int], None],
    ) -> None:
        self.pool = pool
        self.link = link
        self.cell = cell
        self.on_control = on_control
        self.commit = commit
        self.count_time = count_time
        self._threads: ThreadPoolExecutor | None = None
        self._started: list[threading.Thread] = []  # the pool's threads (joined at close)
        self._closing = False  # reads stop after their current item
        self._wake: tuple[int, int] | None = None  # a pipe a finished read writes a byte to
        self._wake_lock = threading.Lock()  # no write to the pipe once close() closed it
        self._poller = Poller()

    def run_units(self, fn: Callable[[Any], Iterator[Any]], unit_id: Any, unit: Any,
                  skip_frames: int) -> None:  # fmt: skip
        """Read this unit and the next ones the worker holds side by side with ``fn``, commit
        them in order. The stage's time is counted as each unit is committed: the wall time
        since the last commit, while a unit was being read."""
        cell = self.cell
        reads = collections.deque([self.start(fn, unit_id, unit, skip_frames)])
        t0, c0 = _ns(), _cpu_ns()
        cell[stats.IN_FN_SINCE_NS] = _mono_ns()
        try:
            while reads:
                head = reads[0]
                cell[stats.WORK_ID] = head.unit_id + 1
                most = self.units_at_once(fn, head.unit)
                self._read_ahead(fn, reads, most)
                reads.popleft()
                self.commit(head.unit_id, head.unit, head.skip_frames, self.replay(head), most)
                self.count_time(t0, c0)
                t0, c0 = _ns(), _cpu_ns()
                cell[stats.IN_FN_SINCE_NS] = _mono_ns()
        finally:
            cell[stats.IN_FN_SINCE_NS] = 0
            cell[stats.WORK_ID] = cell[stats.WORK_ITEM] = 0
            self.count_time(t0, c0)

    def _read_ahead(
        self, fn: Callable[[Any], Iterator[Any]], reads: collections.deque[Read], most: int
    ) -> None:
        """Start reading the units that came after the first of ``reads`` (up to ``most`` read
        at once) until that one is read. Control messages are handled as they come; any other
        message waits its turn, and no unit after it is started."""
        link, head = self.link, reads[0]
        while True:
            # A unit read but not committed yet holds no call: the next one starts now, so
            # that the calls in flight stay at the worker's concurrency while it commits.
            reading = sum(not r.done for r in reads) if READ_DURING_COMMIT else len(reads)
            if len(reads) < MAX_UNITS and reading < most:
                if link.deferred:
                    nxt = link.deferred[0]
                    if type(nxt) is P.Unit and self.units_at_once(fn, nxt.unit) > 1:
                        link.deferred.popleft()
                        reads.append(self.start(fn, nxt.unit_id, nxt.unit, nxt.skip_frames))
                        continue
                elif link.ready() if head.done else self.wait(head, link.conn):
                    msg = link.read()
                    if not self.on_control(msg):
                        link.deferred.append(msg)
                    continue
            if head.done:
                return
            self.wait(head)

    def units_at_once(self, fn: Callable[..., Any], unit: Any) -> int:
        """How many units like ``unit`` to read at once for the stage function ``fn``: 1
        unless the pool runs calls side by side and ``fn.calls_per_unit(unit)`` says how
        many one unit runs."""
        if self.pool.width <= 1:
            return 1
        per_unit = getattr(fn, "calls_per_unit", None)
        calls = per_unit(unit) if per_unit is not None else None
        if not calls:
            return 1
        return max(1, min(MAX_UNITS, -(-self.pool.width // calls)))

    def start(self, fn: Callable[[Any], Iterator[Any]], unit_id: Any, unit: Any,
              skip_frames: int) -> Read:  # fmt: skip
        """Start reading ``fn(unit)`` on a thread, in a copy of the calling thread's context
        (:mod:`contextvars`: what a thread worker set for its reads, they see); the returned
        :class:`Read` fills."""
        if self._threads is None:
            self._closing = False
            self._threads = ThreadPoolExecutor(
                MAX_UNITS, thread_name_prefix="multiproc-unit",
                initializer=self._thread_start, initargs=(intraop.of_this_thread(),),
            )  # fmt: skip
            self._wake = os.pipe()
            for fd in self._wake:
                os.set_blocking(fd, False)  # a full pipe already says "wake up"
        r = Read(unit_id, unit, skip_frames)
        self._threads.submit(contextvars.copy_context().run, self._read, fn, r)
        return r

    def _thread_start(self, intra: int | None) -> None:
        self._started.append(threading.current_thread())
        intraop.set_here(intra)

    def _read(self, fn: Callable[[Any], Iterator[Any]], r: Read) -> None:
        calls = _UnitCalls(self.pool)
        concurrency._install(calls)  # type: ignore[arg-type]
        c0 = time.thread_time_ns()
        try:
            for x in fn(r.unit):
                r.items.append((calls.not_items, x))
                calls.not_items = 0
                if self._closing:
                    break
        except Exception as e:
            r.error = e
        finally:
            self.pool.add_cpu_ns(time.thread_time_ns() - c0)
            concurrency._install(None)
            r.done = True
            with self._wake_lock:
                if self._wake is not None:
                    try:
                        os.write(self._wake[1], b"\0")
                    except BlockingIOError:
                        pass

    def replay(self, r: Read) -> Iterator[Any]:
        """A finished read's items as its stage function made them: each item's marks are
        said when the item comes, and the read's exception is raised after its items."""
        for marks, x in r.items:
            if marks:
                self.pool.add_not_items(marks)
            yield x
        r.items = []
        if r.error is not None:
            raise r.error

    def wait(self, r: Read, conn: Any = None) -> bool:
        """Block until ``r`` is done or, when ``conn`` is given, a message waits on it; True
        when the message is what woke it."""
        assert self._wake is not None
        watch = [self._wake[0]] if conn is None else [self._wake[0], conn]
        while not r.done:
            ready = self._poller.wait(watch, None)
            if self._wake[0] in ready:
                try:
                    os.read(self._wake[0], 4096)
                except BlockingIOError:
                    pass
            if conn is not None and conn in ready:
                return True
        return False

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the reads (each after the item it makes now) and let the threads end, waiting
        up to ``wait_s`` for them (see :meth:`multiproc.concurrency.CallPool.close`)."""
        self._closing = True
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        started, self._started = self._started, []
        concurrency.join_within(started, wait_s)
        with self._wake_lock:
            if self._wake is not None:
                for fd in self._wake:
                    os.close(fd)
                self._wake = None


__all__ = ["MAX_UNITS", "Read", "ReadAhead"]
