"""What the router keeps about frames, units and stages (no processes, no I/O).

Also the states a worker goes through, as the router sees them (:class:`WorkerState`).

A frame is a list of items in flight between stages: in a producer's arena (``payload`` is
``("shm", ref)``) or carried in the control message (``("inline", ...)``). The router knows
every frame's place: queued for a stage (:class:`FrameQueue`), parked for ordered delivery
(:class:`Order`), in flight at a worker, or held by a stateful stage.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import arena


class WorkerState(str, enum.Enum):
    """Where a worker is in its life (the router's view)."""

    STARTING = "starting"  # forked, has not said hello: counts as capacity, takes work queued
    READY = "ready"  # takes frames or units
    RETIRING = "retiring"  # told to retire: finishes what it holds, takes nothing new
    GONE = "gone"  # retired and said bye
    DEAD = "dead"  # ended without bye: what it held is delivered again


@dataclass
class Frame:
    id: int
    seq: tuple
    payload: Any
    n: int
    producer: int  # wid, or -1 when made by the router
    skip: frozenset = frozenset()
    consumed: set = field(default_factory=set)
    inline: int = 0  # bytes carried in the control message (0 for shared memory)
    # A stateful stage's worker let go of the frame's memory while the frame is still held
    # (its items were copied out): freed once the frame is consumed (ledger.Ledger.take_frees).
    released: bool = False


# Inline frames a queue may hold before the stage feeding it gets no new work: with tiny
# items a byte budget alone lets a fast producer run minutes ahead of its consumer (16 MiB of
# 256-byte items), taking CPU from the bottleneck and the router for work nobody waits for.
MAX_INLINE_FRAMES = 256


class FrameQueue(collections.deque):
    """A queue of frames that knows how many inline bytes and frames it holds.

    Small frames travel in the control message, outside the arena whose budget blocks a
    producer; the router stops giving a stage new work while the queue after it holds its
    budget in such bytes, or ``MAX_INLINE_FRAMES`` such frames. Frames parked in a reorder
    buffer are not in any queue, so a stage is never held back waiting for frames only it can
    produce.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inline = 0
        self.inline_frames = 0

    def append(self, f: Frame) -> None:
        self.inline += f.inline
        self.inline_frames += f.inline > 0
        super().append(f)

    def appendleft(self, f: Frame) -> None:
        self.inline += f.inline
        self.inline_frames += f.inline > 0
        super().appendleft(f)

    def popleft(self) -> Frame:
        f = super().popleft()
        self.inline -= f.inline
        self.inline_frames -= f.inline > 0
        return f

    def full(self, budget: int) -> bool:
        """Whether the stage feeding this queue (with byte ``budget``) must wait."""
        return self.inline >= budget or self.inline_frames >= MAX_INLINE_FRAMES


def inline_size(payload: Any) -> int:
    """Bytes a small inline payload ``("inline", header, [buffers])`` carries (0 for frames
    in shared memory and for frames that spilled inline: the spill protocol paces those)."""
    if payload[0] != "inline":
        return 0
    size = len(payload[1]) + sum(len(b) for b in payload[2])
    return size if size <= arena.INLINE_MAX_BYTES else 0


@dataclass
class Unit:
    id: int
    pos: int
    unit: Any
    committed: int = 0  # frames already committed (skipped on re-delivery)


@dataclass
class Order:
    """Reorders frames by sequence key ``(domain, unit, frame)`` (ordered mode).

    A domain is the source (0) or the stateful stage whose outputs are numbered (its index +
    1); a unit's frame count is known once the unit is done (``unit_frames``), so an empty or
    short unit does not hold the ones after it.
    """

    frames: dict = field(default_factory=dict)
    next_seq: tuple | None = None

    def put(self, f: Frame, out: collections.deque, unit_frames: dict) -> None:
        """Park ``f``, then move every frame that is next in sequence to ``out``."""
        self.frames[f.seq] = f
        self.drain(out, unit_frames)

    def drain(self, out: collections.deque, unit_frames: dict) -> None:
        """Move the parked frames that are next in sequence to ``out``."""
        while self.frames:
            nxt = self.next_seq
            if nxt is None:
                nxt = (min(self.frames)[0], 0, 0)  # a domain's first frame
            f = self.frames.pop(nxt, None)
            if f is not None:
                out.append(f)
                self.next_seq = (nxt[0], nxt[1], nxt[2] + 1)
                continue
            total = unit_frames.get((nxt[0], nxt[1]))
            if total is not None and nxt[2] >= total:
                self.next_seq = (nxt[0], nxt[1] + 1, 0)
                continue
            self.next_seq = nxt
            break


@dataclass
class StageState:
    index: int
    target: int
    budget: int
    concurrency: int = 1
    ready: FrameQueue = field(default_factory=FrameQueue)
    order: Order = field(default_factory=Order)
    restarts: int = 0
    closed: bool = False  # no more input will arrive
    done: bool = False
    flush_sent: bool = False
    out_counter: int = 0
    slots: set = field(default_factory=set)
    retired: Any = None  # counters of workers that are gone, summed
    remote: int = 0  # of ``target``, offload workers (multiproc.offload)
    threads: int = 0  # of ``target``, local workers that run as threads
    retired_remote: Any = None  # the part of ``retired`` that offload workers counted
    retired_threads: Any = None  # the part of ``retired`` that local thread workers counted
    skipped: int = 0  # items dropped under on_error="skip"
    last_errors: collections.deque = field(default_factory=lambda: collections.deque(maxlen=3))


class Run:
    """Bookkeeping of one pass over a list of units."""

    def __init__(self, units: Sequence, epoch: int):
        self.units = collections.deque(Unit(i, i, u) for i, u in enumerate(units))
        self.n_units = len(self.units)
        self.units_done = 0
        self.unit_frames: dict = {}  # (domain, pos) -> frames in that unit, once known
        self.epoch = epoch
        self.sink: FrameQueue = FrameQueue()
        self.sink_order = Order()
        self.finished = False
