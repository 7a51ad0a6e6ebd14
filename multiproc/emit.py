"""How a worker writes its outputs: into its arena, waiting for room, or spilled.

:class:`Emitter` encodes a worker's frames (:func:`multiproc.arena.encode`), waits for room
under its budget (backpressure: see :mod:`multiproc.policy` for when the router lets a frame
through without room, to travel in a segment of its own, :mod:`multiproc.spill`), splits a
stateful stage's outputs into frames, and reports items that do not pickle, naming them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import arena, policy, spill, stats
from . import protocol as P
from .arena import Allocator, Segment
from .errors import StageError
from .items import estimated_size, own_memory, unpicklable
from .link import Link

_ns = time.perf_counter_ns
_cpu_ns = time.thread_time_ns

# An encoded frame: its payload, its bytes in the arena (or inline), the items it holds.
Encoded = tuple[Any, int, list[Any]]


class Emitter:
    """The output side of a worker (see the module docstring).

    Args:
        link: the worker's pipe to the router.
        alloc: the allocator of the worker's arena; its ``limit`` is the worker's budget.
        seg: the worker's arena.
        row: the worker's counter row (bytes, frames and items out, time blocked).
        cell: ``row`` as a memoryview, for the per-item ``IN_FN_SINCE_NS`` stores.
        on_control: handles a message that needs no stage work (a budget, frees) while a
            frame waits for room; False for one that must wait its turn.
        on_error: reports ``(work_id, exc, where, depth)`` as the worker does; True when the
            stage goes on (``on_error='skip'``).
        sink_depth: the chain depth whose frames go to the consumer, in this process (a thread
            worker's: those frames are handed over as they are, :func:`multiproc.arena.keep`);
            -1 for none.
    """

    def __init__(
        self,
        link: Link,
        alloc: Allocator,
        seg: Segment,
        row: np.ndarray,
        cell: memoryview,
        on_control: Callable[[Any], bool],
        on_error: Callable[[Any, BaseException, str, int], bool],
        sink_depth: int = -1,
    ) -> None:
        self.link = link
        self.alloc = alloc
        self.seg = seg
        self.row = row
        self.cell = cell
        self.on_control = on_control
        self.on_error = on_error
        self.spills = 0  # segments spilled to so far (each named by its number)
        self.sink_depth = sink_depth

    def _keep(self, obj: Any, nbytes: int) -> tuple[Any, int]:
        """``obj`` handed over as it is, holding a block of ``nbytes``; (None, nbytes) where
        the arena has no room for it (a small frame travels inline, as any would). Tensors and
        arrays that view memory they do not own (the dataset's) are copied, as a hop would
        (:func:`~multiproc.items.own_memory`): the consumer may write to what it gets."""
        if nbytes <= arena.INLINE_MAX_BYTES:
            return arena.encode(obj, None, None)
        off = self.alloc.alloc(nbytes)
        if off is None:
            return None, nbytes
        ref = arena.KeptRef(self.seg.name, off, nbytes, 0, ())
        return arena.keep(own_memory(obj), ref), nbytes

    def encode(self, obj: Any, depth: int = 0, hand_over: bool = True) -> tuple[Any, int]:
        """Write one frame into the arena, waiting for room (backpressure) if needed.

        A frame bigger than this worker's whole budget waits too, until the router lets it
        through (``policy``): none of this worker's frames is queued or in flight, or nothing
        else can move. So it counts against the budget as one frame in flight. It then travels
        in a segment of its own (:mod:`multiproc.spill`), or inline where the shared-memory
        directory has no room for one.

        A frame of chain depth ``sink_depth`` (see the class) is not serialized, unless
        ``hand_over`` is False (it goes back to its own stage): it holds a block of its
        estimated size, or, bigger than the budget, none.
        """
        h0 = _cpu_ns()
        kept = hand_over and depth == self.sink_depth
        if kept:
            payload, nbytes = self._keep(obj, estimated_size(obj))
        else:
            payload, nbytes = arena.encode(obj, self.alloc, self.seg)
        self.row[stats.HOP_NS] += _cpu_ns() - h0
        if payload is not None:
            return payload, nbytes
        t0 = _ns()
        link = self.link
        link.say(P.Blocked(link.wid, link.take_frees(), self.seg.took_refusal()))
        since = self.cell[stats.IN_FN_SINCE_NS]
        self.cell[stats.IN_FN_SINCE_NS] = 0  # waiting for room is not being stuck in fn
        try:
            while True:
                msg = link.read()
                if type(msg) is P.SpillOk:
                    self.row[stats.SPILLED] += 1
                    self.spills += 1
                    segment = spill.name(self.seg.name, self.spills)
                    if kept:
                        alone = spill.KeptSpillRef(segment, 0, nbytes, 0, ())
                        return arena.keep(own_memory(obj), alone), nbytes
                    return spill.write(obj, segment)
                if not self.on_control(msg):
                    link.deferred.append(msg)
                    continue
                if type(msg) in (P.Free, P.Budget) and nbytes <= self.alloc.limit:
                    if kept:
                        payload, nbytes = self._keep(obj, nbytes)
                    else:
                        payload, nbytes = arena.encode(obj, self.alloc, self.seg)
                    if payload is not None:
                        link.say(P.Unblocked(link.wid))
                        return payload, nbytes
        finally:
            waited = _ns() - t0
            self.row[stats.BLOCKED_OUT_NS] += waited
            if since:
                self.cell[stats.IN_FN_SINCE_NS] = since + waited

    def emit_frames(
        self, items: list[Any], frame_items: int, count: bool = True, hand_over: bool = True
    ) -> list[tuple[Any, int]] | None:
        """Encode outputs of a stateful stage; None when an error was reported instead.
        ``hand_over`` False: items given back to their own stage (never handed over as
        objects, :meth:`encode`)."""
        outs: list[tuple[Any, int]] = []
        if frame_items > 1 and len(items) > 1:
            frame_items = policy.frame_items(estimated_size(items[0]), frame_items)
        for i in range(0, len(items), frame_items):
            encoded = self.encode_items(
                None, items[i : i + frame_items], lambda: "output", hand_over=hand_over
            )
            if encoded is None:
                return None
            payload, nbytes, chunk = encoded
            outs.append((payload, len(chunk)))
            if count:
                self.row[stats.BYTES_OUT] += nbytes
                self.row[stats.FRAMES_OUT] += 1
                self.row[stats.ITEMS_OUT] += len(chunk)
        return outs

    def encode_items(
        self,
        frame_id: Any,
        items: list[Any],
        where: Callable[[], str],
        depth: int = 0,
        hand_over: bool = True,
    ) -> Encoded | None:
        """Encode a frame of items; an item that does not pickle is reported, naming it and
        its type, or dropped under ``on_error='skip'``. Returns ``(payload, nbytes, items)``,
        or None when the error was reported (the stage stops). ``where()`` names the frame
        (called only on failure: a repr per frame would cost every frame)."""
        try:
            payload, nbytes = self.encode(items, depth, hand_over)
            return payload, nbytes, items
        except Exception as e:
            bad = unpicklable(items)
            if not bad:
                raise
            named = where()
            for i, (path, tname, err) in bad.items():
                exc = StageError(
                    f"{named}, item {i}: the stage returned {tname} (at item{path}) that does "
                    f"not pickle ({type(err).__name__}: {err}); return plain data, tensors or "
                    "arrays, or make the type picklable"
                )
                exc.__cause__ = e
                if not self.on_error(frame_id, exc, f"{named}, item {i}", depth):
                    return None
            keep = [x for i, x in enumerate(items) if i not in bad]
            payload, nbytes = self.encode(keep, depth, hand_over)
            return payload, nbytes, keep
