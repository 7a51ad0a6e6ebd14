"""The hard limits below every tuner: the CPU budget, the memory fit, and :class:`Guarded`,
the one place they are applied.

Every decision reaches a pipeline through :class:`Guarded` (the tuning loop, the loader,
:func:`~.loop.run_episode` for the simulator and pre-training): its ``apply`` drops the
fusion requests the pipeline would refuse (:func:`fusable_only`), then runs :func:`safe` and
:func:`fit_memory` once. Tuners only propose; the masks of the InTune agent
query :func:`oversubscribe_factor` to avoid proposing what would be cut.

CPU budget (:func:`safe`, :func:`oversubscribe_factor`): the total worker count may reach
``cpus * factor``, rounded to the nearest worker. Each worker is charged the share of a core
it measurably uses (CPU seconds per item times items per second per worker; its busy fraction
when CPU time is not measured), floored at ``IO_MIN_CHARGE`` for stages that wait on I/O
(:func:`~.base.is_io_bound`), on their neighbours at least ``WAITING_MIN_BLOCKED`` of the
time, or have no work (``StageStats.idle``), and at ``CPU_MIN_CHARGE`` for the others; a full
core before anything was measured. A worker that hosts fused stages is charged the group's CPU
and each member's floor for its share of the worker's time (:func:`charges`). The factor is
``1 + (freed + spare) / cpus`` where ``freed`` sums ``1 - charge`` over the workers and
``spare`` is ``SPARE_CORES`` once anything was measured, capped at ``MAX_OVERSUBSCRIBE``. Over
the budget, the workers stages would gain go first, then the largest stages shrink: measured
charges move from one interval to the next, and an allocation that ran must not lose 36 of its
62 readers (charged 0.1 of a core each) to a few tenths of a core the CPU stages' noise added.
Why these numbers: docs/design.md, "The CPU budget", and BENCHMARKS.md.

Two budgets (:func:`placed`): with a cluster (``Observation.cluster_cpus``), a stage's workers
are local or remote (``Allocation.remote``). Local workers count against the CPU budget as
above; remote ones against the cluster's CPUs (one each, never more than it offers: the
largest remote counts shrink first), and each is charged on the host only its hop's measured
CPU (``hop_cpu_s_per_item`` times its items per second), at least ``REMOTE_MIN_CHARGE`` of a
core: those charges come off the cores the local workers may use. A stage the tuner may not
move (``StageStats.remotable`` False: sources, shuffles, batches, fused stages, and every live
stage, whose placement is fixed) keeps its placement. A remote worker holds no memory on the
host.

Memory (:func:`fit_memory`): an allocation's worst case is every buffer full and every worker
holding what its stage's workers hold now, measured (``StageStats.memory_bytes``), plus the
memory no worker holds (:func:`memory_parts`: the one memory model, which the tuners that weigh
memory read too: InTune's action mask, the planner's worker costs). It must stay within
``MEMORY_SAFE_SHARE`` of the limit: growth (buffers, then workers) that would pass it is
refused, and when the pipeline nears the limit anyway (a UDF cache that grows, bigger items)
buffers are shed first, then workers, before the kernel acts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from multiproc.spec import fused_depth
from multiproc.stats import MAX_FUSED
from torchtune_pipe.tuning.base import (
    Allocation,
    Limits,
    MiB,
    Observation,
    StageStats,
    Tunable,
    clamp,
    fusion_host,
    is_io_bound,
    limits_of,
    local_workers,
    process_workers,
    threads_as_now,
)
from torchtune_pipe.tuning.cluster import remote_of
from torchtune_pipe.tuning.item_costs import per_delivered

LimitsFn = Callable[[Observation], Limits]

# An I/O worker is charged at least this share of a core (a stalled device is not free).
IO_MIN_CHARGE = 0.1
# A worker of any other stage is charged at least this share of a core...
CPU_MIN_CHARGE = 0.5
# ...unless it waits on its neighbours at least this share of the time (then IO_MIN_CHARGE).
WAITING_MIN_BLOCKED = 0.5
# Cores the charged total of a measured pipeline may exceed the CPU count by (docstring)...
SPARE_CORES = 1.0
# ...and the workers in total never more than this many per core.
MAX_OVERSUBSCRIBE = 4.0
# A remote worker's local side (a thread that sends, waits and receives) is charged at least
# this share of a host core: waiting on the call uses none, the hop's CPU is measured.
REMOTE_MIN_CHARGE = 0.01
# Worst-case memory an allocation may reach, as a share of the limit (headroom for noise and
# for memory that grows between two tuning steps).
MEMORY_SAFE_SHARE = 0.95
# Buffers shed down to this before any worker goes (small buffers make neighbouring stages
# wait on each other); past the workers' minimum they go down to the stage minimum.
SHED_BUFFER_FLOOR_BYTES = 4 * MiB
# A buffer's lean size (lean_buffers): LEAN_S seconds of its stage's output where item sizes
# are measured, else LEAN_FILL times the bytes it held; never below room for LEAN_ITEMS takes
# of its reader (buffer_floors), which is also where shedding for memory stops first.
LEAN_S = 0.1
LEAN_ITEMS = 4
LEAN_FILL = 4.0


def _core_share(stage: StageStats) -> float:
    """The share of a core one worker of ``stage`` uses."""
    if stage.cpu_s_per_item > 0.0 and stage.items_per_s > 0.0 and stage.workers > 0:
        return stage.cpu_s_per_item * stage.items_per_s / stage.workers
    return stage.busy


def oversubscribe_factor(obs: Observation, alloc: Allocation | None = None) -> float:
    """How far past ``obs.cpus`` the total local worker count may go for ``alloc``.

    Each local worker frees ``1 - charge`` of a core, where ``charge`` is the core share it
    uses (floored by :func:`charge_floor`); each remote worker takes :func:`remote_charge` of
    one; the factor is ``1 + (freed + spare - remote) / cpus``, capped at
    ``MAX_OVERSUBSCRIBE``, where ``spare`` is ``SPARE_CORES`` once any stage has been measured
    and 0 before (below 1 only when remote workers' hops take cores). A worker sleeping on a
    remote read inside the stage function counts as busy (wall time) but uses almost no CPU:
    the charge must come from CPU time, not from busy time.

    Args:
        obs: the observation whose stage stats classify the stages.
        alloc: the allocation being checked (defaults to the observed one).
    """
    if obs.cpus <= 0:
        return 1.0
    alloc = alloc or obs.allocation()
    remote = remote_of(alloc, obs)
    # A fused stage runs in its host's workers: it has none of its own to charge.
    workers = local_workers(alloc.replace(remote=remote))
    freed = 0.0
    hops = 0.0
    charged = charges(obs)
    for stage, c, w, r in zip(obs.stages, charged, workers, remote, strict=False):
        freed += w * (1.0 - c)
        hops += r * remote_charge(stage)
    measured = any(s.items_per_s > 0.0 or s.idle for s in obs.stages)
    spare = SPARE_CORES if measured else 0.0
    return max(0.0, min(MAX_OVERSUBSCRIBE, 1.0 + (freed + spare - hops) / obs.cpus))


def remote_charge(stage: StageStats) -> float:
    """The share of a host core one remote worker of ``stage`` is charged: its hop's measured
    CPU per second, at least ``REMOTE_MIN_CHARGE``."""
    if stage.remote_workers <= 0:
        return REMOTE_MIN_CHARGE
    used = stage.hop_cpu_s_per_item * stage.remote_items_per_s / stage.remote_workers
    return max(REMOTE_MIN_CHARGE, min(1.0, used))


def charge(stage: StageStats) -> float:
    """The share of a core one worker of ``stage`` is charged (module docstring)."""
    if stage.idle:
        return IO_MIN_CHARGE  # no work this interval: waiting uses no core
    if stage.items_per_s <= 0.0 and not is_io_bound(stage):
        return 1.0  # nothing measured yet: a full core
    return max(charge_floor(stage), min(1.0, _core_share(stage)))


def charges(obs: Observation) -> list[float]:
    """Per stage, the share of a core one of its workers is charged (module docstring). A
    host's workers run the stages fused into it too: they are charged the group's CPU, and
    each member's floor for the share of their time that member takes (its ``busy``), so a
    reader that waits on I/O with a CPU map fused into it, or a CPU reader with lookups that
    wait fused into it, is charged what its workers do, not what its own function does."""
    stages = obs.stages
    fused = [s.fused for s in stages]
    out = [charge(s) for s in stages]
    for h, host in enumerate(stages):
        depth = fused_depth(fused, h)
        if depth == 0 or host.idle or host.workers <= 0 or host.items_per_s <= 0.0:
            continue
        group = stages[h : h + depth + 1]
        time = sum(s.busy for s in group)
        if time <= 0.0:
            continue
        floor = sum(charge_floor(s) * s.busy for s in group) / time
        used = sum(
            s.cpu_s_per_item * s.items_per_s if s.cpu_s_per_item > 0 else s.busy * host.workers
            for s in group
        )
        out[h] = max(floor, min(1.0, used / host.workers))
    return out


def charge_floor(stage: StageStats) -> float:
    """The least share of a core a measured worker of ``stage`` is charged."""
    if stage.idle or is_io_bound(stage) or is_waiting(stage):
        return IO_MIN_CHARGE
    return CPU_MIN_CHARGE


def is_waiting(stage: StageStats) -> bool:
    """True when the stage's workers mostly wait on their neighbours (input, or output space):
    they use no core meanwhile."""
    blocked = stage.blocked_in + stage.blocked_out
    return stage.items_per_s > 0.0 and blocked >= WAITING_MIN_BLOCKED


def _check_stages(alloc: Allocation, obs: Observation, where: str) -> None:
    if len(alloc.workers) != len(obs.stages):
        raise ValueError(
            f"{where}allocation has {len(alloc.workers)} stages but the pipeline has "
            f"{len(obs.stages)} ({', '.join(s.name for s in obs.stages)})"
        )


def safe(alloc: Allocation, obs: Observation, limits: Limits | None = None) -> Allocation:
    """Clamp ``alloc`` to the hard limits of ``obs`` (or ``limits``) with the I/O policy above.

    The result fits the cap computed for itself, so ``safe(safe(a)) == safe(a)``: the cap
    depends on the allocation checked (each worker frees the share of a core its stage leaves
    unused), and an allocation shrunk to the cap of ``alloc`` frees less, so it is clamped
    again until it fits its own.

    Raises:
        ValueError: when ``alloc`` does not have one entry per observed stage.
    """
    _check_stages(alloc, obs, "")
    limits = limits or limits_of(obs)
    if not alloc.remote and any(obs.remote_workers):  # "as now": the count must be explicit
        alloc = alloc.replace(remote=remote_of(alloc, obs))
    was = running_workers(alloc, obs)
    out = clamp(alloc, limits, oversubscribe_factor(obs, alloc), was)
    while (again := clamp(out, limits, oversubscribe_factor(obs, out), was)) != out:
        out = again  # ends: workers only shrink, and never below the stage minimums
    return out


@dataclass(frozen=True)
class MemoryParts:
    """:attr:`Observation.memory_used_bytes` split by what holds it.

    Attributes:
        buffered_bytes: bytes the buffers hold (budget times fill, per stage).
        per_worker_bytes: per stage, what one of its workers holds now (its measured memory
            over its workers; where a stage is not measured, the mean of the measured ones,
            or, when none is, everything outside the buffers spread over every worker; a
            fused stage at least what its host's workers hold).
        fixed_bytes: the rest (the fork server, prefetched copies, arena pages a shrunk
            budget still holds); never negative.
        fused: which stages run fused now (empty: none).
        lightest_bytes: what the lightest measured worker holds (a worker's own memory,
            without what a stage keeps in it).
        threads: thread workers per stage now (``Allocation.threads`` where an allocation
            leaves them open; empty: none).
    """

    buffered_bytes: float
    per_worker_bytes: tuple[float, ...]
    fixed_bytes: float
    fused: tuple[bool, ...] = ()
    lightest_bytes: float = 0.0
    threads: tuple[int, ...] = ()

    def worst_case_bytes(self, alloc: Allocation) -> float:
        """Memory ``alloc`` may reach: every buffer full, every worker costing what one of
        its stage's workers costs now, plus the fixed part. A fused stage runs no workers; a
        stage that ``alloc`` fuses and that runs split now adds to each of its host's
        workers what its own workers hold beyond the lightest worker (a cache moves with the
        function)."""
        # A remote worker holds no memory on the host, a thread worker none of its own.
        own = process_workers(alloc if alloc.threads else alloc.replace(threads=self.threads))
        per = list(self.per_worker_bytes)
        now = self.fused or (False,) * len(per)
        fused = alloc.fused or now
        for j, f in enumerate(fused):
            if f and not now[j]:
                per[fusion_host(fused, j)] += max(0.0, per[j] - self.lightest_bytes)
        workers = sum(w * p for w, p in zip(own, per, strict=True))
        return self.fixed_bytes + workers + sum(alloc.buffer_bytes)


def memory_parts(obs: Observation) -> MemoryParts:
    """Split ``obs.memory_used_bytes`` into buffers, workers per stage and the rest (a
    stage's remote workers hold nothing on the host: its memory is its local workers')."""
    buffered = sum(s.buffer_bytes * s.buffer_fill for s in obs.stages)
    other = max(0.0, obs.memory_used_bytes - buffered)
    threads = tuple(s.threads for s in obs.stages)
    local = [max(0, s.workers - s.remote_workers - s.threads) for s in obs.stages]
    measured = [i for i, s in enumerate(obs.stages) if s.memory_bytes > 0 and local[i] > 0]
    if not measured:
        each = other / max(1, sum(local))
        return MemoryParts(buffered, (each,) * len(obs.stages), 0.0, threads=threads)
    mean = sum(obs.stages[i].memory_bytes for i in measured) / sum(local[i] for i in measured)
    own = [s.memory_bytes / local[i] if i in measured else mean for i, s in enumerate(obs.stages)]
    # A fused stage's workers, once split, may hold all that its host's hold now (a cache of
    # either): charged less, a split that started the cache's workers passed the limit.
    fused = tuple(s.fused for s in obs.stages)
    per_worker = tuple(
        max(own[i], own[fusion_host(fused, i)]) if fused[i] else own[i] for i in range(len(own))
    )
    in_workers = sum(w * p for w, p in zip(local, per_worker, strict=True))
    lightest = min(own[i] for i in measured)
    return MemoryParts(
        buffered, per_worker, max(0.0, other - in_workers), fused, lightest, threads=threads
    )


def running_workers(alloc: Allocation, obs: Observation) -> list[int]:
    """Per stage, the workers that run now as the hard limits weigh ``alloc``'s growth
    against them: ``obs``'s, except for a stage whose fusion ``alloc`` changes (split out of
    its group, or fused into one), which counts what ``alloc`` gives it. Its workers are its
    group's (a fused stage reports none of its own): refusing a newly split stage's workers as
    growth would cut what runs, its group's work, to one worker or none."""
    was = list(obs.allocation().workers)
    if alloc.fused:
        now = tuple(s.fused for s in obs.stages)
        for j, f in enumerate(alloc.fused):
            if f != now[j]:
                was[j] = alloc.workers[j]
    return was


def fit_memory(
    alloc: Allocation,
    obs: Observation,
    share: float = MEMORY_SAFE_SHARE,
    min_buffer_bytes: int = 64 * 1024,
) -> Allocation:
    """Keep ``alloc``'s worst-case memory within ``share`` of ``obs``'s limit (module docstring):
    the one memory fit, every tuner's decision through :class:`Guarded`.

    In order, until the worst case (:meth:`MemoryParts.worst_case_bytes`) fits: refuse buffer
    growth past what runs now, then worker growth past what runs now (:func:`running_workers`;
    stage by stage, the stage whose workers hold the most first, never below its
    ``min_workers``); halve the largest buffer down to its floor (:func:`buffer_floors`); remove a
    worker from the stage whose workers hold the most (never below its ``min_workers``); halve
    the largest buffer down to ``min_buffer_bytes``. An allocation that fits is returned
    unchanged.

    Raises:
        ValueError: when ``alloc`` does not have one entry per observed stage.
    """
    _check_stages(alloc, obs, "fit_memory(): ")
    parts = memory_parts(obs)
    limit = share * obs.memory_limit_bytes
    if limit <= 0 or parts.worst_case_bytes(alloc) <= limit:
        return alloc
    now = obs.allocation()
    workers, buffers = list(alloc.workers), list(alloc.buffer_bytes)

    def over() -> bool:
        return parts.worst_case_bytes(alloc.replace(workers=workers, buffer_bytes=buffers)) > limit

    def shed_buffers(floors: Sequence[int]) -> None:
        # The largest buffer above its floor halves first, never below it (nor
        # min_buffer_bytes).
        low = [max(f, min_buffer_bytes) for f in floors]
        while over():
            above = [i for i in range(len(buffers)) if buffers[i] > low[i]]
            if not above:
                return
            i = max(above, key=buffers.__getitem__)
            buffers[i] = max(low[i], buffers[i] // 2)

    buffers = [min(b, c) for b, c in zip(buffers, now.buffer_bytes, strict=True)]
    # Worker growth is refused stage by stage, the costliest workers first: one stage whose
    # workers hold a lot (a cache, a shuffle buffer) does not stop the others from growing.
    # A fused stage's workers are a target for when it is split again: they hold nothing.
    # Only local workers hold memory on the host: their growth is refused, they are shed.
    fused = alloc.fused or (False,) * len(workers)
    remote = alloc.remote or (0,) * len(workers)
    running = running_workers(alloc, obs)
    was = [w - r for w, r in zip(running, now.remote or (0,) * len(workers), strict=True)]
    floors = [max(1, s.min_workers) for s in obs.stages]
    grown = [j for j in range(len(workers)) if workers[j] - remote[j] > was[j] and not fused[j]]
    for j in sorted(grown, key=lambda k: -parts.per_worker_bytes[k]):
        if not over():
            break
        workers[j] = max(floors[j], remote[j] + was[j])
    shed_buffers(buffer_floors(obs))
    while over():
        costly = [
            j
            for j in range(len(workers))
            if workers[j] > max(floors[j], remote[j]) and not fused[j]
        ]
        if not costly:
            break
        j = max(costly, key=lambda k: (parts.per_worker_bytes[k], workers[k]))
        workers[j] -= 1
    shed_buffers([0] * len(buffers))
    return alloc.replace(workers=tuple(workers), buffer_bytes=tuple(buffers))


def take_bytes(obs: Observation) -> list[float]:
    """Per stage, the bytes that the stage reading its buffer (the next one that runs workers
    of its own; the consumer after the last) takes for one item of its own: a collate of 8192
    rows takes 8192 rows. A host's buffer carries its group's last stage's items. 0 where
    item sizes are not measured (``bytes_per_item``) and for a fused stage (its buffer carries
    nothing)."""
    r = per_delivered(obs)
    n = len(obs.stages)
    fused = tuple(s.fused for s in obs.stages)
    out = []
    for i, st in enumerate(obs.stages):
        last = i + fused_depth(fused, i)  # the group's last stage (i when nothing is fused)
        j = last + 1  # its reader
        takes = 1.0 if j == n or r[j] <= 0 else max(1.0, r[last] / r[j])
        out.append(0.0 if st.fused else max(0.0, obs.stages[last].bytes_per_item) * takes)
    return out


def buffer_floors(obs: Observation) -> list[int]:
    """Per stage, the least its buffer is shed to for memory before workers go: room for
    ``LEAN_ITEMS`` takes of its reader (:func:`take_bytes`; a collate's buffer smaller than
    one batch's rows stalls it and every stage before it), at least
    ``SHED_BUFFER_FLOOR_BYTES``."""
    return [max(SHED_BUFFER_FLOOR_BYTES, math.ceil(LEAN_ITEMS * b)) for b in take_bytes(obs)]


def floored_buffers(obs: Observation, alloc: Allocation) -> tuple[int, ...]:
    """``alloc``'s buffers, each raised to its floor (:func:`buffer_floors`) where its reader's
    takes are measured: a collate's buffer smaller than its batch's rows stalls it and every
    stage before it."""
    floors, takes = buffer_floors(obs), take_bytes(obs)
    return tuple(
        max(b, f) if t > 0 else b for b, f, t in zip(alloc.buffer_bytes, floors, takes, strict=True)
    )


def lean_buffers(obs: Observation, alloc: Allocation) -> tuple[int, ...]:
    """Per stage, the least buffer a plan may shrink ``alloc``'s to where memory bounds it (the
    planner's), at most what it is and at least its floor (:func:`buffer_floors`): where the
    size of its items is measured (``bytes_per_item``), ``LEAN_S`` of the bytes its stage
    emits (a full buffer only holds a producer ahead of a slower reader, which the plan
    rebalances); else ``LEAN_FILL`` times the bytes it held (``buffer_fill``). A fused stage's
    buffer carries nothing while it runs fused."""
    out = []
    floors = buffer_floors(obs)
    for b, st, floor in zip(alloc.buffer_bytes, obs.stages, floors, strict=True):
        if st.fused:
            need = 0.0
        elif st.bytes_per_item > 0:
            need = st.bytes_per_item * LEAN_S * st.items_per_s
        else:
            need = LEAN_FILL * st.buffer_fill * b
        out.append(int(min(b, math.ceil(max(floor, need)))))
    return tuple(out)


def within_limits(alloc: Allocation, obs: Observation, limits: Limits | None = None) -> Allocation:
    """``alloc`` as the hard limits let it through: :func:`safe`, then :func:`fit_memory`
    (buffers down to ``limits.min_buffer_bytes`` at most). What :class:`Guarded` applies.

    Raises:
        ValueError: when ``alloc`` does not have one entry per observed stage.
    """
    limits = limits or limits_of(obs)
    alloc = kinds(placed(fusable_only(alloc, obs), obs), obs)
    return fit_memory(safe(alloc, obs, limits), obs, min_buffer_bytes=limits.min_buffer_bytes)


def placed(alloc: Allocation, obs: Observation) -> Allocation:
    """``alloc`` with its remote workers where the pipeline can run them (module docstring).

    A stage that is not ``remotable`` keeps its placement (all remote if all its workers run
    remote now, else its remote count), at most its workers; a remotable stage that runs fused
    or hosts a fused stage (in ``alloc``'s fusion) runs none; the remote workers in total
    stay within ``floor(obs.cluster_cpus)``, the largest remote counts shrinking first (a
    shrunk remote worker is dropped, not made local: the local budget did not plan for it).
    ``remote`` is left empty when no stage runs remote workers.

    Raises:
        ValueError: when ``alloc`` does not have one entry per observed stage.
    """
    _check_stages(alloc, obs, "")
    want = list(remote_of(alloc, obs))
    workers = list(alloc.workers)
    kept = remote_of(alloc.replace(remote=()), obs)
    fused = alloc.fused or tuple(s.fused for s in obs.stages)
    for j, st in enumerate(obs.stages):
        if not st.remotable:
            want[j] = kept[j]
        elif fused[j] or (j + 1 < len(fused) and fused[j + 1]):
            want[j] = 0  # a fused group runs where its host runs: on the host
    # What runs where it is pinned (a placement="ray" stage) is the executor's and Ray's to
    # place; the cluster CPUs it leaves are the movable stages' budget.
    movable = [j for j, st in enumerate(obs.stages) if st.remotable]
    pinned = sum(want[j] for j in range(len(want)) if j not in movable)
    cap = max(0, int(obs.cluster_cpus + 1e-9) - pinned)
    while movable and sum(want[j] for j in movable) > cap:
        j = max(movable, key=want.__getitem__)
        want[j] -= 1
        if workers[j] > max(1, obs.stages[j].min_workers):
            workers[j] -= 1
    remote = tuple(want) if any(want) or any(obs.remote_workers) else ()
    return alloc.replace(workers=tuple(workers), remote=remote)


def kinds(alloc: Allocation, obs: Observation) -> Allocation:
    """``alloc`` with its thread workers where the pipeline can run them: a stage that is not
    ``threadable`` keeps the kind it runs (:func:`~.base.threads_as_now`), and no stage runs
    more than its local workers as threads. An allocation that leaves the kind open (``threads`` empty: the pipeline's kind
    rule decides) is returned unchanged.

    Raises:
        ValueError: when ``alloc`` does not have one entry per observed stage.
    """
    if not alloc.threads:
        return alloc
    _check_stages(alloc, obs, "")
    local = local_workers(alloc)
    threads = tuple(
        min(t, n) if st.threadable else threads_as_now(st, n)
        for t, st, n in zip(alloc.threads, obs.stages, local, strict=True)
    )
    return alloc.replace(threads=threads)


def fusable_only(alloc: Allocation, obs: Observation) -> Allocation:
    """``alloc`` without the fusion requests the pipeline would refuse.

    A stage may be fused when ``obs`` says it is fused or ``fusable`` now, and the group it
    joins stays within ``MAX_FUSED`` stages after its host, checked in pipeline order as a
    pipeline applies them (a live ``set_fused`` raises on any other; the simulator too).
    A refused request leaves the stage as it runs now; splitting is always allowed. An
    allocation that leaves fusion open (``fused`` empty) is returned unchanged.

    Raises:
        ValueError: when ``alloc`` does not have one entry per observed stage.
    """
    if not alloc.fused:
        return alloc
    _check_stages(alloc, obs, "")
    state = [s.fused for s in obs.stages]
    for j, want in enumerate(alloc.fused):
        if want == state[j]:
            continue
        if want:
            if not obs.stages[j].fusable:
                continue
            state[j] = True
            host, end = fusion_host(state, j), j
            while end + 1 < len(state) and state[end + 1]:
                end += 1
            if end - host > MAX_FUSED:
                state[j] = False
                continue
        state[j] = want
    return alloc.replace(fused=tuple(state))


class Guarded:
    """A :class:`~.base.Tunable` whose ``apply`` keeps every allocation within the hard limits.

    The one place the limits are applied, for the live pipeline and the simulator alike:
    ``apply(allocation)`` clamps it to the limits of the latest observation (:func:`safe`)
    and fits it to memory (:func:`fit_memory`), once, then applies the result to the wrapped
    tunable. A tuner whose decision stays the same while memory grows still sheds, because
    every call fits again.

    Args:
        tunable: the pipeline (or simulator) to steer.
        limits_fn: the hard limits for an observation (default: :func:`~.base.limits_of`).

    Example:
        >>> pipe = Guarded(SimPipeline(workload, cpus=8, memory_limit_bytes=8 << 30))
        >>> obs = pipe.observe(); pipe.apply(tuner.reset(obs)); pipe.applied
    """

    def __init__(self, tunable: Tunable, limits_fn: LimitsFn | None = None) -> None:
        if isinstance(tunable, Guarded):
            inner: Guarded = tunable
            limits_fn = limits_fn or inner.limits_fn
            tunable = inner.tunable
        self.tunable: Tunable = tunable
        self.limits_fn: LimitsFn | None = limits_fn
        self.last: Observation | None = None
        self.applied: Allocation | None = None

    def observe(self) -> Observation:
        """The wrapped tunable's observation (kept: the next ``apply`` is judged by it)."""
        self.last = self.tunable.observe()
        return self.last

    def fit(self, allocation: Allocation, obs: Observation) -> Allocation:
        """``allocation`` within the limits of ``obs``: the CPU budget, then memory.

        Raises:
            ValueError: when ``allocation`` does not have one entry per observed stage.
        """
        return within_limits(allocation, obs, self.limits_fn(obs) if self.limits_fn else None)

    def apply(self, allocation: Allocation) -> None:
        """Apply ``allocation`` as :meth:`fit` lets it through (recorded in :attr:`applied`)."""
        obs = self.last if self.last is not None else self.observe()
        self.applied = self.fit(allocation, obs)
        self.tunable.apply(self.applied)
