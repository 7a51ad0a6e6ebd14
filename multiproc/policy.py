"""The router's decisions, as pure functions over worker views (tested without processes).

Which worker gets the next frame (:func:`pick_worker`) or unit (:func:`pick_unit_worker`),
how a stage's budget splits (:func:`budget_share`), which workers retire on a shrink
(:func:`to_retire`), how many items a frame holds (:func:`frame_items`), and backpressure.

A producing worker whose frame does not fit in its arena (the arena is full, or the frame is
bigger than the worker's whole budget) tells the router it is *blocked* and waits. The router
lets it send that one frame inline (``spill_ok``) only when waiting cannot end otherwise:

* :func:`may_spill`: none of the worker's frames is queued or in flight any more (consumers
  hold them all, e.g. ``list(loader)``), so no release is on its way;
* :func:`stalled`: no worker anywhere can make progress and the consumer has nothing to take.
  With ordered delivery a frame can be parked behind a sequence number that a blocked worker
  has yet to produce (a non-stateful stage runs frames in any order); every blocked worker is
  then let through with one frame.

So a pipeline holds at most its budgets plus one frame per worker, and never deadlocks. To
keep that frame small, a source makes frames of at most :data:`FRAME_BYTES` when its items are
large (:func:`frame_items`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from .frames import WorkerState as WS


class WorkerView(Protocol):
    """What the policies read of a worker (``handles.WorkerHandle`` has these fields)."""

    state: WS
    inflight: dict
    blocked: bool
    flushing: bool


class _Worker(Protocol):
    wid: int
    inflight: dict
    ahead: int


W = TypeVar("W", bound=_Worker)

# The smallest share of a stage's budget a worker gets, however many workers share it.
MIN_SHARE_BYTES = 64 * 1024


def pick_worker(ready: Sequence[W], credits: int) -> W | None:
    """The one of ``ready`` workers with the most room, or None when none has any. A worker
    has room for ``credits`` in flight, and a source worker that reads ``ahead`` units at once
    for ``ahead - 1`` more: it starts the next unit as soon as it commits one."""
    h = max(ready, key=lambda h: credits + h.ahead - 1 - len(h.inflight))
    return h if len(h.inflight) < credits + h.ahead - 1 else None


def pick_unit_worker(ready: Sequence[W], credits: int, units_left: int, coming: int) -> W | None:
    """:func:`pick_worker` for a source's next unit, but the last ``coming`` units wait for
    the workers that will take them first (starting and holding none, or yet to be started)
    rather than go to a ready worker as its second: that one reads it only after its first,
    where a new worker reads it side by side (an ``IterableDataset``'s shards, delivered
    round-robin, would come one after the other, the second once the first was read)."""
    h = pick_worker(ready, credits)
    if h is not None and h.inflight and units_left <= coming:
        return None
    return h


def budget_share(budget: int, workers: int) -> int:
    """Each worker's share of its stage's byte budget (its arena's limit)."""
    return max(budget // max(workers, 1), MIN_SHARE_BYTES)


def to_retire(active: Sequence[W], n: int) -> list[W]:
    """The ``n`` workers to retire on a shrink: the least loaded, then the newest (they finish
    what they hold before they go, so the least held means the least waited for)."""
    return sorted(active, key=lambda h: (len(h.inflight), -h.wid))[:n]


# A source's frames hold at most this many bytes of items (and at least one item).
FRAME_BYTES = 4 << 20


def frame_items(item_bytes: int, most: int) -> int:
    """Items per frame for items of ``item_bytes``, at most ``most`` (``StageSpec.frame_items``).

    Decided per work unit from its first item, so a unit delivered again after a worker died
    is framed the same way and its committed frames are skipped exactly.
    """
    return max(1, min(most, FRAME_BYTES // max(item_bytes, 1)))


def may_spill(pending_frames: int) -> bool:
    """Whether a blocked worker with ``pending_frames`` queued or in flight may send inline."""
    return pending_frames <= 0


def _can_progress(h: WorkerView) -> bool:
    if h.state == WS.STARTING:
        return True  # it will take work as soon as it says hello
    if h.state not in (WS.READY, WS.RETIRING) or h.blocked:
        return False
    return bool(h.inflight) or h.flushing


V = TypeVar("V", bound=WorkerView)


def stalled(workers: Iterable[V], sink_frames: int) -> list[V]:
    """The blocked workers to let through because nothing else can move.

    Empty while any worker is starting or working on something, or while the consumer has
    ``sink_frames`` to take (its ``next()`` frees room). Call it after dispatching: a frame the
    router could still hand to an idle worker is progress it makes itself.
    """
    if sink_frames > 0:
        return []
    blocked = []
    for h in workers:
        if _can_progress(h):
            return []
        if h.blocked and h.state in (WS.READY, WS.RETIRING):
            blocked.append(h)
    return blocked
