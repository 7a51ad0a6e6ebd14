"""Workers come and go: spawn, resize, retire, and recovery of what a dead one held.

:class:`WorkerPool` starts worker processes (or threads) in free counter slots, splits a
stage's budget among them, retires the ones :func:`multiproc.policy.to_retire` picks when a
stage shrinks, and, when one ends, puts every frame, unit or stateful holding it had back at
the front of its stage's queue, so each is delivered again exactly once (a source's committed
frames are skipped). :func:`start_server` and :func:`pickle_stages` prepare, once per
executor, what every worker starts from (:class:`Launch`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arena, buffers, handles, offload, policy, servers, shm, stats
from . import protocol as P
from .errors import (
    ExecutorClosedError,
    ExecutorError,
    WorkerDiedError,
)
from .frames import WorkerState as WS
from .ledger import Ledger
from .mail import Mail
from .snapshot import Snapshot, forks
from .spec import ExecutorSpec, StageSpec, check_picklable, fused_depth, imported_modules
from .state import ExecutorState

log = logging.getLogger("multiproc.executor")

MAX_SLOTS = 1024  # workers ever started by one executor (counter slots are reused)
# Process workers a stage starts with; the rest start one per router turn (WorkerPool.ramp).
START_WORKERS = 2


def start_server(
    spec: ExecutorSpec, snapshot: Snapshot | None, keep_snapshot: bool = False
) -> tuple[Snapshot | None, tuple[str, ...]]:
    """Where process workers come from: ``snapshot`` (or one taken now) of this process, whose
    stage functions they inherit (:mod:`multiproc.snapshot`); or, where this process must not
    be forked (``start_method="spawn"``, ``MULTIPROC_FORKSERVER=spawn``,
    :func:`~multiproc.servers.fork_unsafe`), multiprocessing's spawned server, which imports
    the modules the stage pickles name once instead of every new worker importing them.

    Returns:
        The snapshot workers fork from (None: the spawned server; ``snapshot`` is stopped
        unless ``keep_snapshot``: the caller's), and the modules that server imports (empty
        for a snapshot).
    """
    stages = [offload.local_spec(s) if s.offload else s for s in spec.stages]
    if forks(spec):
        return (snapshot if snapshot is not None else Snapshot.take(stages)), ()
    if snapshot is not None and not keep_snapshot:
        snapshot.stop()
    if all(s.starts_as_threads for s in stages):
        return None, ()
    try:
        light = [buffers.dumps_light(s) for s in stages]
    except Exception:  # check_picklable names the stage that does not pickle, next
        return None, ()
    preload = tuple(dict.fromkeys(m for b in light for m in imported_modules(b)))
    servers.ensure_server(preload)
    return None, preload


def pickle_stages(
    spec: ExecutorSpec, snapshot: Snapshot | None, shared: buffers.BufferFile
) -> tuple[list[bytes], list[bytes | StageSpec]]:
    """Each stage as its local workers get it (a stage with an offload: its local workers'
    spec), for process workers and for thread workers.

    Process workers of a snapshot get references to the snapshot's copy of the stage's
    functions, others a pickle by value (large arrays in ``shared``, :mod:`multiproc.buffers`).
    Thread workers of a thread stage get a pickle by value (each its own copy) unless its
    ``thread_copies`` is False; those of a process or ``auto`` stage, and those, the spec
    itself, this process's own (nothing pickled: what does not pickle works, as in a forked
    worker).

    Returns:
        Per stage, its process workers' pickle and its thread workers' form.
    """
    procs: list[bytes] = []
    threads: list[bytes | StageSpec] = []
    for s in spec.stages:
        local = offload.local_spec(s) if s.offload else s
        by_ref = None if snapshot is None else check_picklable(local, dumps=snapshot.dumps)
        if s.starts_as_threads and s.thread_copies:
            by_value = check_picklable(local, shared)
            procs.append(by_value if by_ref is None else by_ref)
            threads.append(by_value)
        elif s.starts_as_threads and by_ref is None:
            # Its threads share this process's stage; without a snapshot nothing pickles it
            # (it need not pickle): a process worker of it fails at its start, saying why.
            procs.append(b"")
            threads.append(local)
        else:
            procs.append(check_picklable(local, shared) if by_ref is None else by_ref)
            threads.append(local)
    return procs, threads


@dataclass(frozen=True)
class Launch:
    """What every worker of the executor starts from, fixed for the executor's life: kept
    whole while it runs, so a worker of any kind can start at any time (the snapshot's
    server, each stage's forms)."""

    snapshot: Snapshot | None  # process workers fork from its server (None: spawned server)
    preload: tuple[str, ...]  # modules the spawned server imports (start_server)
    process_stages: list[bytes]  # per stage, its local process workers' pickle (pickle_stages)
    thread_stages: list[bytes | StageSpec]  # per stage, its local thread workers' form
    offload_bytes: dict[int, bytes]  # per stage with an offload, its offload workers' pickle
    process_chains: list[tuple[bytes, ...]]  # per stage, the stages it may run too, as above
    thread_chains: list[tuple[bytes | StageSpec, ...]]

    def worker_args(self, stage: int, kind: policy.WorkerKind) -> tuple[Any, tuple[Any, ...]]:
        """What a worker of ``kind`` of ``stage`` runs: its stage's form, and its chain's."""
        if kind == "process":
            return self.process_stages[stage], self.process_chains[stage]
        if kind == "remote":
            return self.offload_bytes[stage], ()  # an offload stage hosts no fused stage
        return self.thread_stages[stage], self.thread_chains[stage]


def _closed_while_starting() -> ExecutorClosedError:
    return ExecutorClosedError("the executor was closed while its workers were starting")


class WorkerPool:
    """Worker lifecycle of the executor (see the module docstring). Callers hold the
    executor's lock."""

    def __init__(self, state: ExecutorState, mail: Mail, ledger: Ledger, launch: Launch) -> None:
        self.state = state
        self.mail = mail
        self.ledger = ledger
        self.launch = launch

    def spawn(self, stage: int, kind: policy.WorkerKind = "process") -> None:
        """Start a worker of ``stage`` of ``kind``: a local process or thread, or an offload
        worker (``"remote"``)."""
        state = self.state
        s = state.spec.stages[stage]
        st = state.stages[stage]
        wid = next(state.wids)
        if not state.free_slots:
            raise ExecutorError(f"stage {s.name!r}: more than {MAX_SLOTS} workers started")
        slot = state.free_slots.pop()
        seg_name = f"ttp_{state.tag}_w{wid}"
        size = s.max_buffer_bytes
        assert size is not None  # set by StageSpec
        state.segments.add(seg_name)  # first: removed at close even if Ctrl-C lands below
        arena.create_segment(seg_name, size)
        if state.res.stop.is_set():
            # Closed meanwhile (its finalizer, at the interpreter's exit): the close's removal
            # of the segments may have run before this one was made.
            arena.remove_segment(seg_name)
            state.segments.discard(seg_name)
            raise _closed_while_starting()
        index = sum(1 for h in state.workers.values() if h.stage == stage)
        h = handles.WorkerHandle(
            wid, stage, index, slot, seg_name, thread=kind != "process", remote=kind == "remote"
        )
        state.by_seg[seg_name] = wid
        state.workers[wid] = h
        st.slots.add(slot)
        n_alive = max(1, self.n_active(stage) + 1)
        launch = self.launch

        form, chain = launch.worker_args(stage, kind)

        def start_it() -> None:
            if not h.thread:
                self._check_server()
            args = (
                [form],  # in a list the worker empties (worker._Worker)
                wid,
                slot,
                index,
                f"ttp_{state.tag}_stats",
                MAX_SLOTS,
                seg_name,
                size,
                policy.budget_share(st.budget, n_alive),
                chain,
                # A local thread's frames for the consumer stay objects (arena.keep).
                len(state.spec.stages) - 1 - stage if kind == "thread" else -1,
            )
            h.start_ns = time.monotonic_ns()
            server = None if launch.snapshot is None else launch.snapshot.server
            handles.start_worker(h, args, server, launch.preload)

        try:
            start_it()
        except (EOFError, OSError):
            # A fork server killed a moment ago can still look alive to waitpid: once it is
            # reaped, launch again through its successor.
            snap = launch.snapshot
            if snap is not None and snap.stopped:
                raise _closed_while_starting() from None
            if h.thread or snap is None or not snap.server.wait_ended():
                raise
            log.warning("stage %r: the fork server ended while starting a worker", s.name)
            start_it()
        depth = fused_depth(state.fused, stage)
        if depth:
            self.mail.send(h, P.Fuse(depth))
        if state.run is not None:
            self.mail.send(h, P.Epoch(state.run.epoch))  # stateful stages seed by epoch
        if st.concurrency != s.concurrency:
            self.mail.send(h, P.Concurrency(st.concurrency))
        self.rebudget(stage)

    def _check_server(self) -> None:
        """Before a process worker starts: the snapshot's server still runs, else (killed)
        another is forked from this process now."""
        snap = self.launch.snapshot
        if snap is None or not snap.server.ended():
            return
        ended = snap.server.pid
        snap.renew()  # raises ExecutorClosedError where its executor closed meanwhile
        log.warning(
            "the fork server %d of the stages' workers ended; forked another from this "
            "process (workers started from now on see it as it is now)",
            ended,
        )

    def _ramps(self, stage: int) -> bool:
        """Whether the stage's process workers start a few at first and the rest while it
        runs (each is a fork of the snapshot, ~10-20 ms for a process of a GB, made one at a
        time by its server); its other workers start at once, as do a stage's with an offload."""
        return self.state.spec.stages[stage].offload is None

    def want(self, stage: int) -> policy.Mix:
        """The workers the stage is to run, by kind."""
        st = self.state.stages[stage]
        remote = min(st.remote, st.target)
        threads = min(st.threads, st.target - remote)
        return policy.Mix(st.target - remote - threads, threads, remote)

    def have(self, stage: int) -> policy.Mix:
        """The stage's active workers (starting or ready), by kind."""
        got = {k: len(self.active(stage, k)) for k in policy.WORKER_KINDS}
        return policy.Mix(got["process"], got["thread"], got["remote"])

    def first_workers(self, stage: int) -> int:
        """How many workers the stage starts with (see :meth:`ramp`)."""
        want = self.want(stage)
        if not self._ramps(stage):
            return want.total
        return want.total - want.processes + min(want.processes, START_WORKERS)

    def start(self) -> None:
        """Start every stage's first workers (of its own, not fused), each kind as wanted."""
        for st in self.state.stages:
            i = st.index
            if self.state.fused[i]:
                continue
            want = self.want(i)
            first = {k: want.of(k) for k in policy.WORKER_KINDS}
            first["process"] = self.first_workers(i) - want.threads - want.remote
            for kind in policy.WORKER_KINDS:
                for _ in range(first[kind]):
                    self.spawn(i, kind)

    def ramp(self) -> None:
        """On a router turn: start one more process worker of the first stage short of its
        target. The executor starts with :data:`START_WORKERS` per stage, and those serve
        while the others fork, one per turn, with the router handling events in between
        (instead of every worker forked before the first one gets work)."""
        for st in self.state.stages:
            i = st.index
            if self.state.fused[i] or not self._ramps(i):
                continue
            if self.have(i).processes >= self.want(i).processes:
                continue
            self.spawn(i, "process")
            self.state.res.wake()  # another turn soon, for the next one
            return

    def fill(self, stage: int) -> None:
        """Start the workers ``stage`` is short of, each kind as wanted (it runs its own
        workers again after it was fused)."""
        plan = policy.resize_plan(self.have(stage), self.want(stage))
        for kind in policy.WORKER_KINDS:
            for _ in range(plan[kind].start):
                self.spawn(stage, kind)

    def next_kind(self, stage: int) -> policy.WorkerKind:
        """The kind of the next worker of ``stage`` to start: one it is short of, else its
        starting kind."""
        starts: policy.WorkerKind = (
            "thread" if self.state.spec.stages[stage].starts_on_threads else "process"
        )
        return policy.next_kind(self.have(stage), self.want(stage), starts)

    def serving(self) -> bool:
        """Whether every stage that runs its own workers has as many started (said hello)
        as it starts with."""
        state = self.state
        for st in state.stages:
            if state.fused[st.index]:
                continue
            hello = sum(1 for h in state.workers.values() if h.stage == st.index and h.ready_ns)
            if hello < self.first_workers(st.index):
                return False
        return True

    def active(
        self, stage: int, kind: policy.WorkerKind | None = None
    ) -> list[handles.WorkerHandle]:
        """The stage's workers that take work (starting or ready; not retiring): all, or
        only those of ``kind``."""
        return [
            h
            for h in self.state.workers.values()
            if h.stage == stage
            and h.state in (WS.STARTING, WS.READY)
            and (kind is None or h.kind == kind)
        ]

    def retiring(self, stage: int) -> bool:
        """Whether a worker of ``stage`` is retiring (finishing what it holds)."""
        return any(h.stage == stage and h.state == WS.RETIRING for h in self.state.workers.values())

    def n_active(self, stage: int) -> int:
        return len(self.active(stage))

    def rebudget(self, stage: int) -> None:
        """Tell the stage's active workers their share of its budget."""
        active = self.active(stage)
        if not active:
            return
        share = policy.budget_share(self.state.stages[stage].budget, len(active))
        for h in active:
            self.mail.send(h, P.Budget(share))

    def set_budget(self, stage: int, budget_bytes: int) -> None:
        """A budget for ``stage`` (Executor.set_budget's), within what the shared-memory
        directory leaves this executor (shm.Room)."""
        stages = self.state.stages
        others = sum(st.budget for st in stages if st.index != stage)
        stages[stage].budget = self.state.room.clamp(budget_bytes, others)
        self.rebudget(stage)

    def on_no_room(self, stage: int) -> None:
        """A worker of ``stage`` found the shared-memory directory full: read its free bytes
        again and lower the budgets to fit (workers give back the pages they hold beyond); the
        frame that did not fit waits for room or travels through the pipe."""
        state = self.state
        room = state.room
        held = sum(state.seg_bytes.values())
        if not room.refit(held):
            return
        size, free = shm.usage(room.path)
        log.warning(
            "stage %r: %s is full (%.1f of %.1f MiB free): channel budgets lowered to fit "
            "%.1f MiB; frames that do not fit travel through the workers' pipes (slower). "
            "See docker run --shm-size, or %s",
            state.names[stage],
            room.path,
            free / (1 << 20),
            size / (1 << 20),
            (room.cap_bytes or 0) / (1 << 20),
            shm.DIR_ENV,
        )
        budgets = room.fit([st.budget for st in state.stages])
        for st, b in zip(state.stages, budgets, strict=True):
            if b != st.budget:
                st.budget = b
                self.rebudget(st.index)

    def resize(
        self, stage: int, n: int, remote: int | None = None, threads: int | None = None
    ) -> None:
        """Start or retire workers of ``stage`` toward ``n``, ``remote`` of them offload
        workers (None: as many as now, at most ``n``) and ``threads`` of the local ones
        threads (None: :func:`multiproc.policy.worker_mix`)."""
        st = self.state.stages[stage]
        far = min(st.remote if remote is None else remote, n)
        starts = self.state.spec.stages[stage].starts_on_threads
        want = policy.worker_mix(n, far, threads, self.want(stage), starts)
        st.target, st.remote, st.threads = n, want.remote, want.threads
        if self.state.fused[stage]:
            return  # its host runs it; the target is kept for when it is split again
        plan = policy.resize_plan(self.have(stage), want)
        retired = False
        for kind in policy.WORKER_KINDS:
            active = self.active(stage, kind)
            for _ in range(plan[kind].start):
                self.spawn(stage, kind)
            if plan[kind].retire:
                retired = True
                # Each kind retires its own: a frame a retiring worker holds is finished by
                # it, and the frames queued go to whichever worker of the stage is free.
                for h in policy.to_retire(active, plan[kind].retire):
                    self.retire(h)
        if retired:
            self.rebudget(stage)

    def retire(self, h: handles.WorkerHandle) -> None:
        """Tell ``h`` to finish what it holds, take nothing new, and go."""
        h.state = WS.RETIRING
        self.mail.send(h, P.Retire())

    def finish(self, h: handles.WorkerHandle) -> None:
        """Worker ``h`` ended (said bye) or its pipe or process did: forget it, re-delivering
        what it held and replacing it if it died."""
        if h.state == WS.GONE:
            self._on_gone(h, died=False)
            handles.stop_worker(h, 1.0)
            return
        if not h.thread:
            h.proc.join(0.5)
        why = handles.describe_exit(h)
        if why.startswith("killed by SIGBUS"):
            why += shm.sigbus_hint(shm.directory())
        if h.state == WS.RETIRING and not h.inflight and not h.held:
            self._on_gone(h, died=False)
            return
        if self.state.closed or self.state.res.stop.is_set():
            return
        self._on_gone(h, died=True, why=why)

    def _on_gone(self, h: handles.WorkerHandle, died: bool, why: str = "") -> None:
        """A worker ended: re-deliver what it held; replace it if it died."""
        state = self.state
        s = state.spec.stages[h.stage]
        st = state.stages[h.stage]
        prev = h.state
        h.state = WS.DEAD if died else WS.GONE
        h.close_outbox(timeout_s=0.5)  # the peer is gone: a pending send fails at once
        try:
            h.conn.close()
        except Exception:
            pass
        if h.proc is not None and not h.thread:
            h.proc.join(0.1)
        run = state.run
        if died:
            st.restarts += 1
            # What it died on, read before its counters are folded and what it held requeued.
            row = state.counters.row(h.slot) if h.slot in st.slots else None
            doing = None if row is None else handles.work_in_hand(h, row)
            if doing is not None:
                why += f" in its function on {doing}"
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
        for f in h.inflight.values():  # delivered again from the same memory
            if s.kind != "source" and f.payload[0] == "shm":
                f.released = False
                keep.add((f.payload[1].segment, f.payload[1].offset))
        for f in h.held.values():
            state.pending_count[f.producer] += 1  # queued again
            f.released = False  # its next worker lets go of it
            if f.payload[0] == "shm":
                keep.add((f.payload[1].segment, f.payload[1].offset))
        h.inflight.clear()
        h.held.clear()
        if s.kind == "source":
            for u in sorted(back, key=lambda u: u.pos, reverse=True):
                assert run is not None  # units are held only while a run is on
                run.units.appendleft(u)
        else:
            for f in sorted(back, key=lambda f: f.seq, reverse=True):
                f.skip = frozenset(f.consumed)
                st.ready.appendleft(f)
        # Frames it consumed but had not yet released: it never will (held frames excepted:
        # they are delivered again from the same memory).
        for seg, off in list(h.owes - keep):
            self.ledger.free(seg, off)
        h.owes.clear()
        self._retire_slot(h)
        if h.flushing:
            h.flushing = False
            st.flush_sent = False  # flush again once the re-delivered frames are through
        self.ledger.maybe_unlink(h.seg_name)
        if died:
            if st.restarts > state.spec.max_restarts:
                raise WorkerDiedError(
                    f"stage {s.name!r} worker {h.wid} (pid {h.pid}) {why}; {st.restarts} worker "
                    f"deaths in this stage exceed max_restarts={state.spec.max_restarts}"
                )
            if prev != WS.RETIRING and not state.closed:
                self.spawn(h.stage, h.kind)

    def _retire_slot(self, h: handles.WorkerHandle) -> None:
        """Fold a finished worker's counters into its stage's totals (and its kind's: offload
        or local thread workers) and reuse its slot."""
        st = self.state.stages[h.stage]
        if h.slot not in st.slots:
            return
        row = self.state.counters.row(h.slot)
        st.retired = _fold(st.retired, row)
        if h.kind == "remote":
            st.retired_remote = _fold(st.retired_remote, row)
        elif h.kind == "thread":
            st.retired_threads = _fold(st.retired_threads, row)
        row[:] = 0
        st.slots.discard(h.slot)
        self.state.free_slots.append(h.slot)


def _fold(total: np.ndarray | None, row: np.ndarray) -> np.ndarray:
    """``row``'s counters added to ``total`` (None: none yet); its pid, its start and the
    call it was in (a worker that died in its function) are no sum's: a retired worker's time
    in a call stops growing when it goes."""
    out = row.copy() if total is None else total + row
    out[stats.PID] = out[stats.STARTED_NS] = out[stats.IN_FN_SINCE_NS] = 0
    return out
