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

import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import arena, buffers, handles, lifetime, offload, policy, shm, stats
from . import protocol as P
from .errors import (
    ExecutorClosedError,
    ExecutorError,
    SharedMemoryError,
    SpecError,
)
from .faults import Busy, FaultHandler
from .frames import Order, Run, StageState
from .frames import WorkerState as WS
from .fusion import FusionControl, chain_lengths, chain_pickles, check_fused
from .ledger import Ledger
from .lifecycle import MAX_SLOTS, Launch, WorkerPool, pickle_stages, start_server
from .mail import Mail
from .router import Router, route
from .snapshot import Snapshot
from .spec import ExecutorSpec, check_picklable
from .state import Command, ExecutorState

log = logging.getLogger(__name__)

_exec_ids = itertools.count()
_swept = threading.Event()  # stale segments are swept once per process


class Executor:
    """Runs an :class:`ExecutorSpec`; see the module docstring.

    Args:
        spec: the stages and options.
        snapshot: where process workers come from (:class:`multiproc.snapshot.Snapshot`,
            taken with :meth:`~multiproc.snapshot.Snapshot.take` on ``spec.stages``): the
            executor owns it from here on and ends it when it closes. None: one taken now.
        keep_snapshot: ``snapshot`` stays the caller's, who ends it: the workers of several
            executors, one after another, fork from it (they all see the process as it was
            when it was taken).
    """

    # Bound with the class: close() runs where module globals may be gone (module docstring).
    _is_owner = staticmethod(lifetime.is_owner)

    def __init__(
        self, spec: ExecutorSpec, snapshot: Snapshot | None = None, *, keep_snapshot: bool = False
    ):
        if not isinstance(spec, ExecutorSpec):
            raise SpecError(f"Executor: spec must be an ExecutorSpec, got {type(spec).__name__}")
        check_fused(spec.stages)
        self.spec = spec
        # Segments are named ttp_<pid>_...: the fork server sweeps that prefix (lifetime.py).
        self._tag = f"{os.getpid()}_{next(_exec_ids)}_{os.urandom(3).hex()}"
        # Read before the fork server is forked, so that it and its workers agree (shm.py).
        self._room = shm.Room(shm.directory(), policy.MIN_SHARE_BYTES)
        # Large arrays of the stage pickles: in the fork server's memory, or in one shared
        # file the workers map (buffers.py).
        self._buffers = buffers.BufferFile(f"ttp_{self._tag}{buffers.FILE_SUFFIX}")
        self._snapshot, preload = start_server(spec, snapshot, keep_snapshot)
        # A kept snapshot is the caller's: its later executors fork from it too.
        owned = None if keep_snapshot else self._snapshot
        # Held until close, made before any other segment (lifetime.Alive): a sweep in another
        # PID namespace sharing the directory sees these segments alive.
        try:
            self._alive = _alive(self._tag)
        except BaseException:
            if owned is not None:
                owned.stop()
            raise
        try:
            process_stages, thread_stages = pickle_stages(spec, self._snapshot, self._buffers)
            offload_bytes = {
                i: check_picklable(offload.offload_spec(s), self._buffers)
                for i, s in enumerate(spec.stages)
                if s.offload is not None
            }
        except BaseException:
            self._buffers.close()
            if self._buffers.created:
                arena.remove_segment(self._buffers.name)
            if owned is not None:
                owned.stop()
            _release_alive(self._alive)
            raise
        self._buffers.close()
        if not _swept.is_set():
            _swept.set()
            stale = arena.sweep_stale_segments()
            if stale:
                log.info("removed %d shared-memory segments of dead processes", len(stale))
        self._names = [s.name for s in spec.stages]
        chain = chain_lengths(spec.stages)
        launch = Launch(
            self._snapshot, preload, process_stages, thread_stages, offload_bytes,
            chain_pickles(process_stages, chain), chain_pickles(thread_stages, chain),
        )  # fmt: skip
        workers: dict[int, handles.WorkerHandle] = {}
        segments = {self._buffers.name} if self._buffers.created else set()
        cache = arena.MappingCache()
        # Everything to give back, reachable by the finalizer from the first resource on: a
        # Ctrl-C anywhere below still releases what was made before it.
        self._res = handles.Resources(
            os.getpid(),
            workers,
            segments,
            cache,
            prefix=f"ttp_{self._tag}_",
            snapshot=owned,
        )
        self._finalizer = weakref.finalize(self, _release, self._res, self._alive)
        try:
            self._start(launch, workers, segments, cache)
        except BaseException:
            self._finalizer()
            raise

    def _start(
        self,
        launch: Launch,
        workers: dict[int, handles.WorkerHandle],
        segments: set[str],
        cache: arena.MappingCache,
    ) -> None:
        """Make the shared state and the collaborators over it, start each stage's first
        workers, then the router thread. ``workers``, ``segments`` and ``cache`` are the
        finalizer's (``Resources``)."""
        spec = self.spec
        res = self._res
        res.wake_r, res.wake_w = os.pipe()
        os.set_blocking(res.wake_w, False)
        counters = stats.CounterTable(f"ttp_{self._tag}_stats", MAX_SLOTS, create=True)
        res.counters = counters
        # Budgets that fit what the shared-memory directory has free (shm.Room).
        budgets = self._room.fit([s.buffer_bytes for s in spec.stages])
        if budgets != [s.buffer_bytes for s in spec.stages]:
            log.info(
                "%s has %d MiB free: channel budgets lowered to %s MiB",
                self._room.path,
                shm.usage(self._room.path)[1] >> 20,
                [round(b / (1 << 20), 1) for b in budgets],
            )
        stages = []
        for i, s in enumerate(spec.stages):
            remote = s.offload.workers if s.offload else 0
            threads = s.workers - remote if s.starts_on_threads else 0
            stages.append(
                StageState(i, s.workers, budgets[i], s.concurrency, remote=remote, threads=threads)
            )
        state = ExecutorState(
            spec=spec,
            tag=self._tag,
            names=self._names,
            res=res,
            counters=counters,
            room=self._room,
            stages=stages,
            fused=[s.fused for s in spec.stages],
            workers=workers,
            segments=segments,
            cache=cache,
            free_slots=list(range(MAX_SLOTS - 1, -1, -1)),
        )
        self._state = state
        self._mail = Mail()
        self._ledger = Ledger(state, self._mail)
        self._pool = WorkerPool(state, self._mail, self._ledger, launch)
        self._fusion = FusionControl(state, self._mail, self._pool)
        self._faults = FaultHandler(state, self._fusion)
        router = Router(state, self._mail, self._ledger, self._pool, self._fusion, self._faults)
        self._router = router
        self._delivered_items = 0
        self._delivered_frames = 0
        # The router thread holds the router weakly (see route): an executor nobody
        # references is collected with it, and its finalizer stops the workers.
        self._thread = threading.Thread(
            target=route,
            args=(weakref.ref(router), res.stop),
            name=f"multiproc-router-{self._tag}",
            daemon=True,
        )
        res.router = self._thread
        with state.lock:
            self._pool.start()
        self._thread.start()

    # ---------------------------------------------------------------- public API
    def run(self, units: Sequence, epoch: int = 0) -> Iterator[Any]:
        """Push ``units`` through the pipeline; iterate the items that come out.

        Only one run is active at a time; workers persist from one run to the next. Closing
        the iterator early (``break``, an exception in the consumer) closes the executor:
        create a new one to continue.
        """
        units = list(units)
        state = self._state
        with state.lock:
            self._check_open()
            if state.run is not None and not state.run.finished:
                raise ExecutorError(
                    "Executor.run: a run is already active; finish or close it first"
                )
            run = state.run = Run(units, epoch)
            for st in state.stages:
                st.closed = st.done = st.flush_sent = False
                st.order = Order()
                st.out_counter = 0
            for h in state.workers.values():
                if h.alive() and self.spec.stages[h.stage].stateful:
                    self._mail.send(h, P.Epoch(epoch))
        self._res.wake()
        return self._iterate(run)

    def resize(
        self, stage: str | int, n: int, remote: int | None = None, threads: int | None = None
    ) -> None:
        """Set a stage's worker count (within its bounds), and its workers' kinds, while
        running. Each kind starts or retires its own workers; what a retiring one holds it
        finishes: nothing is lost or run twice, and an ordered executor keeps its order.

        Args:
            stage: the stage's name or index.
            n: its workers, of every kind.
            remote: of ``n``, how many are offload workers (a stage with an ``offload``,
                :mod:`multiproc.offload`; at most ``offload.max_workers``). None keeps the
                current count (at most ``n``).
            threads: of the ``n - remote`` local workers, how many run as threads of this
                process (the rest as processes). None keeps as many as now of the kind the
                stage does not start as (``StageSpec.worker_type``; at most the local
                count), and the starting kind takes the rest.

        Example:
            >>> ex.resize("udf", 4, threads=4)  # all four of its workers threads
            >>> ex.resize("udf", 4, threads=0)  # and back to processes
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
        if why is None:
            far = min(n, self.remote_workers(i)) if remote is None else remote
            why = policy.threads_problem(n, far, threads)
        if why is not None:
            raise SpecError(f"resize(): stage {s.name!r}: {why}")
        self._command(("resize", i, n, remote, threads))

    def set_budget(self, stage: str | int, budget_bytes: int) -> None:
        """Set the byte budget of a stage's outbound channel while running."""
        i = self._stage_index(stage)
        s = self.spec.stages[i]
        lo, hi = policy.MIN_SHARE_BYTES, s.max_buffer_bytes
        assert hi is not None  # set by StageSpec
        if not isinstance(budget_bytes, int) or not lo <= budget_bytes <= hi:
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
        self._state.stages[i].concurrency = n  # read by concurrency(); the router tells workers
        self._command(("concurrency", i, n))

    def concurrency(self, stage: str | int) -> int:
        """Calls in flight per worker of the stage."""
        return self._state.stages[self._stage_index(stage)].concurrency

    def workers(self, stage: str | int) -> int:
        """The stage's target worker count."""
        return self._state.stages[self._stage_index(stage)].target

    def remote_workers(self, stage: str | int) -> int:
        """Of the stage's target worker count, its offload workers (:mod:`multiproc.offload`;
        0 for a stage without an offload)."""
        st = self._state.stages[self._stage_index(stage)]
        return min(st.remote, st.target)

    def threads(self, stage: str | int) -> int:
        """Of the stage's target worker count, its local workers that run as threads of this
        process (the rest of the local ones run as processes)."""
        return self._pool.want(self._stage_index(stage)).threads

    def budget(self, stage: str | int) -> int:
        """The byte budget of the stage's outbound channel."""
        return self._state.stages[self._stage_index(stage)].budget

    @property
    def stage_names(self) -> list[str]:
        return list(self._names)

    def fused(self) -> tuple[bool, ...]:
        """Per stage, whether it runs in the previous stage's workers (:mod:`multiproc.fusion`)."""
        return self._fusion.fused()

    def fusable(self) -> tuple[bool, ...]:
        """Per stage, whether :meth:`set_fused` may fuse it into the stage before it (given
        the stages fused now: a chain is at most ``stats.MAX_FUSED`` long)."""
        return self._fusion.fusable()

    def set_fused(self, stage: str | int, fused: bool) -> None:
        """Run ``stage``'s function in the previous stage's workers (True), or in its own
        workers again (False), while running; nothing is lost or run twice across the switch.

        Raises:
            SpecError: the stage cannot be fused into the one before it (says why).
        """
        j = self._stage_index(stage)
        if not isinstance(fused, bool):
            raise SpecError(f"set_fused(): fused must be a bool, got {fused!r}")
        with self._state.lock:
            self._check_open()
            if not self._fusion.switch(j, fused):
                return
        self._command(("fusion",))

    def started(self) -> bool:
        """Whether as many workers have started (said hello) as the stages that run their
        own (not fused) want."""
        state = self._state
        want = sum(st.target for st in state.stages if not state.fused[st.index])
        return len(state.start_latencies_ns) >= want

    def serving(self) -> bool:
        """Whether every stage that runs its own workers has as many started (said hello)
        as it starts with: the executor serves, while the rest of its workers start."""
        with self._state.lock:
            return self._pool.serving()

    def start_latencies_ms(self) -> list[float]:
        """Time from a worker's start request to its first message, for every worker so far."""
        with self._state.lock:
            return [x / 1e6 for x in self._state.start_latencies_ns]

    def busy(self, min_s: float = 0.0) -> list[Busy]:
        """The workers inside their stage function for at least ``min_s`` now, longest
        first: which stage, worker, for how long, on which item or unit. What to look at when
        nothing comes out."""
        with self._state.lock:
            if self._state.closed:
                raise self._closed_error("busy()")
            return self._faults.busy(time.monotonic_ns(), min_s)

    def snapshot(self, per_worker: bool = False) -> stats.Snapshot:
        """All counters now, without stopping anything."""
        now = time.monotonic_ns()
        state = self._state
        with state.lock:
            if state.closed:
                raise self._closed_error("snapshot()")
            stages = []
            fusable = self._fusion.fusable()
            for st in state.stages:
                live = [h for h in state.workers.values() if h.stage == st.index and h.alive()]
                kinds = {h.slot: h.kind for h in live}
                name = self._names[st.index]
                rows = [
                    stats.read_row(
                        name, slot, state.counters.row(slot), now, kinds.get(slot, "process")
                    )
                    for slot in sorted(st.slots)
                ]
                if st.retired is not None:
                    rows.append(stats.read_row(name, -1, st.retired, now))
                far = [r for r in rows if r.remote]
                near = [r for r in rows if r.thread]
                for part, retired, kind in ((far, st.retired_remote, "remote"),
                                            (near, st.retired_threads, "thread")):  # fmt: skip
                    if retired is not None:
                        part.append(stats.read_row(name, -1, retired, now, kind))
                rows += self._fusion.fused_rows(st.index, now)
                used = sum(state.seg_refs[h.seg_name] for h in live)
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
                        buffer_used_bytes=state.seg_bytes[st.index],
                        buffer_items=used,
                        queued_frames=queued,
                        per_worker=tuple(rows) if per_worker else (),
                        runq_ns=sum(r.runq_ns for r in rows),
                        hop_ns=sum(r.hop_ns for r in rows),
                        concurrency=st.concurrency,
                        fused=self._fusion.running_fused(st.index),
                        fusable=fusable[st.index],
                        placement=self.spec.stages[st.index].placement,
                        remote_workers=sum(h.remote and h.state != WS.RETIRING for h in live),
                        remotable=self.spec.stages[st.index].offload is not None,
                        threads=sum(h.kind == "thread" and h.state != WS.RETIRING for h in live),
                        **stats.kind_totals(far, near, rows),
                    )
                )
            return stats.Snapshot(now, tuple(stages), self._delivered_items, self._delivered_frames)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop every worker (within ``timeout_s``) and remove every shared-memory segment.

        Does nothing in a process forked from the owner (which shares none of its threads).
        """
        state = self._state
        if self._res.stop.is_set():
            state.closed = True  # released already (at interpreter exit, module globals may
            return  # be gone by the time a leftover run iterator is collected)
        if not self._is_owner(self._res.pid):
            return
        with state.lock:
            if state.closed:
                return
            state.closed = True
            state.cond.notify_all()
        self._res.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s + 2.0)
        self._finalizer()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- consumer side
    def _iterate(self, run: Run) -> Iterator[Any]:
        release = self._sink_release()
        try:
            while True:
                payload = self._next_frame(run)
                if payload is None:
                    return
                items = arena.decode(payload, self._state.cache, release)
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

    def _next_frame(self, run: Run) -> Any:
        state = self._state
        with state.cond:
            while True:
                if state.closed and not run.finished:
                    # Its frames live in segments the close removed.
                    raise self._closed_error("iterating a run")
                if state.error is not None:
                    raise state.error
                if run.sink:
                    was_full = run.sink.full(state.stages[-1].budget)
                    frame = run.sink.popleft()
                    self._ledger.frame_left(frame)
                    if frame.inline and was_full:
                        self._res.wake()  # the last stage may wait for room here (FrameQueue)
                    if not run.sink:
                        self._ledger.break_stall()  # the consumer held the last thing to move
                    return frame.payload
                if run.finished:
                    return None
                # Woken by the router on every delivery; the timeout only re-checks liveness.
                state.cond.wait(1.0)
                if not self._thread.is_alive() and state.error is None and not run.finished:
                    state.error = ExecutorError("the executor's router thread ended unexpectedly")

    def _sink_release(self) -> Callable[[arena.ShmRef], None]:
        """The release callback of delivered frames: holds the executor weakly (a tensor the
        user keeps must not keep the workers alive) and ignores a forked child's releases."""
        me = weakref.ref(self)
        frees, res = self._state.sink_frees, self._res

        def release(ref: arena.ShmRef) -> None:
            # Runs from a finalizer in whatever thread dropped the last reference.
            if me() is None or not lifetime.is_owner(res.pid):
                return
            frees.append((ref.segment, ref.offset))
            if not res.reporting:  # else the router takes it at the report it waits for
                res.wake()

        return release

    # ---------------------------------------------------------------- helpers
    def _stage_index(self, stage: str | int) -> int:
        if isinstance(stage, int) and not isinstance(stage, bool):
            if 0 <= stage < len(self._names):
                return stage
        elif stage in self._names:
            return self._names.index(stage)
        raise SpecError(f"no stage {stage!r}; stages are {self._names}")

    def _check_open(self) -> None:
        if self._state.closed:
            raise self._closed_error("this call")
        if self._state.error is not None:
            raise self._state.error

    def _closed_error(self, what: str) -> ExecutorClosedError:
        error = self._state.error
        why = f" after {type(error).__name__}: {error}" if error else ""
        e = ExecutorClosedError(
            f"Executor: {what} after close(): the executor was closed{why}; create a new one"
        )
        e.__cause__ = error
        return e

    def _command(self, cmd: Command) -> None:
        with self._state.lock:
            self._check_open()
            self._state.commands.append(cmd)
        self._res.wake()


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
