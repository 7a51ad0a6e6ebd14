"""The router thread: what happens when a worker speaks, ends, or has room.

:class:`Router` runs on the router thread (:func:`route`), under the executor's lock: it reads
worker messages (:mod:`multiproc.protocol`), dispatches frames and units to workers
(:func:`multiproc.policy.assign`), delivers outputs in order (:mod:`multiproc.frames`), closes
stages whose input is done (:func:`multiproc.policy.progress`), and raises a worker's error
to the consumer. It works on the executor's :class:`~multiproc.state.ExecutorState` through
the collaborators it is given: :class:`~multiproc.ledger.Ledger` (arena blocks, backpressure),
:class:`~multiproc.lifecycle.WorkerPool`, :class:`~multiproc.fusion.FusionControl` and
:class:`~multiproc.faults.FaultHandler`.

Messages that handling one event has for a worker are sent together at its end, in one write
(:class:`~multiproc.mail.Mail`, :mod:`multiproc.outbox`). After each event the router says
whether some worker has work in flight (``Resources.reporting``): its report will wake the
router, so a frame the consumer releases meanwhile does not wake it again.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import weakref
from typing import Any

from . import handles, policy
from . import protocol as P
from .errors import ExecutorError
from .faults import FaultHandler
from .frames import Frame
from .frames import WorkerState as WS
from .fusion import FusionControl
from .ledger import Ledger
from .lifecycle import WorkerPool
from .mail import Mail
from .poller import Poller
from .state import ExecutorState

log = logging.getLogger("multiproc.executor")


class Router:
    """Event handlers of the router thread (see the module docstring)."""

    def __init__(
        self,
        state: ExecutorState,
        mail: Mail,
        ledger: Ledger,
        pool: WorkerPool,
        fusion: FusionControl,
        faults: FaultHandler,
    ) -> None:
        self.state = state
        self.mail = mail
        self.ledger = ledger
        self.pool = pool
        self.fusion = fusion
        self.faults = faults

    # ---------------------------------------------------------------- frames
    def _deliver(self, stage: int, f: Frame) -> None:
        """Hand a frame produced by ``stage`` to the next stage (or the sink)."""
        state = self.state
        spec = state.spec
        nxt = stage + 1
        run = state.run
        assert run is not None
        if nxt == len(spec.stages):
            if spec.ordered:
                run.sink_order.put(f, run.sink, run.unit_frames)
            else:
                run.sink.append(f)
            state.cond.notify_all()
            return
        st = state.stages[nxt]
        if spec.ordered and spec.stages[nxt].stateful:
            st.order.put(f, st.ready, run.unit_frames)
        else:
            st.ready.append(f)

    def _dispatch(self) -> None:
        """Give queued units and frames to the ready workers with room (``policy.assign``)."""
        state = self.state
        run = state.run
        if run is None or run.finished:
            return
        credits = state.spec.credits
        for i, s in enumerate(state.spec.stages):
            st = state.stages[i]
            ready = [h for h in state.workers.values() if h.stage == i and h.state == WS.READY]
            if not ready:
                continue
            after = state.stages[i + 1].ready if i + 1 < len(state.stages) else run.sink
            if after.full(st.budget):
                continue  # see FrameQueue
            loads = [policy.Load(len(h.inflight), h.ahead) for h in ready]
            if s.kind == "source":
                idle = sum(
                    1
                    for h in state.workers.values()
                    if h.stage == i and h.state == WS.STARTING and not h.inflight
                )
                coming = policy.coming_workers(idle, st.target, self.pool.n_active(i))
                for k in policy.assign(loads, credits, len(run.units), coming):
                    h = ready[k]
                    u = run.units.popleft()
                    h.inflight[u.id] = u
                    self.mail.send(h, P.Unit(u.id, u.unit, u.committed))
                continue
            if s.stateful and state.spec.ordered and self.pool.retiring(i):
                # Ordered, a reducer takes its items in order, in one worker: a new one (its
                # kind moved) waits for the retiring one's items handed back (P.Handoff).
                continue
            for k in policy.assign(loads, credits, len(st.ready)):
                h = ready[k]
                f = st.ready.popleft()
                if s.stateful:
                    st.flush_sent = False  # input after a flush: flush again at the end
                h.inflight[f.id] = f
                if f.payload[0] == "shm":
                    # Owed from now on: the worker may let go of the frame's memory (and say
                    # so) before it reports the frame done.
                    h.owes.add((f.payload[1].segment, f.payload[1].offset))
                self.mail.send(h, P.Run(f.id, f.payload, f.skip))

    def _check_progress(self) -> None:
        """Close stages whose input is exhausted; flush stateful ones; finish the run
        (``policy.progress``)."""
        state = self.state
        run = state.run
        if run is None or run.finished:
            return
        # Made as progress() reads them: it stops at the first stage that is not done.
        views = (self._progress_view(i) for i in range(len(state.stages)))
        got = policy.progress(views, run.units_done == run.n_units, bool(run.sink_order.frames))
        for i, closed in got.closed.items():
            state.stages[i].closed = closed
        for i in got.flush:
            state.stages[i].flush_sent = True
            for h in state.workers.values():
                if h.stage == i and h.state == WS.READY:
                    h.flushing = True
                    self.mail.send(h, P.Flush())
        for i in got.done:
            state.stages[i].done = True
        if got.finished:
            run.finished = True
            state.cond.notify_all()

    def _progress_view(self, i: int) -> policy.StageProgress:
        state = self.state
        st = state.stages[i]
        ws = [h for h in state.workers.values() if h.stage == i and h.alive()]
        return policy.StageProgress(
            done=st.done,
            stateful=state.spec.stages[i].stateful,
            busy=any(h.inflight for h in ws),
            queued=bool(st.ready or st.order.frames),
            starting=any(h.state == WS.STARTING for h in ws),
            flush_sent=st.flush_sent,
            flushing=any(h.flushing for h in ws),
            can_flush=any(h.state == WS.READY for h in ws),
            held=any(h.held for h in ws),
        )

    # ---------------------------------------------------------------- messages
    def _on_message(self, h: handles.WorkerHandle, raw: tuple) -> None:
        state = self.state
        try:
            msg = P.read(raw)
        except ValueError as e:
            s = state.spec.stages[h.stage]
            raise ExecutorError(f"stage {s.name!r} worker {h.wid}: {e}") from None
        match msg:
            case P.Hello():
                if h.state == WS.STARTING:
                    h.state = WS.READY
                h.ready_ns = time.monotonic_ns()
                state.start_latencies_ns.append(h.ready_ns - h.start_ns)
            case P.Emit(_, uid, k, payload, n, depth):
                u = h.inflight.get(uid)
                if u is not None:
                    u.committed = k + 1
                    f = self.ledger.new_frame((0, u.pos, k), payload, n, h.wid, h.stage)
                    self._deliver(h.stage + depth, f)
            case P.UnitDone(_, uid, total, frees, ahead):
                self.ledger.take_frees(h, frees)
                h.ahead = ahead
                u = h.inflight.pop(uid, None)
                if u is not None:
                    run = state.run
                    assert run is not None
                    run.unit_frames[(0, u.pos)] = total
                    run.units_done += 1
                    if state.spec.ordered:
                        self._drain_all_reorders()
            case P.Done() | P.Flushed() | P.Handoff():
                self._on_outputs(h, msg)
            case P.Frees(_, frees):
                self.ledger.take_frees(h, frees)
            case P.Blocked(_, frees, no_room):
                self.ledger.take_frees(h, frees)
                if no_room:
                    self.pool.on_no_room(h.stage)
                self.ledger.on_blocked(h)
            case P.Unblocked():
                h.blocked = False
            case P.Bye(_, frees):
                self.ledger.take_frees(h, frees)
                h.state = WS.GONE
            case P.Error(_, _, exc_bytes, tname, text, tb, where, depth):
                name = state.spec.stages[h.stage + depth].name
                self.faults.on_error(name, h, exc_bytes, tname, text, tb, where)
            case P.Skipped(_, where, tname, text, depth):
                self.faults.on_skipped(h, where, tname, text, h.stage + depth)
            case _:
                name = state.spec.stages[h.stage].name
                raise ExecutorError(f"stage {name!r} worker {h.wid} sent {msg!r}")

    def _on_outputs(self, h: handles.WorkerHandle, msg: Any) -> None:
        """A frame done (``P.Done``), a reducer flushed (``P.Flushed``), or a retiring
        reducer's items handed back (``P.Handoff``)."""
        state, ledger = self.state, self.ledger
        run = state.run
        assert run is not None
        i = h.stage
        s = state.spec.stages[i]
        st = state.stages[i]
        f_in = None
        if type(msg) is P.Done:
            f_in = h.inflight.pop(msg.frame_id, None)
            if f_in is None:
                raise ExecutorError(
                    f"stage {s.name!r} worker {h.wid} finished unknown frame {msg.frame_id}"
                )
            ledger.frame_left(f_in)
            if f_in.released and not s.stateful:
                ledger.free(f_in.payload[1].segment, f_in.payload[1].offset)
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
                    if f.released:
                        ledger.free(f.payload[1].segment, f.payload[1].offset)
        if type(msg) is P.Flushed:
            for f in h.held.values():  # a flushed reducer holds nothing
                if f.released:
                    ledger.free(f.payload[1].segment, f.payload[1].offset)
            h.held.clear()
        ledger.take_frees(h, msg.frees)
        handoff = type(msg) is P.Handoff
        for payload, n in msg.outs:
            if s.stateful:
                seq = (i + 1, st.out_counter, 0)
                if not handoff:
                    run.unit_frames[(i + 1, st.out_counter)] = 1
                    st.out_counter += 1
                f = ledger.new_frame(seq, payload, n, h.wid, i)
                if handoff:
                    # Items given back by a retiring worker re-enter their own stage.
                    f.seq = (-1, f.id, 0)
                    st.ready.appendleft(f)
                else:
                    self._deliver(i, f)
            else:
                assert f_in is not None  # a stateless stage outputs only on Done
                f = ledger.new_frame(f_in.seq, payload, n, h.wid, i)
                self._deliver(i + getattr(msg, "depth", 0), f)
        if type(msg) is P.Flushed:
            h.flushing = False
        if state.spec.ordered:
            self._drain_all_reorders()

    def _drain_all_reorders(self) -> None:
        state = self.state
        run = state.run
        assert run is not None
        for st in state.stages:
            if st.order.frames:
                st.order.drain(st.ready, run.unit_frames)
        if run.sink_order.frames:
            before = len(run.sink)
            run.sink_order.drain(run.sink, run.unit_frames)
            if len(run.sink) != before:
                state.cond.notify_all()

    # ---------------------------------------------------------------- events
    def waitables(self) -> tuple[list | None, list[handles.WorkerHandle], float | None]:
        """What to wait on (None once the executor is closed): the wake pipe, every live
        worker's pipe and process sentinel; those workers; the seconds until a timeout."""
        state = self.state
        with state.lock:
            if state.closed:
                return None, [], None
            live = [h for h in state.workers.values() if h.alive()]
            timeout = self.faults.next_deadline_s(live)
        waitables: list = [state.res.wake_r]
        for h in live:
            waitables.append(h.conn)
            if h.sentinel is not None:
                waitables.append(h.sentinel)
        return waitables, live, timeout

    def on_ready(self, ready: list, live: list[handles.WorkerHandle]) -> bool:
        """Handle what woke the router; False when the executor is closed."""
        state = self.state
        with state.cond:
            if state.closed:
                return False
            self.mail.collect()
            try:
                self._handle(ready, live)
            finally:
                self.mail.post()
        return True

    def _handle(self, ready: list, live: list[handles.WorkerHandle]) -> None:
        state, pool, ledger = self.state, self.pool, self.ledger
        wake_r = state.res.wake_r
        if wake_r in ready:
            try:
                os.read(wake_r, 65536)
            except BlockingIOError:
                pass
        conn_of = {id(h.conn): h for h in live}
        sent_of = {h.sentinel: h for h in live if h.sentinel is not None}
        dead: list[handles.WorkerHandle] = []
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
            if h.alive() or h.state == WS.GONE:
                pool.finish(h)
        while state.commands:
            cmd = state.commands.popleft()
            if cmd[0] == "resize":
                pool.resize(cmd[1], cmd[2], cmd[3], cmd[4])
            elif cmd[0] == "budget":
                pool.set_budget(cmd[1], cmd[2])
            elif cmd[0] == "fusion":
                self.fusion.apply()
            elif cmd[0] == "concurrency":
                for h in state.workers.values():
                    if h.stage == cmd[1] and h.state in (WS.STARTING, WS.READY):
                        self.mail.send(h, P.Concurrency(cmd[2]))
        ledger.free_released()
        pool.ramp()
        self.faults.check_timeouts()
        if state.error is None:
            self._dispatch()
            if any(state.fused):
                self.fusion.settle()
            self._check_progress()
            ledger.break_stall()
        ledger.flush_frees()
        if state.error is not None:
            state.cond.notify_all()
        res = state.res
        res.reporting = state.error is None and any(
            h.inflight and not h.blocked for h in live if h.alive()
        )
        if not res.reporting and state.sink_frees:
            res.wake()  # released while the flag still said a report would come

    def _drain_conn(self, h: handles.WorkerHandle, dead: list[handles.WorkerHandle]) -> None:
        try:
            while h.readable():
                msg = h.conn.recv()
                self._on_message(h, msg)
                if h.state == WS.GONE:
                    if h not in dead:
                        dead.append(h)
                    return
        except (EOFError, OSError, pickle.UnpicklingError):
            if h not in dead:
                dead.append(h)

    def fail(self, e: BaseException) -> None:
        """The router thread failed with ``e``: the consumer sees it instead of hanging."""
        state = self.state
        with state.cond:
            if state.error is None:
                state.error = e
            state.cond.notify_all()


def route(ref: weakref.ref[Router], stop: threading.Event) -> None:
    """The router thread's loop: holds the router only while it handles events, never while
    it waits, so that dropping the last reference to the executor (which holds the router)
    elsewhere collects both."""
    router = ref()
    poller = Poller()
    try:
        while router is not None and not stop.is_set():
            waitables, live, timeout = router.waitables()
            if waitables is None:
                return
            del router  # may run the executor's finalizer here, in this thread: it sets ``stop``
            if stop.is_set():
                return
            # Every event that matters (a message, a death, a command, a release by the
            # consumer, the finalizer) makes one of these ready; the timeout is only the
            # deadline of a stage's timeout_s.
            ready = poller.wait(waitables, timeout)
            if stop.is_set():
                return
            router = ref()
            if router is None or not router.on_ready(ready, live):
                return
    except BaseException as e:  # make the consumer see it instead of hanging
        router = ref()
        if router is None or stop.is_set():
            return
        log.debug("router failed", exc_info=True)
        router.fail(e)
