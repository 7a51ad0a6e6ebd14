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
import pickle
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as mp_wait
from typing import Any

from . import channel, lifetime, policy, pool, stats
from . import protocol as P
from .errors import (
    ExecutorClosedError,
    ExecutorError,
    RemoteTraceback,
    SpecError,
    StageError,
    StageTimeoutError,
    TooManyErrorsError,
    WorkerDiedError,
)
from .frames import Frame, Order, Run, StageState, Unit, inline_size
from .spec import ExecutorSpec, check_picklable, too_many_errors
from .worker import short_repr

log = logging.getLogger(__name__)

_MAX_SLOTS = 1024
_exec_ids = itertools.count()
_swept = threading.Event()  # stale segments are swept once per process


def _modules_of(fn: Any) -> list[str]:
    mods = [getattr(fn, "__module__", None), getattr(type(fn), "__module__", None)]
    return [m for m in mods if m and m != "builtins"]


@dataclass(frozen=True)
class Busy:
    """A worker inside its stage function now (see :meth:`Executor.busy`)."""

    stage: str
    worker: int
    pid: int
    seconds: float  # in the function, on this frame or unit
    work: str  # the item, frame or unit, in words

    def __str__(self) -> str:
        return (
            f"stage {self.stage!r} worker {self.worker} (pid {self.pid}) has been in its "
            f"function for {self.seconds:.1f} s on {self.work}"
        )


class Executor:
    """Runs an :class:`ExecutorSpec`; see the module docstring.

    Args:
        spec: the stages and options.
    """

    def __init__(self, spec: ExecutorSpec):
        if not isinstance(spec, ExecutorSpec):
            raise SpecError(f"Executor: spec must be an ExecutorSpec, got {type(spec).__name__}")
        self.spec = spec
        self._stage_bytes = [check_picklable(s) for s in spec.stages]
        if not _swept.is_set():
            _swept.set()
            stale = channel.sweep_stale_segments()
            if stale:
                log.info("removed %d shared-memory segments of dead processes", len(stale))
        # The modules that define the stage functions: the fork server imports them once
        # instead of every new worker importing them (what a resize costs).
        self._preload = tuple(
            dict.fromkeys(m for s in spec.stages for m in _modules_of(s.fn) if m != "__main__")
        )
        self._names = [s.name for s in spec.stages]
        self._timeouts = {i: s.timeout_s for i, s in enumerate(spec.stages) if s.timeout_s}
        self._tag = f"{os.getpid()}_{next(_exec_ids)}_{os.urandom(3).hex()}"
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._commands: collections.deque = collections.deque()
        self._sink_frees: collections.deque = collections.deque()
        self._free_slots = list(range(_MAX_SLOTS - 1, -1, -1))
        self._wids = itertools.count()
        self._frame_ids = itertools.count()
        self._workers: dict[int, pool.WorkerHandle] = {}
        self._by_seg: dict[str, int] = {}
        self._seg_refs: collections.Counter = collections.Counter()
        self._segments: set[str] = set()
        self._cache = channel.MappingCache()
        # Everything to give back, reachable by the finalizer from the first resource on: a
        # Ctrl-C anywhere below still releases what was made before it.
        self._res = pool.Resources(os.getpid(), self._workers, self._segments, self._cache)
        self._finalizer = weakref.finalize(self, self._res.release)
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
        res.counters = stats.CounterTable(f"ttp_{self._tag}_stats", _MAX_SLOTS, create=True)
        self._counters = res.counters
        self._stages = [
            StageState(i, s.workers, s.buffer_bytes, s.concurrency)
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
                for _ in range(st.target):
                    self._spawn(st.index)
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

    def resize(self, stage: str | int, n: int) -> None:
        """Set a stage's worker count (within its bounds) while running."""
        i = self._stage_index(stage)
        s = self.spec.stages[i]
        if not isinstance(n, int) or isinstance(n, bool):
            raise SpecError(f"resize(): stage {s.name!r}: n must be an int, got {n!r}")
        if not s.min_workers <= n <= s.max_workers:
            raise SpecError(
                f"resize(): stage {s.name!r}: n must be in [{s.min_workers}, {s.max_workers}], got {n}"
            )
        self._command(("resize", i, n))

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

    def budget(self, stage: str | int) -> int:
        return self._stages[self._stage_index(stage)].budget

    @property
    def stage_names(self) -> list[str]:
        return list(self._names)

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
            for st in self._stages:
                rows = [
                    stats.read_row(self._names[st.index], slot, self._counters.row(slot), now)
                    for slot in sorted(st.slots)
                ]
                if st.retired is not None:
                    rows.append(stats.read_row(self._names[st.index], -1, st.retired, now))
                live = [h for h in self._workers.values() if h.stage == st.index and h.alive()]
                used = sum(self._seg_refs[h.seg_name] for h in live)
                queued = len(st.ready)
                stages.append(
                    stats.StageSnapshot(
                        name=self._names[st.index],
                        workers=sum(1 for h in live if h.state != "retiring"),
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
                        concurrency=st.concurrency,
                    )
                )
            return stats.Snapshot(now, tuple(stages), self._delivered_items, self._delivered_frames)

    def busy(self, min_s: float = 0.0) -> list[Busy]:
        """The workers inside their stage function for at least ``min_s`` now, longest
        first: which stage, worker, for how long, on which item or unit. What to look at when
        nothing comes out."""
        with self._lock:
            if self._closed:
                raise self._closed_error("busy()")
            return self._busy(time.monotonic_ns(), min_s)

    def _busy(self, now: int, min_s: float, stages: set | None = None) -> list[Busy]:
        out = []
        for h in self._workers.values():
            if not h.alive() or (stages is not None and h.stage not in stages):
                continue
            row = self._counters.row(h.slot)
            since, work_id, item = (int(v) for v in row[stats.IN_FN_SINCE_NS : stats.WORK_ITEM + 1])
            secs = (now - since) / 1e9
            if not since or secs < min_s:
                continue
            out.append(Busy(self._names[h.stage], h.wid, h.pid, secs, self._work(h, work_id, item)))
        return sorted(out, key=lambda b: -b.seconds)

    def _work(self, h: pool.WorkerHandle, work_id: int, item: int) -> str:
        if not work_id:
            return "its current work"
        held = h.inflight.get(work_id - 1)
        if isinstance(held, Unit):
            at = f", at or after its item {item - 1}" if item > 1 else ""
            return f"work unit {short_repr(held.unit)}{at}"
        at = f"item {item - 1} of " if item else ""
        return f"{at}frame {work_id - 1}"

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop every worker (within ``timeout_s``) and remove every shared-memory segment.

        Does nothing in a process forked from the owner (which shares none of its threads).
        """
        if self._res.stop.is_set():
            self._closed = True  # released already (at interpreter exit, module globals may
            return  # be gone by the time a leftover run iterator is collected)
        if not lifetime.is_owner(self._res.pid):
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
                items = channel.decode(payload, self._cache, release)
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

        def release(ref: channel.ShmRef) -> None:
            # Runs from a finalizer in whatever thread dropped the last reference.
            if me() is None or not lifetime.is_owner(res.pid):
                return
            frees.append((ref.segment, ref.offset))
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

    def _wake(self) -> None:
        self._res.wake()

    def _send(self, h: pool.WorkerHandle, msg) -> None:
        h.post(P.wire(msg))

    # ---------------------------------------------------------------- worker lifecycle
    def _spawn(self, stage: int) -> None:
        s = self.spec.stages[stage]
        st = self._stages[stage]
        wid = next(self._wids)
        if not self._free_slots:
            raise ExecutorError(f"stage {s.name!r}: more than {_MAX_SLOTS} workers started")
        slot = self._free_slots.pop()
        seg_name = f"ttp_{self._tag}_w{wid}"
        size = s.max_buffer_bytes
        channel.create_segment(seg_name, size)
        self._segments.add(seg_name)
        index = sum(1 for h in self._workers.values() if h.stage == stage)
        h = pool.WorkerHandle(wid, stage, index, slot, seg_name, thread=s.worker_type == "thread")
        self._by_seg[seg_name] = wid
        self._workers[wid] = h
        st.slots.add(slot)
        n_alive = max(1, self._n_active(stage) + 1)
        args = (
            self._stage_bytes[stage],
            wid,
            slot,
            index,
            f"ttp_{self._tag}_stats",
            _MAX_SLOTS,
            seg_name,
            size,
            policy.budget_share(st.budget, n_alive),
        )
        h.start_ns = time.monotonic_ns()
        pool.start_worker(h, args, self._preload)
        if self._run is not None:
            self._send(h, P.Epoch(self._run.epoch))  # stateful stages seed by epoch
        if st.concurrency != s.concurrency:
            self._send(h, P.Concurrency(st.concurrency))
        self._rebudget(stage)

    def _active(self, stage: int) -> list[pool.WorkerHandle]:
        """The stage's workers that take work (starting or ready; not retiring)."""
        return [
            h
            for h in self._workers.values()
            if h.stage == stage and h.state in ("starting", "ready")
        ]

    def _n_active(self, stage: int) -> int:
        return len(self._active(stage))

    def _rebudget(self, stage: int) -> None:
        active = self._active(stage)
        if not active:
            return
        share = policy.budget_share(self._stages[stage].budget, len(active))
        for h in active:
            self._send(h, P.Budget(share))

    def _resize(self, stage: int, n: int) -> None:
        st = self._stages[stage]
        st.target = n
        active = self._active(stage)
        for _ in range(n - len(active)):
            self._spawn(stage)
        if len(active) > n:
            for h in policy.to_retire(active, len(active) - n):
                h.state = "retiring"
                self._send(h, P.Retire())
            self._rebudget(stage)

    def _on_gone(self, h: pool.WorkerHandle, died: bool, why: str = "") -> None:
        """A worker ended: re-deliver what it held; replace it if it died."""
        s = self.spec.stages[h.stage]
        st = self._stages[h.stage]
        prev = h.state
        h.state = "dead" if died else "gone"
        h.close_outbox(timeout_s=0.5)  # the peer is gone: a pending send fails at once
        try:
            h.conn.close()
        except Exception:
            pass
        if h.proc is not None and not h.thread:
            h.proc.join(0.1)
        run = self._run
        if died:
            st.restarts += 1
            log.warning(
                "stage %r worker %d (pid %d) %s; re-delivering %d frames",
                s.name,
                h.wid,
                h.pid,
                why,
                len(h.inflight) + len(h.held),
            )
        # Everything it held goes back to the front of its stage's queue, in sequence order.
        back = list(h.inflight.values()) + list(h.held.values())
        keep = set()
        for f in h.held.values():
            self._pending_count[f.producer] += 1  # queued again
            if f.payload[0] == "shm":
                keep.add((f.payload[1].segment, f.payload[1].offset))
        h.inflight.clear()
        h.held.clear()
        if s.kind == "source":
            for u in sorted(back, key=lambda u: u.pos, reverse=True):
                run.units.appendleft(u)
        else:
            for f in sorted(back, key=lambda f: f.seq, reverse=True):
                f.skip = frozenset(f.consumed)
                st.ready.appendleft(f)
        # Frames it consumed but had not yet released: it never will (held frames excepted:
        # they are delivered again from the same memory).
        for seg, off in list(h.owes - keep):
            self._free(seg, off)
        h.owes.clear()
        self._retire_slot(h)
        if h.flushing:
            h.flushing = False
            st.flush_sent = False  # flush again once the re-delivered frames are through
        self._maybe_unlink(h.seg_name)
        if died:
            if st.restarts > self.spec.max_restarts:
                raise WorkerDiedError(
                    f"stage {s.name!r} worker {h.wid} (pid {h.pid}) {why}; {st.restarts} worker "
                    f"deaths in this stage exceed max_restarts={self.spec.max_restarts}"
                )
            if prev != "retiring" and not self._closed:
                self._spawn(h.stage)

    def _retire_slot(self, h: pool.WorkerHandle) -> None:
        """Fold a finished worker's counters into its stage's totals and reuse its slot."""
        st = self._stages[h.stage]
        if h.slot not in st.slots:
            return
        row = self._counters.row(h.slot)
        if st.retired is None:
            st.retired = row.copy()
            st.retired[stats.STARTED_NS] = 0
        else:
            add = row.copy()
            for c in (stats.PID, stats.STARTED_NS):
                add[c] = 0
            st.retired += add
        st.retired[stats.PID] = 0
        row[:] = 0
        st.slots.discard(h.slot)
        self._free_slots.append(h.slot)

    def _maybe_unlink(self, seg: str) -> None:
        wid = self._by_seg.get(seg)
        h = self._workers.get(wid)
        if h is not None and not h.alive() and self._seg_refs[seg] <= 0:
            channel.remove_segment(seg)
            self._segments.discard(seg)
            self._cache.drop(seg)
            # Consumers still map it; their mapping keeps its pages alive until dropped.
            for c in self._workers.values():
                if c.stage == h.stage + 1 and c.alive():
                    self._send(c, P.Drop(seg))
            del self._by_seg[seg]
            del self._workers[wid]

    # ---------------------------------------------------------------- accounting
    def _free(self, seg: str, off: int) -> None:
        wid = self._by_seg.get(seg)
        if wid is None:
            return
        self._seg_refs[seg] -= 1
        h = self._workers[wid]
        self._seg_bytes[h.stage] -= self._sizes.pop((seg, off), 0)
        if h.alive():
            self._pending_free.setdefault(wid, []).append(off)
        else:
            self._maybe_unlink(seg)

    def _flush_frees(self) -> None:
        pf = self._pending_free
        if not pf:
            return
        for wid, offs in pf.items():
            h = self._workers.get(wid)
            if h is not None and h.alive():
                self._send(h, P.Free(offs))
        pf.clear()

    def _new_frame(self, seq, payload, n, producer: int, stage: int) -> Frame:
        f = Frame(next(self._frame_ids), seq, payload, n, producer, inline=inline_size(payload))
        if payload[0] == "shm":
            ref = payload[1]
            self._seg_refs[ref.segment] += 1
            self._seg_bytes[stage] += ref.size
            self._sizes[(ref.segment, ref.offset)] = ref.size
        self._pending_count[producer] += 1
        return f

    def _frame_left(self, f: Frame) -> None:
        """A frame stopped being queued or in flight (it is consumed or held)."""
        self._pending_count[f.producer] -= 1
        h = self._workers.get(f.producer)
        if (
            h is not None
            and h.blocked
            and policy.may_spill(self._pending_count[f.producer])
            and h.alive()
        ):
            self._spill_ok(h)

    def _spill_ok(self, h: pool.WorkerHandle) -> None:
        self._send(h, P.SpillOk())
        h.blocked = False

    def _break_stall(self) -> None:
        """Let blocked workers through when nothing else can move (see ``policy``)."""
        run = self._run
        if run is None or run.finished or not any(h.blocked for h in self._workers.values()):
            return
        for h in policy.stalled(self._workers.values(), len(run.sink)):
            self._spill_ok(h)

    # ---------------------------------------------------------------- routing
    def _deliver(self, stage: int, f: Frame) -> None:
        """Hand a frame produced by ``stage`` to the next stage (or the sink)."""
        nxt = stage + 1
        run = self._run
        if nxt == len(self.spec.stages):
            if self.spec.ordered:
                run.sink_order.put(f, run.sink, run.unit_frames)
            else:
                run.sink.append(f)
            self._cond.notify_all()
            return
        st = self._stages[nxt]
        if self.spec.ordered and self.spec.stages[nxt].stateful:
            st.order.put(f, st.ready, run.unit_frames)
        else:
            st.ready.append(f)

    def _dispatch(self) -> None:
        run = self._run
        if run is None or run.finished:
            return
        credits = self.spec.credits
        for i, s in enumerate(self.spec.stages):
            st = self._stages[i]
            ready = [h for h in self._workers.values() if h.stage == i and h.state == "ready"]
            if not ready:
                continue
            after = self._stages[i + 1].ready if i + 1 < len(self._stages) else run.sink
            if after.full(st.budget):
                continue  # see FrameQueue
            if s.kind == "source":
                while run.units:
                    h = policy.pick_worker(ready, credits)
                    if h is None:
                        break
                    u = run.units.popleft()
                    h.inflight[u.id] = u
                    self._send(h, P.Unit(u.id, u.unit, u.committed))
                continue
            while st.ready:
                h = policy.pick_worker(ready, credits)
                if h is None:
                    break
                f = st.ready.popleft()
                if s.stateful:
                    st.flush_sent = False  # input after a flush: flush again at the end
                h.inflight[f.id] = f
                self._send(h, P.Run(f.id, f.payload, f.skip))

    def _check_progress(self) -> None:
        """Close stages whose input is exhausted; flush stateful ones; finish the run."""
        run = self._run
        if run is None or run.finished:
            return
        for i, s in enumerate(self.spec.stages):
            st = self._stages[i]
            if st.done:
                continue
            ws = [h for h in self._workers.values() if h.stage == i and h.alive()]
            busy = any(h.inflight for h in ws)
            if i == 0:
                st.closed = run.units_done == run.n_units
            else:
                st.closed = self._stages[i - 1].done
            if not st.closed or busy or st.ready or st.order.frames:
                return
            if s.stateful:
                if any(h.state == "starting" for h in ws):
                    return
                if not st.flush_sent:
                    st.flush_sent = True
                    for h in ws:
                        if h.state == "ready":
                            h.flushing = True
                            self._send(h, P.Flush())
                if any(h.flushing for h in ws) or st.ready or any(h.held for h in ws):
                    return
            st.done = True
        if run.sink_order.frames:
            return
        run.finished = True
        self._cond.notify_all()

    # ---------------------------------------------------------------- messages
    def _on_message(self, h: pool.WorkerHandle, raw: tuple) -> None:
        try:
            msg = P.read(raw)
        except ValueError as e:
            s = self.spec.stages[h.stage]
            raise ExecutorError(f"stage {s.name!r} worker {h.wid}: {e}") from None
        match msg:
            case P.Hello():
                if h.state == "starting":
                    h.state = "ready"
                h.ready_ns = time.monotonic_ns()
                self._start_latencies_ns.append(h.ready_ns - h.start_ns)
            case P.Emit(_, uid, k, payload, n):
                u = h.inflight.get(uid)
                if u is not None:
                    u.committed = k + 1
                    self._deliver(
                        h.stage, self._new_frame((0, u.pos, k), payload, n, h.wid, h.stage)
                    )
            case P.UnitDone(_, uid, total, frees):
                self._take_frees(h, frees)
                u = h.inflight.pop(uid, None)
                if u is not None:
                    self._run.unit_frames[(0, u.pos)] = total
                    self._run.units_done += 1
                    if self.spec.ordered:
                        self._drain_all_reorders()
            case P.Done() | P.Flushed() | P.Handoff():
                self._on_outputs(h, msg)
            case P.Frees(_, frees):
                self._take_frees(h, frees)
            case P.Blocked(_, frees):
                h.blocked = True
                self._take_frees(h, frees)
                if policy.may_spill(self._pending_count[h.wid]):
                    self._spill_ok(h)
            case P.Unblocked():
                h.blocked = False
            case P.Bye(_, frees):
                self._take_frees(h, frees)
                h.state = "gone"
            case P.Error(_, _, exc_bytes, tname, text, tb, where):
                name = self.spec.stages[h.stage].name
                self._error = self._make_error(name, h, exc_bytes, tname, text, tb, where)
            case P.Skipped(_, where, tname, text):
                self._on_skipped(h, where, tname, text)
            case _:
                name = self.spec.stages[h.stage].name
                raise ExecutorError(f"stage {name!r} worker {h.wid} sent {msg!r}")

    def _on_outputs(self, h: pool.WorkerHandle, msg: P.Done | P.Flushed | P.Handoff) -> None:
        """A frame done, a reducer flushed, or a retiring reducer's items handed back."""
        run = self._run
        i = h.stage
        s = self.spec.stages[i]
        st = self._stages[i]
        f_in = None
        if type(msg) is P.Done:
            f_in = h.inflight.pop(msg.frame_id, None)
            if f_in is None:
                raise ExecutorError(
                    f"stage {s.name!r} worker {h.wid} finished unknown frame {msg.frame_id}"
                )
            self._frame_left(f_in)
            if f_in.payload[0] == "shm":
                h.owes.add((f_in.payload[1].segment, f_in.payload[1].offset))
            if s.stateful:
                h.held[msg.frame_id] = f_in
        if msg.consumed:
            for cfid, idxs in msg.consumed.items():
                f = h.held.get(cfid)
                if f is None:
                    continue
                f.consumed.update(idxs)
                if len(f.consumed) >= f.n:
                    del h.held[cfid]
        if type(msg) is P.Flushed:
            h.held.clear()  # a flushed reducer holds nothing
        self._take_frees(h, msg.frees)
        handoff = type(msg) is P.Handoff
        for payload, n in msg.outs:
            if s.stateful:
                seq = (i + 1, st.out_counter, 0)
                if not handoff:
                    run.unit_frames[(i + 1, st.out_counter)] = 1
                    st.out_counter += 1
                f = self._new_frame(seq, payload, n, h.wid, i)
                if handoff:
                    # Items given back by a retiring worker re-enter their own stage.
                    f.seq = (-1, f.id, 0)
                    st.ready.appendleft(f)
                else:
                    self._deliver(i, f)
            else:
                self._deliver(i, self._new_frame(f_in.seq, payload, n, h.wid, i))
        if type(msg) is P.Flushed:
            h.flushing = False
        if self.spec.ordered:
            self._drain_all_reorders()

    def _on_skipped(self, h: pool.WorkerHandle, where: str, tname: str, text: str) -> None:
        """Count a skip (on_error='skip'); log the first; past max_errors, fail the run."""
        s = self.spec.stages[h.stage]
        st = self._stages[h.stage]
        st.skipped += 1
        st.last_errors.append(f"worker {h.wid}, {where}: {tname}: {text}")
        if st.skipped == 1:
            log.warning(
                "stage %r skipped an item (on_error='skip'; more are counted in the stage's "
                "errors): worker %d, %s: %s: %s", s.name, h.wid, where, tname, text,
            )  # fmt: skip
        items_in = sum(int(self._counters.row(slot)[stats.ITEMS_IN]) for slot in st.slots)
        if st.retired is not None:
            items_in += int(st.retired[stats.ITEMS_IN])
        if self._error is None and too_many_errors(st.skipped, items_in, s.max_errors):
            last = "; ".join(st.last_errors)
            self._error = TooManyErrorsError(
                f"stage {s.name!r}: {st.skipped} items skipped of {items_in} taken in, more "
                f"than max_errors={s.max_errors!r} allows; last errors: {last}"
            )

    def _drain_all_reorders(self) -> None:
        run = self._run
        for st in self._stages:
            if st.order.frames:
                st.order.drain(st.ready, run.unit_frames)
        if run.sink_order.frames:
            before = len(run.sink)
            run.sink_order.drain(run.sink, run.unit_frames)
            if len(run.sink) != before:
                self._cond.notify_all()

    def _take_frees(self, h: pool.WorkerHandle, frees) -> None:
        for seg, off in frees or ():
            h.owes.discard((seg, off))
            self._free(seg, off)

    def _make_error(self, stage: str, h, exc_bytes, tname, text, tb, where) -> BaseException:
        note = f"in stage {stage!r}, worker {h.wid} (pid {h.pid}), {where}"
        exc = None
        if exc_bytes is not None:
            try:
                exc = pickle.loads(exc_bytes)
            except Exception:
                exc = None
        if exc is None:
            exc = StageError(f"{tname}: {text} ({note})")
        exc.__cause__ = RemoteTraceback(f'\n"""\n{tb}"""')
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised {note}")
        exc.stage = stage
        exc.worker = h.wid
        return exc

    # ---------------------------------------------------------------- the router loop
    @staticmethod
    def _route(ref: weakref.ref, stop: threading.Event) -> None:
        """The router thread: holds the executor only while it handles events, never while it
        waits, so that dropping the last reference elsewhere collects the executor."""
        ex = ref()
        try:
            while ex is not None and not stop.is_set():
                waitables, handles, timeout = ex._waitables()
                if waitables is None:
                    return
                del ex  # may run the finalizer here, in this thread: it sets ``stop``
                if stop.is_set():
                    return
                # Every event that matters (a message, a death, a command, a release by the
                # consumer, the finalizer) makes one of these ready; the timeout is only the
                # deadline of a stage's timeout_s.
                ready = mp_wait(waitables, timeout)
                if stop.is_set():
                    return
                ex = ref()
                if ex is None or not ex._on_ready(ready, handles):
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

    def _waitables(self) -> tuple[list | None, list, float | None]:
        with self._lock:
            if self._closed:
                return None, [], None
            handles = [h for h in self._workers.values() if h.alive()]
            timeout = self._next_deadline_s(handles)
        waitables = [self._res.wake_r]
        for h in handles:
            waitables.append(h.conn)
            if h.sentinel is not None:
                waitables.append(h.sentinel)
        return waitables, handles, timeout

    def _next_deadline_s(self, handles: list) -> float | None:
        """Seconds until a busy worker of a stage with ``timeout_s`` would pass it."""
        if not self._timeouts or self._error is not None:
            return None
        now = time.monotonic_ns()
        soonest = None
        for h in handles:
            limit = self._timeouts.get(h.stage)
            if limit is None or not h.inflight:
                continue
            since = int(self._counters.row(h.slot)[stats.IN_FN_SINCE_NS])
            left = limit - (now - since) / 1e9 if since else limit
            soonest = left if soonest is None else min(soonest, left)
        return None if soonest is None else max(soonest, 0.005)

    def _check_timeouts(self) -> None:
        limits = self._timeouts
        if not limits or self._error is not None:
            return
        busy = self._busy(time.monotonic_ns(), min(limits.values()), set(limits))
        stuck = [b for b in busy if b.seconds > limits[self._names.index(b.stage)]]
        if stuck:
            b = stuck[0]
            limit = limits[self._names.index(b.stage)]
            self._error = StageTimeoutError(
                f"{b} (timeout_s={limit:g}); it is stopped when the executor closes", tuple(stuck)
            )

    def _on_ready(self, ready: list, handles: list) -> bool:
        """Handle what woke the router; False when the executor is closed."""
        wake_r = self._res.wake_r
        with self._cond:
            if self._closed:
                return False
            if wake_r in ready:
                try:
                    os.read(wake_r, 65536)
                except BlockingIOError:
                    pass
            conn_of = {id(h.conn): h for h in handles}
            sent_of = {h.sentinel: h for h in handles if h.sentinel is not None}
            dead = []
            for r in ready:
                if r == wake_r:
                    continue
                h = conn_of.get(id(r))
                if h is not None:
                    self._drain_conn(h, dead)
                    continue
                h = sent_of.get(r)
                if h is not None:
                    # Read what it sent before dying: committed work counts.
                    self._drain_conn(h, dead)
                    if h not in dead:
                        dead.append(h)
            for h in dead:
                if h.alive() or h.state == "gone":
                    self._finish_worker(h)
            while self._commands:
                cmd = self._commands.popleft()
                if cmd[0] == "resize":
                    self._resize(cmd[1], cmd[2])
                elif cmd[0] == "budget":
                    self._stages[cmd[1]].budget = cmd[2]
                    self._rebudget(cmd[1])
                elif cmd[0] == "concurrency":
                    for h in self._workers.values():
                        if h.stage == cmd[1] and h.state in ("starting", "ready"):
                            self._send(h, P.Concurrency(cmd[2]))
            while self._sink_frees:
                seg, off = self._sink_frees.popleft()
                self._free(seg, off)
            self._check_timeouts()
            if self._error is None:
                self._dispatch()
                self._check_progress()
                self._break_stall()
            self._flush_frees()
            if self._error is not None:
                self._cond.notify_all()
        return True

    def _drain_conn(self, h: pool.WorkerHandle, dead: list) -> None:
        try:
            while h.conn.poll():
                msg = h.conn.recv()
                self._on_message(h, msg)
                if h.state == "gone":
                    if h not in dead:
                        dead.append(h)
                    return
        except (EOFError, OSError, pickle.UnpicklingError):
            if h not in dead:
                dead.append(h)

    def _finish_worker(self, h: pool.WorkerHandle, why: str | None = None) -> None:
        if h.state == "gone":
            self._on_gone(h, died=False)
            pool.stop_worker(h, 1.0)
            return
        if not h.thread:
            h.proc.join(0.5)
        if why is None:
            why = pool.describe_exit(h)
        if h.state == "retiring" and not h.inflight and not h.held:
            self._on_gone(h, died=False)
            return
        if self._closed or self._res.stop.is_set():
            return
        self._on_gone(h, died=True, why=why)
