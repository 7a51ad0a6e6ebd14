"""Workers come and go: spawn, resize, retire, and recovery of what a dead one held.

:class:`Workers` is the part of :class:`~multiproc.executor.Executor` that starts worker
processes (or threads) in free counter slots, splits a stage's budget among them, retires the
ones :func:`multiproc.policy.to_retire` picks when a stage shrinks, and, when one ends, puts
every frame, unit or stateful holding it had back at the front of its stage's queue, so each is
delivered again exactly once (a source's committed frames are skipped).
"""

from __future__ import annotations

import logging
import time

from . import arena, buffers, handles, offload, policy, stats
from . import protocol as P
from .errors import (
    ExecutorError,
    WorkerDiedError,
)
from .frames import WorkerState as WS
from .snapshot import Snapshot, forks
from .spec import check_picklable, imported_modules

log = logging.getLogger("multiproc.executor")

MAX_SLOTS = 1024  # workers ever started by one executor (counter slots are reused)
# Process workers a stage starts with; the rest start one per router turn (Workers._ramp).
START_WORKERS = 2


class Workers:
    """Worker lifecycle of the executor (see the module docstring)."""

    def _spawn(self, stage: int, remote: bool = False) -> None:
        s = self.spec.stages[stage]
        st = self._stages[stage]
        wid = next(self._wids)
        if not self._free_slots:
            raise ExecutorError(f"stage {s.name!r}: more than {MAX_SLOTS} workers started")
        slot = self._free_slots.pop()
        seg_name = f"ttp_{self._tag}_w{wid}"
        size = s.max_buffer_bytes
        self._segments.add(seg_name)  # first: removed at close even if Ctrl-C lands below
        arena.create_segment(seg_name, size)
        index = sum(1 for h in self._workers.values() if h.stage == stage)
        h = handles.WorkerHandle(
            wid, stage, index, slot, seg_name, thread=remote or s.worker_type == "thread",
            remote=remote,
        )  # fmt: skip
        self._by_seg[seg_name] = wid
        self._workers[wid] = h
        st.slots.add(slot)
        n_alive = max(1, self._n_active(stage) + 1)

        def launch() -> None:
            if not h.thread:
                self._check_server()
            args = (
                # In a list the worker empties (worker._Worker).
                [self._offload_bytes[stage] if remote else self._stage_bytes[stage]],
                wid,
                slot,
                index,
                f"ttp_{self._tag}_stats",
                MAX_SLOTS,
                seg_name,
                size,
                policy.budget_share(st.budget, n_alive),
                self._chains[stage],
            )
            h.start_ns = time.monotonic_ns()
            handles.start_worker(
                h, args, None if self._snapshot is None else self._snapshot.server, self._preload
            )

        try:
            launch()
        except (EOFError, OSError):
            # A fork server killed a moment ago can still look alive to waitpid: once it is
            # reaped, launch again through its successor.
            snap = self._snapshot
            if h.thread or snap is None or not snap.server.wait_ended():
                raise
            log.warning("stage %r: the fork server ended while starting a worker", s.name)
            launch()
        if self._depth(stage):
            self._send(h, P.Fuse(self._depth(stage)))
        if self._run is not None:
            self._send(h, P.Epoch(self._run.epoch))  # stateful stages seed by epoch
        if st.concurrency != s.concurrency:
            self._send(h, P.Concurrency(st.concurrency))
        self._rebudget(stage)

    def _start_server(self, snapshot: Snapshot | None) -> tuple[str, ...]:
        """Where process workers come from: ``snapshot`` (or one taken now) of this process,
        whose stage functions they inherit (:mod:`multiproc.snapshot`); or, where this process
        must not be forked (``start_method="spawn"``, ``MULTIPROC_FORKSERVER=spawn``,
        :func:`~multiproc.handles.fork_unsafe`), multiprocessing's spawned server, which
        imports the modules the stage pickles name once instead of every new worker importing
        them. Returns those modules (empty for a snapshot)."""
        stages = [offload.local_spec(s) if s.offload else s for s in self.spec.stages]
        self._snapshot = None
        if forks(self.spec):
            self._snapshot = snapshot if snapshot is not None else Snapshot.take(stages)
            return ()
        if snapshot is not None:
            snapshot.stop()
        if not any(s.worker_type == "process" for s in stages):
            return ()
        try:
            light = [buffers.dumps_light(s) for s in stages]
        except Exception:  # check_picklable names the stage that does not pickle, next
            return ()
        preload = tuple(dict.fromkeys(m for b in light for m in imported_modules(b)))
        handles.ensure_server(preload)
        return preload

    def _pickle_stages(self) -> None:
        """Pickle each stage for its local workers (a stage with an offload: its local
        workers' spec): with references to the snapshot's copy of its functions for process
        workers of a snapshot, by value otherwise (large arrays in :mod:`multiproc.buffers`'
        shared file)."""
        snap = self._snapshot
        self._stage_bytes = []
        for s in self.spec.stages:
            local = offload.local_spec(s) if s.offload else s
            if snap is not None and s.worker_type == "process":
                self._stage_bytes.append(check_picklable(local, dumps=snap.dumps))
            else:
                self._stage_bytes.append(check_picklable(local, self._buffers))

    def _check_server(self) -> None:
        """Before a process worker starts: the snapshot's server still runs, else (killed)
        another is forked from this process now."""
        snap = self._snapshot
        if snap is None or not snap.server.ended():
            return
        log.warning(
            "the fork server %d of the stages' workers ended; forking another from this "
            "process (workers started from now on see it as it is now)",
            snap.server.pid,
        )
        snap.renew()

    def _ramps(self, stage: int) -> bool:
        """Whether the stage's workers start a few at first and the rest while it runs (local
        process workers: each is a fork of the snapshot, ~10-20 ms for a process of a GB,
        made one at a time by its server)."""
        s = self.spec.stages[stage]
        return s.worker_type == "process" and s.offload is None

    def _first_workers(self, stage: int) -> int:
        """How many workers the stage starts with (see :meth:`_ramp`)."""
        target = self._stages[stage].target
        return min(target, START_WORKERS) if self._ramps(stage) else target

    def _ramp(self) -> None:
        """On a router turn: start one more worker of the first stage short of its target.
        The executor starts with :data:`START_WORKERS` per stage, and those serve while the
        others fork, one per turn, with the router handling events in between (instead of
        every worker forked before the first one gets work)."""
        for st in self._stages:
            i = st.index
            if self._fused[i] or not self._ramps(i) or len(self._active(i)) >= st.target:
                continue
            self._spawn(i)
            self._wake()  # another turn soon, for the next one
            return

    def serving(self) -> bool:
        """Whether every stage that runs its own workers has as many started (said hello)
        as it starts with: the executor serves, while the rest of its workers start."""
        with self._lock:
            for st in self._stages:
                if self._fused[st.index]:
                    continue
                hello = sum(1 for h in self._workers.values() if h.stage == st.index and h.ready_ns)
                if hello < self._first_workers(st.index):
                    return False
            return True

    def _active(self, stage: int, remote: bool | None = None) -> list[handles.WorkerHandle]:
        """The stage's workers that take work (starting or ready; not retiring): all, or
        only its offload workers (``remote`` True) or only its local ones (False)."""
        return [
            h
            for h in self._workers.values()
            if h.stage == stage
            and h.state in (WS.STARTING, WS.READY)
            and (remote is None or h.remote == remote)
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

    def _resize(self, stage: int, n: int, remote: int | None = None) -> None:
        st = self._stages[stage]
        st.target = n
        if remote is not None:
            st.remote = remote
        st.remote = min(st.remote, n)
        if self._fused[stage]:
            return  # its host runs it; the target is kept for when it is split again
        local, far = self._active(stage, False), self._active(stage, True)
        plan = offload.split(len(local), len(far), n, st.remote)
        retired = False
        for active, kind, is_remote in ((local, plan[0], False), (far, plan[1], True)):
            for _ in range(kind.start):
                self._spawn(stage, remote=is_remote)
            if kind.retire:
                retired = True
                # Each kind retires its own: a frame a retiring worker holds is finished by
                # it, and the frames queued go to whichever worker of the stage is free.
                for h in policy.to_retire(active, kind.retire):
                    h.state = WS.RETIRING
                    self._send(h, P.Retire())
        if retired:
            self._rebudget(stage)

    def _on_gone(self, h: handles.WorkerHandle, died: bool, why: str = "") -> None:
        """A worker ended: re-deliver what it held; replace it if it died."""
        s = self.spec.stages[h.stage]
        st = self._stages[h.stage]
        prev = h.state
        h.state = WS.DEAD if died else WS.GONE
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
        for f in h.inflight.values():  # delivered again from the same memory
            if s.kind != "source" and f.payload[0] == "shm":
                f.released = False
                keep.add((f.payload[1].segment, f.payload[1].offset))
        for f in h.held.values():
            self._pending_count[f.producer] += 1  # queued again
            f.released = False  # its next worker lets go of it
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
            if prev != WS.RETIRING and not self._closed:
                self._spawn(h.stage, remote=h.remote)

    def _retire_slot(self, h: handles.WorkerHandle) -> None:
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
        if h.remote:
            if st.retired_remote is None:
                st.retired_remote = row.copy()
            else:
                st.retired_remote += row
            st.retired_remote[stats.PID] = st.retired_remote[stats.STARTED_NS] = 0
        row[:] = 0
        st.slots.discard(h.slot)
        self._free_slots.append(h.slot)
