"""The reads of a kind probe: units read on threads of the consumer's process before the
executor starts, to choose the kind its ``auto`` stages start on
(:mod:`torchtune_pipe.loader.kindstart`).

A unit read on a process of its own costs what it costs alone (its CPU, its waits on files or
the network) plus its hop between processes (:func:`multiproc.serialize.hop_s`: pickling, the
copy into shared memory, the rebuild in the consumer); ``k`` units read at once on threads
cost what they measured together: reads that hold the interpreter lock run one at a time,
reads that release it (a decode in C, torch and numpy kernels, waits) side by side, and none
of them pays the hop. Items of several MiB can make the hop cost as much as the read.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from multiproc import intraop
from multiproc.worker import act_as_thread_worker
from torchtune_pipe.loader.tagging import Work


@dataclass
class KindProbe:
    """A fast start that measures, before its executor starts, whether reads scale on threads
    of this process: after a first unit (warm-up), it alternates one unit read alone with
    ``threads`` units read at once (its thread and ``threads - 1`` helpers), in rounds: one not
    counted where it fits the probe's time twice (the helpers' first reads: a new thread's
    allocator and caches warm up, as a new worker's do, once), then counted ones until their
    read time reaches ``KIND_PROBE_S`` over ``KIND_ROUNDS_MIN`` rounds (or twice that in one).
    It starts no read past ``KIND_PROBE_MAX_S``: units so long that no round was counted by
    then leave the kind unmeasured (processes, tried by the rule later). Where its first read
    alone shows that ``threads`` reads at once, even at ``threads`` times its rate, would not
    reach the share of the processes' rate threads start from (reads that compute, a hop of a
    few percent of them), it reads no more on threads. Units are delivered
    in order whatever thread read them; the executor starts once ``decide`` has been called.

    The first unit is read in the calling thread (the first batch is not delayed); the rest
    are read on a thread of the probe's own, which then builds the executor, so the workers
    start whether or not the consumer asks for more meanwhile. The probe's threads count as
    thread workers (:func:`multiproc.worker.act_as_thread_worker`): they seed no global
    generator, and the reads they run are ones that draw from none (``may_run``).

    Attributes:
        threads: units read at once (k >= 2).
        may_run: asked after the first unit: whether the reads may run on threads now (e.g.
            ``__getitem__`` draws nothing from the global random generators).
        decide: called once, on the probe's thread, with the rate of units read alone, of
            units read ``threads`` at once, and of the units ``threads`` worker processes
            would read, their hops included (items/s; 0.0: not measured; the second alone 0.0
            where the first read alone ended the probe), the reads' wall per
            CPU time (None: not measured) and what a read on a probe thread raised (None:
            nothing).
        thread_context: entered around a probe thread's reads, to make it look like a worker
            to the source, in that thread only (``get_worker_info()``).
        torch_threads: torch intra-op threads of a probe thread (the source stage's, as a
            thread worker of it has: :mod:`multiproc.intraop`).
        arena_bytes: what a worker process's arena would hold of a unit (its hop is measured
            for that arena: :func:`multiproc.serialize.hop_s`); None: no bound.
        clear: whether the rates of one counted round (units read ``threads`` at once, and
            what ``threads`` processes would read) already decide the kind beyond a round's
            noise: the probe then counts no more rounds.
    """

    threads: int
    may_run: Callable[[], bool]
    decide: Callable[[float, float, float, float | None, Exception | None], None]
    thread_context: Callable[[], Any] = contextlib.nullcontext
    torch_threads: int = 1
    arena_bytes: int | None = None
    clear: Callable[[float, float], bool] = lambda together, processes: False


def runq_s() -> float:
    """This thread's time runnable but waiting for a CPU (the kernel's run-queue delay), in
    seconds; 0 where ``/proc/thread-self/schedstat`` is not exported."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def read_or_error(read: Callable[[Work], list], work: Work) -> list | BaseException:
    """``read(work)``, or what it raised (raised where the consumer reaches the unit)."""
    try:
        return read(work)
    except BaseException as e:
        return e


class Helper:
    """A thread of a kind probe that reads the units it is given, one at a time, as a thread
    worker would (:class:`KindProbe`); ``give(None)`` ends it."""

    def __init__(self, read: Callable[[Work], list], kp: KindProbe) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._read, self._kp = read, kp
        self._thread = threading.Thread(
            target=self._run, name="torchtune_pipe-kind-helper", daemon=True
        )
        self._thread.start()

    def give(self, work: Work | None) -> None:
        self._work.put(work)

    def stop(self) -> None:
        """End the thread and wait for it: its context is left before the probe's is (what
        the contexts swap process-wide, such as the collate of ``private_collate``, is put
        back in the order it was taken)."""
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join()

    def result(self) -> list | BaseException:
        return self._out.get()

    def _run(self) -> None:
        act_as_thread_worker()
        intraop.set_here(self._kp.torch_threads)
        with self._kp.thread_context():
            while (work := self._work.get()) is not None:
                self._out.put(read_or_error(self._read, work))


@dataclass
class Measured:
    """What a kind probe's counted rounds measured (``FastStart._rounds``): seconds and items
    of the units read alone and of those read at once, the hops of the former between
    processes (:func:`multiproc.serialize.hop_s`), and what a read raised."""

    rounds: int = 0
    alone_s: float = 0.0
    alone_items: int = 0
    together_s: float = 0.0
    together_items: int = 0
    hop_s: float = 0.0
    error: Exception | None = None
    capped: bool = False  # one read alone showed threads could not win (_capped_hop)

    def rates(self, k: int) -> tuple[float, float, float]:
        """Items/s of the units read alone, of those read ``k`` at once, and of ``k``
        processes each reading units as fast as one alone, then their hops; zeros before a
        round was counted, and 0.0 for the second where the probe was capped."""
        if self.capped and self.alone_s > 0:
            alone = self.alone_items / self.alone_s
            return alone, 0.0, k * self.alone_items / (self.alone_s + self.hop_s)
        if self.rounds < 1 or self.alone_s <= 0 or self.together_s <= 0:
            return 0.0, 0.0, 0.0
        return (
            self.alone_items / self.alone_s,
            self.together_items / self.together_s,
            k * self.alone_items / (self.alone_s + self.hop_s),
        )


__all__ = ["Helper", "KindProbe", "read_or_error", "runq_s"]
