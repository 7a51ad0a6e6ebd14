"""The router's event handlers: what happens when a worker speaks, ends, or has room.

:class:`Router` is the part of :class:`~multiproc.executor.Executor` that runs on the router
thread, under the executor's lock: it reads worker messages (:mod:`multiproc.protocol`),
dispatches frames and units to workers (choices in :mod:`multiproc.policy`), delivers outputs
in order (:mod:`multiproc.frames`), frees arena blocks, closes stages whose input is done, and
raises a worker's error to the consumer. The state it works on is created by
``Executor.__init__``: ``spec``, ``_stages`` (``StageState``), ``_workers`` (``WorkerHandle``
by id), ``_run`` (``Run``), ``_pending_count`` (frames queued or in flight per producer),
``_seg_refs`` / ``_seg_bytes`` / ``_sizes`` / ``_pending_free`` (arena accounting), ``_error``,
``_closed``, ``_cond``, ``_res``.

Messages that handling one event has for a worker are sent together at its end, in one write
(``_send``, :mod:`multiproc.outbox`). After each event the router says whether some worker has
work in flight (``Resources.reporting``): its report will wake the router, so a frame the
consumer releases meanwhile does not wake it again.
"""

from __future__ import annotations

import logging
import os
import pickle
import time

from . import arena, handles, policy, shm
from . import protocol as P
from .errors import (
    ExecutorError,
)
from .frames import Frame, inline_size
from .frames import WorkerState as WS

log = logging.getLogger("multiproc.executor")


class Router:
    """Event handlers of the router thread (see the module docstring)."""

    def _wake(self) -> None:
        self._res.wake()

    def _send(self, h: handles.WorkerHandle, msg) -> None:
        out = self._outgoing
        if out is None:
            h.post(P.wire(msg))
        elif h.wid in out:
            out[h.wid][1].append(P.wire(msg))
        else:
            out[h.wid] = (h, [P.wire(msg)])

    def _post_outgoing(self) -> None:
        """Send what one event's handling had for each worker, in one write per worker."""
        out, self._outgoing = self._outgoing, None
        for h, msgs in (out or {}).values():
            h.post(*msgs)

    def _maybe_unlink(self, seg: str) -> None:
        wid = self._by_seg.get(seg)
        h = self._workers.get(wid)
        if h is not None and not h.alive() and self._seg_refs[seg] <= 0:
            arena.remove_segment(seg)
            self._segments.discard(seg)
            self._cache.drop(seg)
            # Consumers still map it; their mapping keeps its pages alive until dropped.
            for c in self._workers.values():
                if c.stage == h.stage + 1 and c.alive():
                    self._send(c, P.Drop(seg))
            del self._by_seg[seg]
            del self._workers[wid]

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

    def _spill_ok(self, h: handles.WorkerHandle) -> None:
        self._send(h, P.SpillOk())
        h.blocked = False

    def _break_stall(self) -> None:
        """Let blocked workers through when nothing else can move (see ``policy``)."""
        run = self._run
        if run is None or run.finished or not any(h.blocked for h in self._workers.values()):
            return
        for h in policy.stalled(self._workers.values(), len(run.sink)):
            self._spill_ok(h)

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
            ready = [h for h in self._workers.values() if h.stage == i and h.state == WS.READY]
            if not ready:
                continue
            after = self._stages[i + 1].ready if i + 1 < len(self._stages) else run.sink
            if after.full(st.budget):
                continue  # see FrameQueue
            if s.kind == "source":
                # Workers starting with nothing yet, and those the stage has yet to start.
                coming = sum(
                    1
                    for h in self._workers.values()
                    if h.stage == i and h.state == WS.STARTING and not h.inflight
                ) + max(0, st.target - len(self._active(i)))
                while run.units:
                    h = policy.pick_unit_worker(ready, credits, len(run.units), coming)
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
                if f.payload[0] == "shm":
                    # Owed from now on: the worker may let go of the frame's memory (and say
                    # so) before it reports the frame done.
                    h.owes.add((f.payload[1].segment, f.payload[1].offset))
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
                if any(h.state == WS.STARTING for h in ws):
                    return
                if not st.flush_sent:
                    st.flush_sent = True
                    for h in ws:
                        if h.state == WS.READY:
                            h.flushing = True
                            self._send(h, P.Flush())
                if any(h.flushing for h in ws) or st.ready or any(h.held for h in ws):
                    return
            st.done = True
        if run.sink_order.frames:
            return
        run.finished = True
        self._cond.notify_all()

    def _on_message(self, h: handles.WorkerHandle, raw: tuple) -> None:
        try:
            msg = P.read(raw)
        except ValueError as e:
            s = self.spec.stages[h.stage]
            raise ExecutorError(f"stage {s.name!r} worker {h.wid}: {e}") from None
        match msg:
            case P.Hello():
                if h.state == WS.STARTING:
                    h.state = WS.READY
                h.ready_ns = time.monotonic_ns()
                self._start_latencies_ns.append(h.ready_ns - h.start_ns)
            case P.Emit(_, uid, k, payload, n, depth):
                u = h.inflight.get(uid)
                if u is not None:
                    u.committed = k + 1
                    f = self._new_frame((0, u.pos, k), payload, n, h.wid, h.stage)
                    self._deliver(h.stage + depth, f)
            case P.UnitDone(_, uid, total, frees, ahead):
                self._take_frees(h, frees)
                h.ahead = ahead
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
            case P.Blocked(_, frees, no_room):
                h.blocked = True
                self._take_frees(h, frees)
                if no_room:
                    self._on_no_room(h.stage)
                if policy.may_spill(self._pending_count[h.wid]):
                    self._spill_ok(h)
            case P.Unblocked():
                h.blocked = False
            case P.Bye(_, frees):
                self._take_frees(h, frees)
                h.state = WS.GONE
            case P.Error(_, _, exc_bytes, tname, text, tb, where, depth):
                name = self.spec.stages[h.stage + depth].name
                self._error = self._make_error(name, h, exc_bytes, tname, text, tb, where)
            case P.Skipped(_, where, tname, text, depth):
                self._on_skipped(h, where, tname, text, h.stage + depth)
            case _:
                name = self.spec.stages[h.stage].name
                raise ExecutorError(f"stage {name!r} worker {h.wid} sent {msg!r}")

    def _on_outputs(self, h: handles.WorkerHandle, msg: P.Done | P.Flushed | P.Handoff) -> None:
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
            if f_in.released and not s.stateful:
                self._free(f_in.payload[1].segment, f_in.payload[1].offset)
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
                        self._free(f.payload[1].segment, f.payload[1].offset)
        if type(msg) is P.Flushed:
            for f in h.held.values():  # a flushed reducer holds nothing
                if f.released:
                    self._free(f.payload[1].segment, f.payload[1].offset)
            h.held.clear()
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
                f = self._new_frame(f_in.seq, payload, n, h.wid, i)
                self._deliver(i + getattr(msg, "depth", 0), f)
        if type(msg) is P.Flushed:
            h.flushing = False
        if self.spec.ordered:
            self._drain_all_reorders()

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

    def _take_frees(self, h: handles.WorkerHandle, frees) -> None:
        if not frees:
            return
        # A frame the worker has not finished (in flight) or whose items its reducer still
        # holds (copied out: the memory is needed no more) is delivered again from this memory
        # if the worker dies: its block stays until the frame is done, or consumed.
        open_ = {
            (f.payload[1].segment, f.payload[1].offset): f
            for f in (*h.inflight.values(), *h.held.values())
            if isinstance(f, Frame) and f.payload[0] == "shm"
        }
        for seg, off in frees:
            h.owes.discard((seg, off))
            f = open_.get((seg, off))
            if f is not None:
                f.released = True
                continue
            self._free(seg, off)

    def _waitables(self) -> tuple[list | None, list, float | None]:
        with self._lock:
            if self._closed:
                return None, [], None
            live = [h for h in self._workers.values() if h.alive()]
            timeout = self._next_deadline_s(live)
        waitables = [self._res.wake_r]
        for h in live:
            waitables.append(h.conn)
            if h.sentinel is not None:
                waitables.append(h.sentinel)
        return waitables, live, timeout

    def _on_ready(self, ready: list, live: list) -> bool:
        """Handle what woke the router; False when the executor is closed."""
        with self._cond:
            if self._closed:
                return False
            self._outgoing = {}  # see _send
            try:
                self._handle(ready, live)
            finally:
                self._post_outgoing()
        return True

    def _handle(self, ready: list, live: list) -> None:
        wake_r = self._res.wake_r
        if wake_r in ready:
            try:
                os.read(wake_r, 65536)
            except BlockingIOError:
                pass
        conn_of = {id(h.conn): h for h in live}
        sent_of = {h.sentinel: h for h in live if h.sentinel is not None}
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
            if h.alive() or h.state == WS.GONE:
                self._finish_worker(h)
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "resize":
                self._resize(cmd[1], cmd[2], cmd[3])
            elif cmd[0] == "budget":
                self._set_stage_budget(cmd[1], cmd[2])
            elif cmd[0] == "fusion":
                self._apply_fusion()
            elif cmd[0] == "concurrency":
                for h in self._workers.values():
                    if h.stage == cmd[1] and h.state in (WS.STARTING, WS.READY):
                        self._send(h, P.Concurrency(cmd[2]))
        while self._sink_frees:
            seg, off = self._sink_frees.popleft()
            self._free(seg, off)
        self._ramp()
        self._check_timeouts()
        if self._error is None:
            self._dispatch()
            if any(self._fused):
                self._settle_fusion()
            self._check_progress()
            self._break_stall()
        self._flush_frees()
        if self._error is not None:
            self._cond.notify_all()
        res = self._res
        res.reporting = self._error is None and any(
            h.inflight and not h.blocked for h in live if h.alive()
        )
        if not res.reporting and self._sink_frees:
            res.wake()  # released while the flag still said a report would come

    def _drain_conn(self, h: handles.WorkerHandle, dead: list) -> None:
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

    def _finish_worker(self, h: handles.WorkerHandle, why: str | None = None) -> None:
        if h.state == WS.GONE:
            self._on_gone(h, died=False)
            handles.stop_worker(h, 1.0)
            return
        if not h.thread:
            h.proc.join(0.5)
        if why is None:
            why = handles.describe_exit(h)
            if why.startswith("killed by SIGBUS"):
                why += shm.sigbus_hint(shm.directory())
        if h.state == WS.RETIRING and not h.inflight and not h.held:
            self._on_gone(h, died=False)
            return
        if self._closed or self._res.stop.is_set():
            return
        self._on_gone(h, died=True, why=why)
