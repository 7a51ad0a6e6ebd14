"""Lock-free per-worker counters in shared memory, and snapshots of them.

Each worker slot is one row of int64 counters written only by that worker (single writer;
aligned 8-byte stores do not tear on the platforms torch supports), so the executor and any
tuner read them at any time without a lock and without stopping anything.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from .arena import Segment
from .offload import CallSums

# Counter columns.
(
    ITEMS_IN,
    ITEMS_OUT,
    FRAMES_IN,
    FRAMES_OUT,
    BUSY_NS,
    BLOCKED_IN_NS,
    BLOCKED_OUT_NS,
    BYTES_OUT,
    ERRORS,
    SPILLED,
    PID,
    STARTED_NS,
    CPU_NS,
    RUNQ_NS,
    IN_FN_SINCE_NS,  # monotonic ns since which the worker runs its function; 0: it does not
    WORK_ID,  # the frame or unit it works on, plus one (0: none)
    WORK_ITEM,  # the item of that frame or unit it is at, plus one
    HOP_NS,  # CPU time decoding input frames and encoding output frames (moving items)
) = range(18)
# A worker that also runs the next stages' functions (fusion) counts their work apart, so each
# stage's totals stay its own: for the stage d after the worker's own (d = 1..MAX_FUSED),
# columns FUSED + FUSED_WIDTH * (d - 1) + one of these.
MAX_FUSED = 8
FUSED = 18
F_ITEMS_IN, F_ITEMS_OUT, F_BUSY_NS, F_CPU_NS, F_ERRORS = range(5)
FUSED_WIDTH = 5
# Remote calls an offload worker made (multiproc.offload.CallSums): count, sums of x, y, x*x
# and x*y.
CALLS = FUSED + MAX_FUSED * FUSED_WIDTH + 3
CALL_N, CALL_SX, CALL_SY, CALL_SXX, CALL_SXY = range(CALLS, CALLS + 5)
N_COUNTERS = CALLS + 5


def fused_col(d: int, field: int) -> int:
    """Column of ``field`` (``F_*``) for the stage ``d`` after a worker's own."""
    return FUSED + FUSED_WIDTH * (d - 1) + field


class CounterTable:
    """An (n_slots x N_COUNTERS) int64 table in a shared-memory segment."""

    def __init__(self, name: str, n_slots: int, create: bool):
        size = n_slots * N_COUNTERS * 8
        self.segment = Segment(name, size, create=create)
        self.n_slots = n_slots
        self.table = np.frombuffer(
            self.segment.mm, dtype=np.int64, count=n_slots * N_COUNTERS
        ).reshape(n_slots, N_COUNTERS)
        if create:
            self.table[:] = 0

    def row(self, slot: int) -> np.ndarray:
        return self.table[slot]

    def close(self, unlink: bool) -> None:
        self.table = None  # type: ignore[assignment]  # drop the export before the mapping goes
        if unlink:
            self.segment.unlink()


@dataclass(frozen=True)
class WorkerStats:
    """Counters of one worker since it started."""

    stage: str
    slot: int
    pid: int
    items_in: int
    items_out: int
    frames_in: int
    frames_out: int
    busy_ns: int
    blocked_in_ns: int
    blocked_out_ns: int
    bytes_out: int
    errors: int
    spilled: int
    alive_ns: int
    cpu_ns: int = 0
    runq_ns: int = 0
    hop_ns: int = 0
    remote: bool = False  # an offload worker (multiproc.offload); its retired sum, slot -1
    calls: CallSums = CallSums()  # the remote calls it made
    # A local thread worker: a thread of the executor's process, whose pid it reports (its
    # memory is that process's, no worker process's); the retired ones' sum, slot -1.
    thread: bool = False


@dataclass(frozen=True)
class StageSnapshot:
    """A stage's totals: all workers it ever had (dead and retired ones included).

    ``runq_ns`` is the time its workers were runnable but waiting for a CPU (the kernel's
    run-queue delay, ``/proc/thread-self/schedstat``; 0 where the kernel does not export it):
    each worker's own thread's, plus, for calls in flight on threads, one call thread's per
    batch of calls (the delay a batch's calls waited, :class:`multiproc.concurrency.CallPool`).
    ``cpu_ns`` counts the CPU of every thread that ran the stage's calls, so with
    ``concurrency`` above 1 it may exceed ``busy_ns`` (wall time in the function).
    ``hop_ns`` is the CPU time its workers spent decoding their input frames and encoding their
    output frames: what crossing its channels costs it (0 for a fused stage, whose items do
    not cross one; its host encodes the group's output). A stage
    whose ``placement`` is not ``"local"`` forwards its work elsewhere (one remote worker per
    local worker); ``cpu_ns`` then includes the remote workers' CPU, as they report it.

    A stage with an offload (:mod:`multiproc.offload`) reports, of ``workers``, how many are
    offload workers (``remote_workers``; ``remotable`` says it has an offload), and those
    workers' own counters apart (``remote_items_in``, ``remote_items_out``,
    ``remote_busy_ns``, ``remote_blocked_out_ns``, ``remote_cpu_ns``: parts of the totals);
    ``calls`` sums the remote calls any of its workers reported.

    Of its local workers, ``threads`` run as threads of the executor's process now (the rest
    as processes; ``Executor.resize(stage, n, threads=t)``), with their own counters apart
    (``thread_items_in``, ``thread_items_out``, ``thread_busy_ns``, ``thread_blocked_out_ns``,
    ``thread_cpu_ns``: parts of the totals, retired thread workers' included). Their CPU is
    the executor's process's, and so is their memory: no worker process holds it.
    """

    name: str
    workers: int
    items_in: int
    items_out: int
    busy_ns: int
    blocked_in_ns: int
    blocked_out_ns: int
    worker_ns: int
    cpu_ns: int
    bytes_out: int
    errors: int
    spilled: int
    restarts: int
    buffer_budget_bytes: int
    buffer_used_bytes: int
    buffer_items: int
    queued_frames: int
    per_worker: tuple[WorkerStats, ...] = field(default=())
    runq_ns: int = 0
    concurrency: int = 1  # calls in flight per worker
    fused: bool = False  # runs in the previous stage's workers (multiproc.fusion)
    fusable: bool = False  # set_fused(stage, True) would be accepted now
    placement: str = "local"  # where the function does its work (StageSpec.placement)
    hop_ns: int = 0  # time decoding inputs and encoding outputs (see the docstring)
    remote_workers: int = 0
    remotable: bool = False
    remote_items_in: int = 0
    remote_items_out: int = 0
    remote_busy_ns: int = 0
    remote_blocked_out_ns: int = 0
    remote_cpu_ns: int = 0
    calls: CallSums = CallSums()
    threads: int = 0
    thread_items_in: int = 0
    thread_items_out: int = 0
    thread_busy_ns: int = 0
    thread_blocked_out_ns: int = 0
    thread_cpu_ns: int = 0


@dataclass(frozen=True)
class Snapshot:
    """Everything the executor counts, at one instant (``t_ns`` from ``time.monotonic_ns``).

    ``delivered_items`` counts every output handed to the consumer, bookkeeping outputs
    included (``concurrency.not_an_item``); the stages' ``items_out`` leave those out.
    """

    t_ns: int
    stages: tuple[StageSnapshot, ...]
    delivered_items: int
    delivered_frames: int

    def stage(self, name: str) -> StageSnapshot:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")


def read_row(
    stage: str, slot: int, row: np.ndarray, now_ns: int, kind: str = "process"
) -> WorkerStats:
    """The counters of the worker in ``slot`` (-1: a sum of retired ones) of ``kind``
    (:data:`multiproc.policy.WORKER_KINDS`)."""
    r = row.copy()
    return WorkerStats(
        stage=stage,
        slot=slot,
        pid=int(r[PID]),
        items_in=int(r[ITEMS_IN]),
        items_out=int(r[ITEMS_OUT]),
        frames_in=int(r[FRAMES_IN]),
        frames_out=int(r[FRAMES_OUT]),
        # A call still running counts as busy now (a stuck stage reads 100% busy, not 0%).
        busy_ns=int(r[BUSY_NS])
        + (max(0, now_ns - int(r[IN_FN_SINCE_NS])) if r[IN_FN_SINCE_NS] else 0),
        blocked_in_ns=int(r[BLOCKED_IN_NS]),
        blocked_out_ns=int(r[BLOCKED_OUT_NS]),
        bytes_out=int(r[BYTES_OUT]),
        errors=int(r[ERRORS]),
        spilled=int(r[SPILLED]),
        alive_ns=max(0, now_ns - int(r[STARTED_NS])) if r[STARTED_NS] else 0,
        cpu_ns=int(r[CPU_NS]),
        runq_ns=int(r[RUNQ_NS]),
        hop_ns=int(r[HOP_NS]),
        remote=kind == "remote",
        calls=CallSums(*(int(r[c]) for c in range(CALL_N, CALL_SXY + 1))),
        thread=kind == "thread",
    )


def kind_totals(far: list[WorkerStats], near: list[WorkerStats], rows: list[WorkerStats]) -> dict:
    """A stage snapshot's fields by worker kind: the offload workers' rows ``far`` summed
    (``remote_*``), the local thread workers' rows ``near`` summed (``thread_*``), and the
    remote calls of all its ``rows``."""
    out: dict = {"calls": CallSums.total([r.calls for r in rows])}
    for prefix, part in (("remote", far), ("thread", near)):
        for f in ("items_in", "items_out", "busy_ns", "blocked_out_ns", "cpu_ns"):
            out[f"{prefix}_{f}"] = sum(getattr(r, f) for r in part)
    return out


def read_fused(stage: str, row: np.ndarray, d: int) -> WorkerStats:
    """The work a worker did for the stage ``d`` after its own (fusion), as a row of that
    stage (``slot`` -1, ``pid`` 0: no worker of that stage did it)."""
    return WorkerStats(
        stage=stage,
        slot=-1,
        pid=0,
        items_in=int(row[fused_col(d, F_ITEMS_IN)]),
        items_out=int(row[fused_col(d, F_ITEMS_OUT)]),
        frames_in=0,
        frames_out=0,
        busy_ns=int(row[fused_col(d, F_BUSY_NS)]),
        blocked_in_ns=0,
        blocked_out_ns=0,
        bytes_out=0,
        errors=int(row[fused_col(d, F_ERRORS)]),
        spilled=0,
        alive_ns=0,
        cpu_ns=int(row[fused_col(d, F_CPU_NS)]),
    )


SCHEDSTAT = "/proc/thread-self/schedstat"  # the calling thread's scheduler counters


def read_runq_ns(fd: int) -> int:
    """The run-queue delay so far (ns) of the thread that opened ``fd`` on ``SCHEDSTAT``."""
    return int(os.pread(fd, 128, 0).split()[1])


class RunQueue:
    """This thread's run-queue delay (runnable, waiting for a CPU) into ``RUNQ_NS``.

    Read from ``/proc/thread-self/schedstat`` at most every ``EVERY_NS`` (a read costs a few
    microseconds); stays 0 where the kernel does not export it. Created in the worker's own
    thread: the file describes the thread that opened it.
    """

    EVERY_NS = 20_000_000

    def __init__(self, enabled: bool = True) -> None:
        self.fd: int | None = None
        self.last = 0
        if not enabled:
            return
        try:
            self.fd = os.open(SCHEDSTAT, os.O_RDONLY)
            self.base = self._read()
        except (OSError, ValueError, IndexError):
            self.close()

    def _read(self) -> int:
        assert self.fd is not None
        return read_runq_ns(self.fd)

    def update(self, row, threads_ns: int = 0) -> None:
        """``threads_ns``: the delay of the worker's call threads so far (one thread sampled
        per batch of calls, :class:`multiproc.concurrency.CallPool`), added: the calls of a
        stage with calls in flight run there, not on this thread."""
        if self.fd is None:
            return
        now = time.perf_counter_ns()
        if now - self.last < self.EVERY_NS:
            return
        self.last = now
        try:
            row[RUNQ_NS] = self._read() - self.base + threads_ns
        except (OSError, ValueError, IndexError):
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
