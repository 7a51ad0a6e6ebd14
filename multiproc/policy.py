"""The router's decisions, as pure functions over worker views (tested without processes).

Which worker gets each frame or unit queued for a stage (:func:`assign`, one at a time
:func:`pick_worker` and :func:`pick_unit_worker`), how a stage's budget splits
(:func:`budget_share`), which workers retire on a shrink (:func:`to_retire`), how a resize
moves a stage's workers between kinds (:func:`worker_mix`, :func:`resize_plan`), how many
items a frame holds (:func:`frame_items`), when a stage is done or flushed and a run finished
(:func:`progress`), when a worker passes its stage's ``timeout_s`` (:func:`overdue`,
:func:`next_deadline_s`), and backpressure. The router gathers the plain data they read and
applies what they return (messages, state).

A producing worker whose frame does not fit in its arena (the arena is full, or the frame is
bigger than the worker's whole budget) tells the router it is *blocked* and waits. The router
lets that one frame through without room (``spill_ok``: it travels in a segment of its own,
:mod:`multiproc.spill`) only when waiting cannot end otherwise:

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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, TypeVar

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


class Load(NamedTuple):
    """A ready worker as :func:`assign` sees it."""

    inflight: int  # frames or units it holds now
    ahead: int = 1  # units a source worker reads at once (protocol.UnitDone; else 1)


def _most_room(loads: Sequence[int], aheads: Sequence[int], credits: int) -> int | None:
    """The position of the worker with the most room, or None when none has any. A worker
    has room for ``credits`` in flight, and a source worker that reads ``ahead`` units at once
    for ``ahead - 1`` more: it starts the next unit as soon as it commits one."""
    if not loads:
        return None
    i = max(range(len(loads)), key=lambda i: credits + aheads[i] - 1 - loads[i])
    return i if loads[i] < credits + aheads[i] - 1 else None


def assign(ready: Sequence[Load], credits: int, n: int, coming: int | None = None) -> list[int]:
    """Which of the ``ready`` workers (by position) takes each of the next ``n`` frames or
    units queued for a stage, in queue order: each the one with the most room then
    (:func:`pick_worker`), counting what it was given before it. Shorter than ``n`` from the
    first that no worker has room for.

    Args:
        coming: for a source's units, the workers that will take the last units first
            (starting and holding none, or yet to be started; :func:`coming_workers`): the
            last ``coming`` units wait for them rather than go to a ready worker as its
            second (:func:`pick_unit_worker`). None for frames.
    """
    loads = [w.inflight for w in ready]
    aheads = [w.ahead for w in ready]
    out: list[int] = []
    for k in range(n):
        i = _most_room(loads, aheads, credits)
        if i is None or (coming is not None and loads[i] and n - k <= coming):
            break
        loads[i] += 1
        out.append(i)
    return out


def coming_workers(starting_idle: int, target: int, active: int) -> int:
    """Workers of a source that will take units before they hold any: ``starting_idle`` of
    them started and holding none, and those the stage has yet to start to reach ``target``
    from ``active`` (starting or ready)."""
    return starting_idle + max(0, target - active)


def pick_worker(ready: Sequence[W], credits: int) -> W | None:
    """The one of ``ready`` workers with the most room, or None when none has any. A worker
    has room for ``credits`` in flight, and a source worker that reads ``ahead`` units at once
    for ``ahead - 1`` more: it starts the next unit as soon as it commits one."""
    got = assign([Load(len(h.inflight), h.ahead) for h in ready], credits, 1)
    return ready[got[0]] if got else None


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


# A stage's worker kinds: local processes, local threads (of the executor's process) and
# offload workers (threads forwarding to a remote runtime, multiproc.offload).
WorkerKind = Literal["process", "thread", "remote"]
WORKER_KINDS: tuple[WorkerKind, ...] = ("process", "thread", "remote")


@dataclass(frozen=True)
class Mix:
    """A stage's workers by kind (:data:`WORKER_KINDS`)."""

    processes: int = 0
    threads: int = 0
    remote: int = 0

    def of(self, kind: WorkerKind) -> int:
        """How many workers of ``kind``."""
        return {"process": self.processes, "thread": self.threads, "remote": self.remote}[kind]

    @property
    def total(self) -> int:
        return self.processes + self.threads + self.remote


def threads_problem(n: int, remote: int, threads: int | None) -> str | None:
    """What is wrong with ``threads`` thread workers of a stage resized to ``n`` workers,
    ``remote`` of them offload workers (``Executor.resize``), or None."""
    if threads is None:
        return None
    local = n - remote
    if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= local:
        return f"threads must be an int in [0, {local}] (the local workers of {n}), got {threads!r}"
    return None


def worker_mix(n: int, remote: int, threads: int | None, now: Mix, starts_as_threads: bool) -> Mix:
    """The mix a stage resized to ``n`` workers, ``remote`` of them offload workers, runs.

    Args:
        threads: of the ``n - remote`` local workers, how many run as threads. None: as many
            workers as in ``now`` stay of the kind the stage does not start as (at most the
            local count), and its starting kind takes the rest: a process stage that runs
            ``t`` threads keeps ``t``, a thread stage that runs ``p`` processes keeps ``p``.
        now: the mix it was asked for before.
        starts_as_threads: the stage's workers start as threads (``worker_type="thread"``).
    """
    local = max(0, n - remote)
    if threads is None:
        threads = local - min(now.processes, local) if starts_as_threads else now.threads
    threads = min(threads, local)
    return Mix(local - threads, threads, remote)


@dataclass(frozen=True)
class Split:
    """What a resize does to one kind of a stage's workers."""

    start: int  # workers to start
    retire: int  # workers to retire


def resize_plan(have: Mix, want: Mix) -> dict[WorkerKind, Split]:
    """Per kind, the workers to start and to retire to go from the active workers ``have``
    to ``want``: each kind apart, so a move between kinds starts the new ones while the
    old ones finish what they hold."""
    return {
        k: Split(max(0, want.of(k) - have.of(k)), max(0, have.of(k) - want.of(k)))
        for k in WORKER_KINDS
    }


def next_kind(have: Mix, want: Mix, default: WorkerKind) -> WorkerKind:
    """The kind of the next worker to start toward ``want``: the first kind short of it (in
    :data:`WORKER_KINDS` order), else ``default``."""
    for k in WORKER_KINDS:
        if have.of(k) < want.of(k):
            return k
    return default


# A source's frames hold at most this many bytes of items (and at least one item).
FRAME_BYTES = 4 << 20


def frame_items(item_bytes: int, most: int) -> int:
    """Items per frame for items of ``item_bytes``, at most ``most`` (``StageSpec.frame_items``).

    Decided per work unit from its first item, so a unit delivered again after a worker died
    is framed the same way and its committed frames are skipped exactly.
    """
    return max(1, min(most, FRAME_BYTES // max(item_bytes, 1)))


def may_spill(pending_frames: int) -> bool:
    """Whether a blocked worker with ``pending_frames`` queued or in flight may send its frame
    without room (``spill_ok``)."""
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


@dataclass(frozen=True)
class StageProgress:
    """What :func:`progress` reads of one stage now (its live workers: starting, ready or
    retiring)."""

    done: bool  # found done before: input exhausted, everything through, flushed
    stateful: bool  # a reducer: flushed once its input is through
    busy: bool  # a live worker has work in flight
    queued: bool  # frames queued for it, or parked in its reorder buffer
    starting: bool  # a live worker has yet to say hello
    flush_sent: bool  # its workers were told to flush since its last input
    flushing: bool  # a live worker is flushing
    can_flush: bool  # a live worker is ready (a flush goes to those)
    held: bool  # a live worker holds frames (a reducer's inputs)


@dataclass
class Progress:
    """What :func:`progress` decided; the router applies it in this order."""

    # Stage -> whether its input is exhausted, for each stage not done that was looked at.
    closed: dict[int, bool] = field(default_factory=dict)
    # Stages whose ready workers are to flush now (and that are marked flush_sent).
    flush: list[int] = field(default_factory=list)
    # Stages done from now on.
    done: list[int] = field(default_factory=list)
    # The run is finished: every stage done and nothing parked before the consumer.
    finished: bool = False


def progress(stages: Iterable[StageProgress], units_done: bool, sink_parked: bool) -> Progress:
    """Which stages are done, which reducers flush, and whether the run is finished.

    Stages are looked at in pipeline order (``stages`` is read no further than needed), each
    only once the one before it is done (the first once every unit is done, ``units_done``). A stage is done when its input is
    exhausted and nothing is queued, parked or in flight there; a reducer (``stateful``) also
    when its workers have all said hello, been told to flush since its last input, finished
    flushing and hold nothing. The run is finished when every stage is done and no frame is
    parked for ordered delivery to the consumer (``sink_parked``).
    """
    out = Progress()
    upstream_done = units_done
    for i, s in enumerate(stages):
        if s.done:
            upstream_done = True
            continue
        out.closed[i] = upstream_done
        if not upstream_done or s.busy or s.queued:
            return out
        if s.stateful:
            if s.starting:
                return out
            flushing = s.flushing
            if not s.flush_sent:
                out.flush.append(i)
                flushing = flushing or s.can_flush
            if flushing or s.held:
                return out
        out.done.append(i)
    out.finished = not sink_parked
    return out


class BusyView(Protocol):
    """What :func:`overdue` reads of a worker inside its stage function (``faults.Busy``)."""

    @property
    def stage(self) -> str: ...

    @property
    def seconds(self) -> float: ...


B = TypeVar("B", bound=BusyView)

# The shortest wait for a deadline: a worker about to pass its limit is looked at again then.
MIN_DEADLINE_S = 0.005


def overdue(busy: Iterable[B], limits: Mapping[str, float]) -> list[B]:
    """Of the ``busy`` workers, those in their function for longer than their stage's
    ``timeout_s`` in ``limits`` (stage name -> seconds; a stage not there has none), in the
    order given."""
    return [b for b in busy if b.stage in limits and b.seconds > limits[b.stage]]


def next_deadline_s(now_ns: int, clocks: Iterable[tuple[float, int]]) -> float | None:
    """Seconds until the first of some workers with work in flight passes its stage's
    ``timeout_s``, at least :data:`MIN_DEADLINE_S`; None when there are none.

    Args:
        now_ns: ``time.monotonic_ns()`` now.
        clocks: per worker, its stage's limit in seconds and when it entered its function
            (``monotonic_ns``; 0 when it is not in it now: its whole limit is left).
    """
    soonest = None
    for limit, since in clocks:
        left = limit - (now_ns - since) / 1e9 if since else limit
        soonest = left if soonest is None else min(soonest, left)
    return None if soonest is None else max(soonest, MIN_DEADLINE_S)
