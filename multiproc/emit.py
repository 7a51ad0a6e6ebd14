"""How a worker writes its outputs: into its arena, waiting for room, or inline.

:class:`Emitter` is the part of the worker (``worker._Worker``) that encodes frames
(:func:`multiproc.arena.encode`), waits for room under its budget (backpressure: see
:mod:`multiproc.policy` for when the router lets a frame travel inline), splits a stateful
stage's outputs into frames, and reports items that do not pickle, naming them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from . import arena, policy, stats
from . import protocol as P
from .errors import StageError
from .items import estimated_size, unpicklable

_ns = time.perf_counter_ns
_cpu_ns = time.thread_time_ns


class Emitter:
    """Output side of a worker (see the module docstring). The worker provides ``alloc``,
    ``seg``, ``conn``, ``row``, ``cell``, ``wid``, ``deferred``, ``_say``, ``_take_frees``,
    ``_handle_control`` and ``_error``."""

    def _encode(self, obj):
        """Write one frame into the arena, waiting for room (backpressure) if needed.

        A frame bigger than this worker's whole budget waits too, until the router lets it
        travel inline (``policy``): none of this worker's frames is queued or in flight, or
        nothing else can move. So it counts against the budget as one frame in flight.
        """
        h0 = _cpu_ns()
        payload, nbytes = arena.encode(obj, self.alloc, self.seg)
        self.row[stats.HOP_NS] += _cpu_ns() - h0
        if payload is not None:
            return payload, nbytes
        t0 = _ns()
        self._say(P.Blocked(self.wid, self._take_frees(), self.seg.took_refusal()))
        since = self.cell[stats.IN_FN_SINCE_NS]
        self.cell[stats.IN_FN_SINCE_NS] = 0  # waiting for room is not being stuck in fn
        try:
            while True:
                msg = P.read(self.conn.recv())
                if type(msg) is P.SpillOk:
                    self.row[stats.SPILLED] += 1
                    return arena.encode(obj, None, None)
                if not self._handle_control(msg):
                    self.deferred.append(msg)
                    continue
                if type(msg) in (P.Free, P.Budget) and nbytes <= self.alloc.limit:
                    payload, nbytes = arena.encode(obj, self.alloc, self.seg)
                    if payload is not None:
                        self._say(P.Unblocked(self.wid))
                        return payload, nbytes
        finally:
            waited = _ns() - t0
            self.row[stats.BLOCKED_OUT_NS] += waited
            if since:
                self.cell[stats.IN_FN_SINCE_NS] = since + waited

    def _emit_frames(self, items: list, frame_items: int, count: bool = True) -> list | None:
        """Encode outputs of a stateful stage; None when an error was reported instead."""
        outs = []
        if frame_items > 1 and len(items) > 1:
            frame_items = policy.frame_items(estimated_size(items[0]), frame_items)
        for i in range(0, len(items), frame_items):
            encoded = self._encode_items(None, items[i : i + frame_items], lambda: "output")
            if encoded is None:
                return None
            payload, nbytes, chunk = encoded
            outs.append((payload, len(chunk)))
            if count:
                self.row[stats.BYTES_OUT] += nbytes
                self.row[stats.FRAMES_OUT] += 1
                self.row[stats.ITEMS_OUT] += len(chunk)
        return outs

    def _encode_items(self, frame_id, items: list, where: Callable[[], str], depth: int = 0):
        """Encode a frame of items; an item that does not pickle is reported, naming it and
        its type, or dropped under ``on_error='skip'``. Returns ``(payload, nbytes, items)``,
        or None when the error was reported (the stage stops). ``where()`` names the frame
        (called only on failure: a repr per frame would cost every frame)."""
        try:
            payload, nbytes = self._encode(items)
            return payload, nbytes, items
        except Exception as e:
            bad = unpicklable(items)
            if not bad:
                raise
            where = where()
            for i, (path, tname, err) in bad.items():
                exc = StageError(
                    f"{where}, item {i}: the stage returned {tname} (at item{path}) that does "
                    f"not pickle ({type(err).__name__}: {err}); return plain data, tensors or "
                    "arrays, or make the type picklable"
                )
                exc.__cause__ = e
                if not self._error(frame_id, exc, f"{where}, item {i}", depth):
                    return None
            keep = [x for i, x in enumerate(items) if i not in bad]
            payload, nbytes = self._encode(keep)
            return payload, nbytes, keep
