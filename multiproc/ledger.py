"""Arena blocks and frames pending: what the router counts so that memory is freed exactly once.

A frame in shared memory is a block of its producer's arena. :class:`Ledger` counts the frames
each arena holds (``ExecutorState.seg_refs``) and their bytes per stage (``seg_bytes``), tells
a producer which blocks to free (once per event, ``Free``), removes a dead worker's arena once
nothing refers to it, and counts each producer's frames queued or in flight, which decides
when a blocked producer may let a frame through without room (``policy.may_spill``,
``policy.stalled``). A frame that went through that way lives in a segment of its own
(:mod:`multiproc.spill`, ``ExecutorState.spills``): freeing it unlinks that segment.
Callers hold the executor's lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import arena, handles, policy, spill
from . import protocol as P
from .frames import Frame, inline_size
from .mail import Mail
from .state import ExecutorState


class Ledger:
    """Arena accounting and backpressure (see the module docstring)."""

    def __init__(self, state: ExecutorState, mail: Mail) -> None:
        self.state = state
        self.mail = mail

    def new_frame(self, seq: tuple, payload: Any, n: int, producer: int, stage: int) -> Frame:
        """A frame of ``n`` items that worker ``producer`` of ``stage`` made, counted as
        queued from now on (and its block as referred to, in shared memory)."""
        s = self.state
        f = Frame(next(s.frame_ids), seq, payload, n, producer, inline=inline_size(payload))
        if payload[0] == "shm":
            ref = payload[1]
            if isinstance(ref, spill.SpillRef):
                s.spills.add(ref.segment)
            else:
                s.seg_refs[ref.segment] += 1
                s.seg_bytes[stage] += ref.size
                s.sizes[(ref.segment, ref.offset)] = ref.size
        s.pending_count[producer] += 1
        return f

    def frame_left(self, f: Frame) -> None:
        """A frame stopped being queued or in flight (it is consumed or held)."""
        s = self.state
        s.pending_count[f.producer] -= 1
        h = s.workers.get(f.producer)
        if (
            h is not None
            and h.blocked
            and policy.may_spill(s.pending_count[f.producer])
            and h.alive()
        ):
            self.spill_ok(h)

    def spill_ok(self, h: handles.WorkerHandle) -> None:
        """Let blocked worker ``h`` send its frame inline."""
        self.mail.send(h, P.SpillOk())
        h.blocked = False

    def on_blocked(self, h: handles.WorkerHandle) -> None:
        """Worker ``h`` waits for room: let it through if none of its frames is pending."""
        h.blocked = True
        if policy.may_spill(self.state.pending_count[h.wid]):
            self.spill_ok(h)

    def break_stall(self) -> None:
        """Let blocked workers through when nothing else can move (see ``policy``)."""
        s = self.state
        run = s.run
        if run is None or run.finished or not any(h.blocked for h in s.workers.values()):
            return
        for h in policy.stalled(s.workers.values(), len(run.sink)):
            self.spill_ok(h)

    def free(self, seg: str, off: int) -> None:
        """The frame at ``off`` of arena ``seg`` is done with: its producer frees it (at the
        end of the event), or its arena goes once nothing refers to it (a dead producer)."""
        s = self.state
        if seg in s.spills:
            s.spills.discard(seg)
            arena.remove_segment(seg)  # mappings of it keep its pages until they end
            return
        wid = s.by_seg.get(seg)
        if wid is None:
            return
        s.seg_refs[seg] -= 1
        h = s.workers[wid]
        s.seg_bytes[h.stage] -= s.sizes.pop((seg, off), 0)
        if h.alive():
            s.pending_free.setdefault(wid, []).append(off)
        else:
            self.maybe_unlink(seg)

    def free_released(self) -> None:
        """Free the frames the consumer let go of since the last call."""
        frees = self.state.sink_frees
        while frees:
            seg, off = frees.popleft()
            self.free(seg, off)

    def take_frees(self, h: handles.WorkerHandle, frees: Iterable[tuple[str, int]]) -> None:
        """Worker ``h`` let go of these blocks (of its producers' arenas)."""
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
            self.free(seg, off)

    def flush_frees(self) -> None:
        """Tell each live producer the blocks to free that this event collected."""
        s = self.state
        pf = s.pending_free
        if not pf:
            return
        for wid, offs in pf.items():
            h = s.workers.get(wid)
            if h is not None and h.alive():
                self.mail.send(h, P.Free(offs))
        pf.clear()

    def maybe_unlink(self, seg: str) -> None:
        """Remove a dead worker's arena ``seg`` once no frame refers to it, and forget it,
        with the segments it spilled frames to but never sent (it died first)."""
        s = self.state
        wid = s.by_seg.get(seg)
        if wid is None:
            return
        h = s.workers.get(wid)
        if h is not None and not h.alive() and s.seg_refs[seg] <= 0:
            for name in spill.orphans(seg, s.spills):
                arena.remove_segment(name)
            arena.remove_segment(seg)
            s.segments.discard(seg)
            s.cache.drop(seg)
            # Consumers still map it; their mapping keeps its pages alive until dropped.
            for c in s.workers.values():
                if c.stage == h.stage + 1 and c.alive():
                    self.mail.send(c, P.Drop(seg))
            del s.by_seg[seg]
            del s.workers[wid]
