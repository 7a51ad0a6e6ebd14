"""What the executor's collaborators share: one :class:`ExecutorState`, made by the executor.

:class:`~multiproc.executor.Executor` is a front end over collaborators that each receive
this state, and the collaborators they call, in ``__init__``: :class:`~multiproc.mail.Mail`
(messages for workers), :class:`~multiproc.ledger.Ledger` (arena blocks, frames pending,
backpressure), :class:`~multiproc.lifecycle.WorkerPool` (workers come and go),
:class:`~multiproc.fusion.FusionControl` (stages run in other stages' workers),
:class:`~multiproc.faults.FaultHandler` (stuck workers, timeouts, errors, skips) and
:class:`~multiproc.router.Router` (the router thread). What only one of them uses lives on
that one instead.

Every field is read and written under ``lock`` (``cond``'s lock) but ``sink_frees`` and
``commands`` (deques other threads append to without it) and ``StageState.concurrency`` (set
by the front end, read by the router).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import arena, handles, shm, stats
from .frames import Run, StageState
from .spec import ExecutorSpec

# A request of the front end for the router thread: ("resize", stage, n, remote, threads),
# ("budget", stage, bytes), ("fusion",) or ("concurrency", stage, n).
Command = tuple[Any, ...]


@dataclass(eq=False)
class ExecutorState:
    """The bookkeeping the router thread and the executor's front end share."""

    # The stages and options.
    spec: ExecutorSpec
    # This executor's segments are named ttp_<tag>_...
    tag: str
    # Stage names, by stage index.
    names: list[str]
    # What the finalizer gives back (its ``workers`` and ``segments`` are the fields below);
    # the router's wake pipe.
    res: handles.Resources
    # Every worker's counters, one row per slot.
    counters: stats.CounterTable
    # What the shared-memory directory leaves the budgets.
    room: shm.Room
    # Per stage: worker target, budget, queue, reorder buffer, totals of workers gone.
    stages: list[StageState]
    # Per stage: whether it runs in the previous stage's workers now.
    fused: list[bool]
    # Guards every field (see the module docstring).
    lock: threading.Lock = field(default_factory=threading.Lock)
    # On ``lock``: notified on deliveries, errors and close.
    cond: threading.Condition = field(init=False)
    # The run being delivered, or the last one.
    run: Run | None = None
    # Raised to the consumer at its next call.
    error: BaseException | None = None
    # close() was called.
    closed: bool = False
    # wid -> the router's handle of each worker not yet forgotten.
    workers: dict[int, handles.WorkerHandle] = field(default_factory=dict)
    # Arena name -> its worker's wid.
    by_seg: dict[str, int] = field(default_factory=dict)
    # Every segment to remove at the end.
    segments: set[str] = field(default_factory=set)
    # The arenas this process maps, by name.
    cache: arena.MappingCache = field(default_factory=arena.MappingCache)
    # Arena name -> its frames queued, in flight or held.
    seg_refs: collections.Counter[str] = field(default_factory=collections.Counter)
    # Stage -> bytes its frames take in arenas.
    seg_bytes: collections.Counter[int] = field(default_factory=collections.Counter)
    # (arena, offset) -> bytes of the frame there.
    sizes: dict[tuple[str, int], int] = field(default_factory=dict)
    # Segments of one spilled frame each (multiproc.spill) queued, in flight or held.
    spills: set[str] = field(default_factory=set)
    # wid -> offsets of its arena to tell it to free, at the end of the event.
    pending_free: dict[int, list[int]] = field(default_factory=dict)
    # wid -> its frames queued or in flight (backpressure, ``policy.may_spill``).
    pending_count: collections.Counter[int] = field(default_factory=collections.Counter)
    # (arena, offset) of frames the consumer let go of, for the router to free.
    sink_frees: collections.deque[tuple[str, int]] = field(default_factory=collections.deque)
    # Requests of the front end, handled by the router in order.
    commands: collections.deque[Command] = field(default_factory=collections.deque)
    # Counter rows free for new workers, taken from the end.
    free_slots: list[int] = field(default_factory=list)
    # Worker ids and frame ids, each unique in this executor.
    wids: Iterator[int] = field(default_factory=itertools.count)
    frame_ids: Iterator[int] = field(default_factory=itertools.count)
    # Per worker started: nanoseconds from its start request to its hello.
    start_latencies_ns: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)
