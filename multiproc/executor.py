"""The stage executor: a chain of resizable worker pools joined by shared-memory channels.

One router thread in the consumer's process owns all bookkeeping. Payload bytes never pass
through it (they sit in the producers' arenas); it moves small control messages between
workers over private pipes, waits on those pipes and on the workers' process sentinels (so a
death is seen at once, without polling), and knows at every moment which frames each worker
holds. That knowledge is what makes recovery exact: a dead worker's frames, units and
stateful holdings are re-delivered, with what it already committed skipped.

Example:
    >>> spec = ExecutorSpec((StageSpec("read", "source", read_unit, workers=2),
    ...                      StageSpec("udf", "map", transform, workers=3)))
    >>> with Executor(spec) as ex:
    ...     for item in ex.run(units):
    ...         ...
    ...     ex.resize("udf", 5)
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from . import arena, buffers, handles, lifetime, offload, policy, shm, stats
from . import protocol as P
from .errors import (
    ExecutorClosedError,
    ExecutorError,
    SharedMemoryError,
    SpecError,
)
from .faults import Faults
from .frames import Order, Run, StageState
from .frames import WorkerState as WS
from .fusion import Fusion
from .lifecycle import MAX_SLOTS, Workers
from .poller import Poller
from .router import Router
from .snapshot import Snapshot
from .spec import ExecutorSpec, check_picklable

log = logging.getLogger(__name__)

_exec_ids = itertools.count()
_swept = threading.Event()  # stale segments are swept once per process


class Executor(Router, Workers, Fusion, Faults):
    """Runs an :class:`ExecutorSpec`; see the module docstring.

    Args:
        spec: the stages and options.
        snapshot: where process workers come from (:class:`multiproc.snapshot.Snapshot`,
            taken with :meth:`~multiproc.snapshot.Snapshot.take` on ``spec.stages``): the
            executor owns it from here on and ends it when it closes. None: one taken now.
    """

    # Bound with the class: close() runs where module globals may be gone (module docstring).
    _is_owner = staticmethod(lifetime.is_owner)

    def __init__(self, spec: ExecutorSpec, snapshot: Snapshot | None = None):
        if not isinstance(spec, ExecutorSpec):
            raise SpecError(f"Executor: spec must be an ExecutorSpec, got {type(spec).__name__}")
        self.spec = spec
        # Segments are named ttp_<pid>_...: the fork server sweeps that prefix (lifetime.py).
        self._tag = f"{os.getpid()}_{next(_exec_ids)}_{os.urandom(3).hex()}"
        # Read before the fork server is forked, so that it and its workers agree (shm.py).
        self._room = shm.Room(shm.directory(), policy.MIN_SHARE_BYTES)
        # Large arrays of the stage pickles: in the fork server's memory, or in one shared
        # file the workers map (buffers.py).
        self._buffers = buffers.BufferFile(f"ttp_{self._tag}{buffers.FILE_SUFFIX}")
        self._preload = self._start_server(snapshot)
        # Held until close, made before any other segment (lifetime.Alive): a sweep in another
        # PID namespace sharing the directory sees these segments alive.
        try:
            self._alive = _alive(self._tag)
        except BaseException:
            if self._snapshot is not None:
                self._snapshot.stop()
            raise
        try:
            self._pickle_stages()
            self._offload_bytes = {
                i: check_picklable(offload.offload_spec(s), self._buffers)
                for i, s in enumerate(spec.stages)
                if s.offload is not None
            }
        except BaseException:
            self._buffers.close()
            if self._buffers.created:
                arena.remove_segment(self._buffers.name)
            if self._snapshot is not None:
                self._snapshot.stop()
            _release_alive(self._alive)
            raise
        self._buffers.close()
        if not _swept.is_set():
            _swept.set()
            stale = arena.sweep_stale_segments()
            if stale:
                log.info("removed %d shared-memory segments of dead processes", len(stale))
        self._names = [s.name for s in spec.stages]
        self._init_fusion()
        self._timeouts = {i: s.timeout_s for i, s in enumerate(spec.stages) if s.timeout_s}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._commands: collections.deque = collections.deque()
        self._sink_frees: collections.deque = collections.deque()
        self._free_slots = list(range(MAX_SLOTS - 1, -1, -1))
        self._wids = itertools.count()
        self._frame_ids = itertools.count()
        self._workers: dict[int, handles.WorkerHandle] = {}
        self._by_seg: dict[str, int] = {}
        self._seg_refs: collections.Counter = collections.Counter()
        self._segments: set[str] = {self._buffers.name} if self._buffers.created else set()
        self._cache = arena.MappingCache()
        # Everything to give back, reachable by the finalizer from the first resource on: a
        # Ctrl-C anywhere below still releases what was made before it.
        self._res = handles.Resources(
            os.getpid(),
            self._workers,
            self._segments,
            self._cache,
            prefix=f"ttp_{self._tag}_",
            snapshot=self._snapshot,
        )
        self._finalizer = weakref.finalize(self, _release, self._res, self._alive)
        try:
            self._start()
        except BaseException:
            self._finalizer()
            raise

    def _start(self) -> None:
        spec = self.spec
        res = self._res
        res.wake_r, res.wake_w = os.pipe()
        os.set_blocking(res.wake_w, False)
        res.counters = stats.CounterTable(f"ttp_{self._tag}_stats", MAX_SLOTS, create=True)
        self._counters = res.counters
        # Budgets that fit what the shared-memory directory has free (shm.Room).
        budgets = self._room.fit([s.buffer_bytes for s in spec.stages])
        if budgets != [s.buffer_bytes for s in spec.stages]:
            log.info(
                "%s has %d MiB free: channel budgets lowered to %s MiB",
                self._room.path,
                shm.usage(self._room.path)[1] >> 20,
                [round(b / (1 << 20), 1) for b in budgets],
            )
        self._stages = [
            StageState(
                i,
                s.workers,
                budgets[i],
                s.concurrency,
                remote=s.offload.workers if s.offload else 0,
            )  # fmt: skip
            for i, s in enumerate(spec.stages)
        ]
        self._run: Run | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._delivered_items = 0
        self._delivered_frames = 0
        self._start_latencies_ns: list[int] = []
        self._seg_bytes: collections.Counter = collections.Counter()  # stage -> bytes in arenas
        self._sizes: dict = {}  # (segment, offset) -> bytes
        self._pending_free: dict = {}  # wid -> offsets to send
        self._outgoing: dict | None = None  # wid -> (handle, messages) while handling an event
        self._pending_count: collections.Counter = collections.Counter()  # wid -> frames queued
        # The router holds the executor weakly (see _route): an executor nobody references is
        # collected, and its finalizer stops the workers.
        self._thread = threading.Thread(
            target=Executor._route,
            args=(weakref.ref(self), res.stop),
            name=f"multiproc-router-{self._tag}",
            daemon=True,
        )
        res.router = self._thread
        with self._lock:
            for st in self._stages:
                if not self._fused[st.index]:
                    for k in range(self._first_workers(st.index)):
                        self._spawn(st.index, remote=k >= st.target - st.remote)
        self._thread.start()

    # ---------------------------------------------------------------- public API
    def run(self, units: Sequence, epoch: int = 0) -> Iterator[Any]:
        """Push ``units`` through the pipeline; iterate the items that come out.

        Only one run is active at a time; workers persist from one run to the next. Closing
        the iterator early (``break``, an exception in the consumer) closes the executor:
        create a new one to continue.
        """
        units = list(units)
        with self._lock:
            self._check_open()
            if self._run is not None and not self._run.finished:
                raise ExecutorError(
                    "Executor.run: a run is already active; finish or close it first"
                )
            self._run = Run(units, epoch)
            for st in self._stages:
                st.closed = st.done = st.flush_sent = False
                st.order = Order()
                st.out_counter = 0
            for h in self._workers.values():
                if h.alive() and self.spec.stages[h.stage].stateful:
                    self._send(h, P.Epoch(epoch))
        self._wake()
        return self._iterate(self._run)

    def resize(self, stage: str | int, n: int, remote: int | None = None) -> None:
        """Set a stage's worker count (within its bounds) while running.

        Args:
            stage: the stage's name or index.
            n: its workers, of both kinds.
            remote: of ``n``, how many are offload workers (a stage with an ``offload``,
                :mod:`multiproc.offload`; at most ``offload.max_workers``). None keeps the
                current count (at most ``n``). Each kind starts or retires its own workers;
                what a retiring one holds it finishes, nothing is lost or run twice.
        """
        i = self._stage_index(stage)
        s = self.spec.stages[i]
        if not isinstance(n, int) or isinstance(n, bool):
            raise SpecError(f"resize(): stage {s.name!r}: n must be an int, got {n!r}")
        if not s.min_workers <= n <= s.max_workers:
            raise SpecError(
                f"resize(): stage {s.name!r}: n must be in [{s.min_workers}, {s.max_workers}], got {n}"
            )
        why = offload.remote_problem(s.offload, n, remote)
        if why is not None:
            raise SpecError(f"resize(): stage {s.name!r}: {why}")
        self._command(("resize", i, n, remote))

    def set_budget(self, stage: str | int, budget_bytes: int) -> None:
        """Set the byte budget of a stage's outbound channel while running."""
        i = self._stage_index(stage)
        s = self.spec.stages[i]
        lo = policy.MIN_SHARE_BYTES
        if not isinstance(budget_bytes, int) or not lo <= budget_bytes <= s.max_buffer_bytes:
            raise SpecError(
                f"set_budget(): stage {s.name!r}: budget_bytes must be an int in "
                f"[{lo}, {s.max_buffer_bytes}] (max_buffer_bytes), got {budget_bytes!r}"
            )
        self._command(("budget", i, budget_bytes))

    def set_concurrency(self, stage: str | int, n: int) -> None:
        """Set the calls in flight per worker of a stage while running (see
        :mod:`multiproc.concurrency`), within ``1..max_concurrency``."""
        i = self._stage_index(stage)
        s = self.spec.stages[i]
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= s.max_concurrency:
            raise SpecError(
                f"set_concurrency(): stage {s.name!r}: n must be an int in "
                f"[1, {s.max_concurrency}] (max_concurrency), got {n!r}"
            )
        self._stages[i].concurrency = n  # read by concurrency(); the router tells the workers
        self._command(("concurrency", i, n))

    def concurrency(self, stage: str | int) -> int:
        """Calls in flight per worker of the stage."""
        return self._stages[self._stage_index(stage)].concurrency

    def workers(self, stage: str | int) -> int:
        """The stage's target worker count."""
        return self._stages[self._stage_index(stage)].target

    def remote_workers(self, stage: str | int) -> int:
        """Of the stage's target worker count, its offload workers (:mod:`multiproc.offload`;
        0 for a stage without an offload)."""
        st = self._stages[self._stage_index(stage)]
        return min(st.remote, st.target)

    def budget(self, stage: str | int) -> int:
        return self._stages[self._stage_index(stage)].budget

    @property
    def stage_names(self) -> list[str]:
        return list(self._names)

    def started(self) -> bool:
        """Whether as many workers have started (said hello) as the stages that run their
        own (not fused) want."""
        want = sum(st.target for st in self._stages if not self._fused[st.index])
        return len(self._start_latencies_ns) >= want

    def start_latencies_ms(self) -> list[float]:
        """Time from a worker's start request to its first message, for every worker so far."""
        with self._lock:
            return [x / 1e6 for x in self._start_latencies_ns]

    def snapshot(self, per_worker: bool = False) -> stats.Snapshot:
        """All counters now, without stopping anything."""
        now = time.monotonic_ns()
        with self._lock:
            if self._closed:
                raise self._closed_error("snapshot()")
            stages = []
            fusable = self.fusable()
            for st in self._stages:
                live = [h for h in self._workers.values() if h.stage == st.index and h.alive()]
                far_slots = {h.slot for h in live if h.remote}
                name = self._names[st.index]
                rows = [
                    stats.read_row(name, slot, self._counters.row(slot), now, slot in far_slots)
                    for slot in sorted(st.slots)
                ]
                if st.retired is not None:
                    rows.append(stats.read_row(name, -1, st.retired, now))
                far = [r for r in rows if r.remote]
                if st.retired_remote is not None:
                    far.append(stats.read_row(name, -1, st.retired_remote, now, True))
                rows += self._fused_rows(st.index, now)
                used = sum(self._seg_refs[h.seg_name] for h in live)
                queued = len(st.ready)
                stages.append(
                    stats.StageSnapshot(
                        name=self._names[st.index],
                        workers=sum(1 for h in live if h.state != WS.RETIRING),
                        items_in=sum(r.items_in for r in rows),
                        items_out=sum(r.items_out for r in rows),
                        busy_ns=sum(r.busy_ns for r in rows),
                        blocked_in_ns=sum(r.blocked_in_ns for r in rows),
                        blocked_out_ns=sum(r.blocked_out_ns for r in rows),
                        worker_ns=sum(r.alive_ns for r in rows),
                        cpu_ns=sum(r.cpu_ns for r in rows),
                        bytes_out=sum(r.bytes_out for r in rows),
                        errors=sum(r.errors for r in rows),
                        spilled=sum(r.spilled for r in rows),
                        restarts=st.restarts,
                        buffer_budget_bytes=st.budget,
                        buffer_used_bytes=self._seg_bytes[st.index],
                        buffer_items=used,
                        queued_frames=queued,
                        per_worker=tuple(rows) if per_worker else (),
                        runq_ns=sum(r.runq_ns for r in rows),
                        hop_ns=sum(r.hop_ns for r in rows),
                        concurrency=st.concurrency,
                        fused=self._fused[st.index],
                        fusable=fusable[st.index],
                        placement=self.spec.stages[st.index].placement,
                        remote_workers=sum(h.remote and h.state != WS.RETIRING for h in live),
                        remotable=self.spec.stages[st.index].offload is not None,
                        **stats.remote_totals(far, rows),
                    )
                )
            return stats.Snapshot(now, tuple(stages), self._delivered_items, self._delivered_frames)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop every worker (within ``timeout_s``) and remove every shared-memory segment.

        Does nothing in a process forked from the owner (which shares none of its threads).
        """
        if self._res.stop.is_set():
            self._closed = True  # released already (at interpreter exit, module globals may
            return  # be gone by the time a leftover run iterator is collected)
        if not self._is_owner(self._res.pid):
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s + 2.0)
        self._finalizer()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- consumer side
    def _iterate(self, run: Run) -> Iterator[Any]:
        release = self._sink_release()
        try:
            while True:
                payload = self._next_frame(run)
                if payload is None:
                    return
                items = arena.decode(payload, self._cache, release)
                self._delivered_frames += 1
                for x in items:
                    self._delivered_items += 1
                    yield x
                del items
        except GeneratorExit:
            if not run.finished:
                self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _next_frame(self, run: Run):
        with self._cond:
            while True:
                if self._closed and not run.finished:
                    # Its frames live in segments the close removed.
                    raise self._closed_error("iterating a run")
                if self._error is not None:
                    raise self._error
                if run.sink:
                    was_full = run.sink.full(self._stages[-1].budget)
                    frame = run.sink.popleft()
                    self._frame_left(frame)
                    if frame.inline and was_full:
                        self._wake()  # the last stage may be waiting for room here (FrameQueue)
                    if not run.sink:
                        self._break_stall()  # the consumer held the last thing that could move
                    return frame.payload
                if run.finished:
                    return None
                # Woken by the router on every delivery; the timeout only re-checks liveness.
                self._cond.wait(1.0)
                if not self._thread.is_alive() and self._error is None and not run.finished:
                    self._error = ExecutorError("the executor's router thread ended unexpectedly")

    def _sink_release(self):
        """The release callback of delivered frames: holds the executor weakly (a tensor the
        user keeps must not keep the workers alive) and ignores a forked child's releases."""
        me = weakref.ref(self)
        frees, res = self._sink_frees, self._res

        def release(ref: arena.ShmRef) -> None:
            # Runs from a finalizer in whatever thread dropped the last reference.
            if me() is None or not lifetime.is_owner(res.pid):
                return
            frees.append((ref.segment, ref.offset))
            if not res.reporting:  # else the router takes it at the report it waits for
                res.wake()

        return release

    # ---------------------------------------------------------------- helpers
    def _set_stage_budget(self, stage: int, budget_bytes: int) -> None:
        """A budget for ``stage`` (set_budget's), within what the shared-memory directory
        leaves this executor (shm.Room); the router thread only."""
        others = sum(st.budget for st in self._stages if st.index != stage)
        self._stages[stage].budget = self._room.clamp(budget_bytes, others)
        self._rebudget(stage)

    def _on_no_room(self, stage: int) -> None:
        """A worker of ``stage`` found the shared-memory directory full: read its free bytes
        again and lower the budgets to fit (workers give back the pages they hold beyond); the
        frame that did not fit waits for room or travels through the pipe. The router only."""
        held = sum(self._seg_bytes.values())
        if not self._room.refit(held):
            return
        size, free = shm.usage(self._room.path)
        log.warning(
            "stage %r: %s is full (%.1f of %.1f MiB free): channel budgets lowered to fit "
            "%.1f MiB; frames that do not fit travel through the workers' pipes (slower). "
            "See docker run --shm-size, or %s",
            self._names[stage],
            self._room.path,
            free / (1 << 20),
            size / (1 << 20),
            self._room.cap_bytes / (1 << 20),
            shm.DIR_ENV,
        )
        budgets = self._room.fit([st.budget for st in self._stages])
        for st, b in zip(self._stages, budgets, strict=True):
            if b != st.budget:
                st.budget = b
                self._rebudget(st.index)

    def _stage_index(self, stage: str | int) -> int:
        if isinstance(stage, int) and not isinstance(stage, bool):
            if 0 <= stage < len(self._names):
                return stage
        elif stage in self._names:
            return self._names.index(stage)
        raise SpecError(f"no stage {stage!r}; stages are {self._names}")

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error("this call")
        if self._error is not None:
            raise self._error

    def _closed_error(self, what: str) -> ExecutorClosedError:
        why = f" after {type(self._error).__name__}: {self._error}" if self._error else ""
        e = ExecutorClosedError(
            f"Executor: {what} after close(): the executor was closed{why}; create a new one"
        )
        e.__cause__ = self._error
        return e

    def _command(self, cmd) -> None:
        with self._lock:
            self._check_open()
            self._commands.append(cmd)
        self._wake()

    @staticmethod
    def _route(ref: weakref.ref, stop: threading.Event) -> None:
        """The router thread: holds the executor only while it handles events, never while it
        waits, so that dropping the last reference elsewhere collects the executor."""
        ex = ref()
        poller = Poller()
        try:
            while ex is not None and not stop.is_set():
                waitables, live, timeout = ex._waitables()
                if waitables is None:
                    return
                del ex  # may run the finalizer here, in this thread: it sets ``stop``
                if stop.is_set():
                    return
                # Every event that matters (a message, a death, a command, a release by the
                # consumer, the finalizer) makes one of these ready; the timeout is only the
                # deadline of a stage's timeout_s.
                ready = poller.wait(waitables, timeout)
                if stop.is_set():
                    return
                ex = ref()
                if ex is None or not ex._on_ready(ready, live):
                    return
        except BaseException as e:  # make the consumer see it instead of hanging
            ex = ref()
            if ex is None or stop.is_set():
                return
            log.debug("router failed", exc_info=True)
            with ex._cond:
                if ex._error is None:
                    ex._error = e
                ex._cond.notify_all()


def _alive(tag: str) -> lifetime.Alive:
    path = os.path.join(shm.directory(), lifetime.alive_name(tag))
    try:
        return lifetime.Alive(path)
    except OSError as e:
        if e.errno in shm.NO_ROOM:
            raise SharedMemoryError(
                shm.no_room("a new executor's files", shm.directory(), e)
            ) from e
        raise


def _release_alive(alive: lifetime.Alive) -> None:
    """Remove and unlock the alive file (after every other segment of its executor)."""
    if lifetime.is_owner(alive.pid):
        arena.remove_segment(os.path.basename(alive.path))
        alive.close()


def _release(res: handles.Resources, alive: lifetime.Alive) -> None:
    """The executor's finalizer: everything :meth:`handles.Resources.release` gives back, then
    its alive file."""
    try:
        res.release()
    finally:
        _release_alive(alive)
