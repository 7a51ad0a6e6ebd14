"""Calls in flight per worker: a stage that waits (remote reads, RPCs) on a few processes.

A worker process runs one call of its stage function at a time unless its stage's
*concurrency* is above 1: then the calls of one frame (a map stage's items, a source's reads
of one unit) run on up to ``concurrency`` threads of the worker, in order. A stage whose calls
wait on I/O then keeps dozens of reads in flight with a few processes, where one process per
concurrent read costs a process's memory and start-up each (torch's DataLoader arrangement).
Threads share the GIL, so this helps calls that wait, not calls that compute; the tuners raise
it only where the measured wall time of a call far exceeds its CPU time.

Sources cooperate through :func:`current`: ``current().map(fn, xs)`` runs ``fn`` over ``xs``
on the calling worker's threads (serially outside a worker or at concurrency 1), the way
``torch.utils.data.get_worker_info()`` tells a dataset where it runs.
"""

from __future__ import annotations

import contextvars
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import intraop, offload, stats

DEFAULT_MAX_CONCURRENCY = 64


class Outcome:
    """The result of one call: ``value``, or the exception it raised in ``error``."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value = value
        self.error = error


class CallPool:
    """Runs calls up to ``width`` at a time on threads of this process, results in order.

    The threads are started as a call first needs them and kept; ``width`` may change at any
    time (the next :meth:`map` uses it). CPU time spent on the threads is added to ``cpu_ns``
    (a worker adds it to its own CPU counter: the calling thread's clock does not see it).

    One :meth:`map` hands its calls to ``min(width, len(xs))`` threads at once, each of which
    takes the next call as it finishes one: ``width`` calls stay in flight until none is left,
    with one wake-up per thread rather than per call, and no future per call (a call that
    waits a few milliseconds costs its worker tens of microseconds of CPU in hand-offs, which
    decides how many rows/s one process makes).
    """

    def __init__(self, width: int = 1, max_width: int = DEFAULT_MAX_CONCURRENCY):
        if not isinstance(max_width, int) or max_width < 1:
            raise ValueError(f"CallPool: max_width must be an int >= 1, got {max_width!r}")
        self.max_width = max_width
        self.width = 1
        self.set_width(width)
        self.cpu_ns = 0
        self.not_items = 0  # see not_an_item
        self.calls = [0, 0, 0, 0, 0]  # remote calls: multiproc.offload.CallSums's sums
        self.runq_ns = 0  # see _Batch.run: the calls' run-queue delay, one thread sampled
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a batch (under _lock)

    def set_width(self, width: int) -> None:
        """Calls in flight from now on (clamped to ``1..max_width``)."""
        if not isinstance(width, int) or isinstance(width, bool):
            raise ValueError(f"CallPool: width must be an int, got {width!r}")
        self.width = max(1, min(self.max_width, width))

    def map(self, fn: Callable[[Any], Any], xs: Iterable[Any]) -> list[Outcome]:
        """``fn(x)`` for every ``x``, ``width`` at a time; one :class:`Outcome` per ``x``, in
        order. An exception in one call does not stop the others."""
        xs = list(xs)
        if self.width <= 1 or len(xs) <= 1:
            return [_call(fn, x) for x in xs]
        runners = min(self.width, len(xs))
        batch = _Batch(fn, xs, runners)
        with self._lock:  # maps of units read side by side share the threads
            free = self._idle - self._jobs.qsize()
            grow = min(runners - free, self.max_width - len(self._threads))
            intra = intraop.of_this_thread() if grow > 0 else None
            for _ in range(grow):
                # With the caller's torch intra-op threads, not the interpreter's default.
                t = threading.Thread(target=self._run, args=(intra,), daemon=True,
                                     name=f"multiproc-call-{len(self._threads)}")  # fmt: skip
                self._threads.append(t)
                t.start()
        for _ in range(runners):
            self._jobs.put(batch)
        batch.done.acquire()
        with self._lock:
            self.cpu_ns += batch.cpu_ns
            self.runq_ns += batch.runq_ns
        if batch.fatal is not None:
            raise batch.fatal  # SystemExit and the like: raised here, as a serial call does
        return batch.out  # type: ignore[return-value]

    def _run(self, intra: int | None = None) -> None:
        intraop.set_here(intra)
        _install(self)
        jobs, lock = self._jobs, self._lock
        while True:
            with lock:
                self._idle += 1
            batch = jobs.get()
            with lock:
                self._idle -= 1
            if batch is None:
                return
            batch.run()

    def add_cpu_ns(self, ns: int) -> None:
        """Count ``ns`` of CPU spent elsewhere on this worker's calls (a remote actor's, for a
        stage whose function forwards its work); the worker adds it to its ``cpu_ns``."""
        with self._lock:
            self.cpu_ns += ns

    def add_remote_call(self, nbytes: int, wait_ns: int) -> None:
        """Count one call this worker forwarded to a remote runtime: ``nbytes`` moved both
        ways, and ``wait_ns`` of its wall time beyond the remote function's own (the worker
        sums them in its counters, :class:`multiproc.offload.CallSums`)."""
        x, y = offload.call_point(nbytes, wait_ns)
        with self._lock:
            c = self.calls
            c[0] += 1
            c[1] += x
            c[2] += y
            c[3] += x * x
            c[4] += x * y

    def take_calls(self) -> list[int] | None:
        """The remote calls' sums since the last call (and reset them); None when none."""
        if not self.calls[0]:
            return None
        with self._lock:
            out, self.calls = self.calls, [0, 0, 0, 0, 0]
        return out

    def add_not_items(self, n: int) -> None:
        with self._lock:
            self.not_items += n

    def take_not_items(self) -> int:
        """Outputs marked by :func:`not_an_item` since the last call (and reset the count)."""
        if not self.not_items:  # the common case, without the lock
            return 0
        with self._lock:
            n, self.not_items = self.not_items, 0
        return n

    def take_cpu_ns(self) -> int:
        """CPU time of the pool's threads since the last call (and reset it)."""
        with self._lock:
            spent, self.cpu_ns = self.cpu_ns, 0
        return spent

    def close(self, wait_s: float = 0.0) -> None:
        """Let the threads end (after the calls they run now), waiting up to ``wait_s`` for
        them; a later :meth:`map` starts new ones. A thread worker waits: its process goes
        on, and a thread still freeing a call's tensor when the interpreter exits aborts it
        (a daemon thread cannot take the lock then, and unwinding torch's deleter is fatal)."""
        threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        self._jobs = queue.SimpleQueue()
        join_within(threads, wait_s)


def join_within(threads: Iterable[threading.Thread], wait_s: float) -> None:
    """Join ``threads`` (none the calling one), all within ``wait_s`` seconds together."""
    end = time.monotonic() + wait_s
    for t in threads:
        left = end - time.monotonic()
        if left <= 0:
            return
        if t is not threading.current_thread():
            t.join(left)


class _Batch:
    """One :meth:`CallPool.map`: its calls, taken in turn by ``runners`` threads; ``done`` is
    released when the last of them has run out of calls. The calls run in the context
    (:mod:`contextvars`) of the thread that called ``map``, each runner in a copy of its own:
    what that thread set for them (a thread worker's ``get_worker_info()``) they see."""

    __slots__ = ("fn", "xs", "out", "next", "left", "cpu_ns", "runq_ns", "sample", "fatal",
                 "lock", "done", "context")  # fmt: skip

    def __init__(self, fn: Callable[[Any], Any], xs: list[Any], runners: int):
        self.context = contextvars.copy_context()
        self.fn = fn
        self.xs = xs
        self.out: list[Outcome | None] = [None] * len(xs)
        self.next = iter(range(len(xs))).__next__  # atomic under the GIL: one taker per call
        self.left = runners
        self.cpu_ns = 0
        self.runq_ns = 0
        self.sample = iter((True,)).__next__  # the first thread to start samples its delay
        self.fatal: BaseException | None = None  # a call's SystemExit and the like
        self.lock = threading.Lock()
        self.done = threading.Lock()
        self.done.acquire()

    def run(self) -> None:
        self.context.copy().run(self._take_calls)

    def _take_calls(self) -> None:
        fn, xs, out, take = self.fn, self.xs, self.out, self.next
        c0 = time.thread_time_ns()
        try:
            sampled = self.sample()
        except StopIteration:
            sampled = False
        q0 = _thread_runq_ns() if sampled else 0
        while True:
            try:
                i = take()
            except StopIteration:
                break
            try:
                out[i] = _call(fn, xs[i])
            except BaseException as e:  # SystemExit and the like: map() raises it
                out[i] = Outcome(error=e)
                self.fatal = self.fatal or e
        spent = time.thread_time_ns() - c0
        waited = max(0, _thread_runq_ns() - q0) if sampled else 0
        with self.lock:
            self.cpu_ns += spent
            self.runq_ns += waited
            self.left -= 1
            if not self.left:
                self.done.release()


_schedstat = threading.local()


def _thread_runq_ns() -> int:
    """This thread's run-queue delay so far (:func:`multiproc.stats.read_runq_ns`; 0 where the
    kernel does not export it)."""
    fd = getattr(_schedstat, "fd", None)
    if fd == -1:
        return 0
    try:
        if fd is None:
            fd = _schedstat.fd = os.open(stats.SCHEDSTAT, os.O_RDONLY)
        return stats.read_runq_ns(fd)
    except (OSError, ValueError, IndexError):
        _schedstat.fd = -1
        return 0


def _call(fn: Callable[[Any], Any], x: Any) -> Outcome:
    try:
        return Outcome(fn(x))
    except Exception as e:
        return Outcome(error=e)


_SERIAL = CallPool(1, 1)
_local = threading.local()


def current() -> CallPool:
    """The call pool of the stage worker running in this thread (a serial one elsewhere)."""
    return getattr(_local, "pool", _SERIAL)


def not_an_item(n: int = 1) -> None:
    """Say, from a stage function, that ``n`` of the outputs it returns or yields now are
    bookkeeping travelling with the items (a work unit's end mark, say), not items: the
    stage's ``items_in``/``items_out`` counters leave them out, so that a stage's items per
    second count only what it makes. Outside a worker, nothing is counted."""
    pool = current()
    if pool is not _SERIAL:
        pool.add_not_items(n)


def _install(pool: CallPool | None) -> None:
    """Make ``pool`` this thread's :func:`current` (done by the worker loop at its start)."""
    _local.pool = pool if pool is not None else _SERIAL


__all__ = ["CallPool", "Outcome", "current", "not_an_item", "DEFAULT_MAX_CONCURRENCY"]
