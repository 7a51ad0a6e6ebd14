"""A one-shot worker plan from measured stage rates: where the InTune agent can jump.

A DQN that moves one stage by one or five workers per step needs tens of steps to cross a
128-CPU machine after a rescale. The planner inverts the pipeline's fluid model from one
observation instead, so the agent can take the whole move in one action ("plan") and keep its
incremental actions for what the model gets wrong. The agent decides when to plan; the
measurement decides whether the plan stays (a plan that costs throughput is undone like any
other worker move).

From one interval with ``X`` items/s delivered, per stage ``i``: ``r_i`` items of the stage
per delivered item, ``g_i`` CPU seconds, ``a_i`` worker (wall) seconds and ``q_i`` seconds
runnable but waiting for a CPU per delivered item (:mod:`~.item_costs`), and

* ``u_i = g_i + max(0, a_i - g_i - q_i) * k_i / K_i``: worker seconds per item on an
  uncontended machine (CPU plus waiting on I/O), where a stage at ``k_i`` calls in flight per
  worker is being raised to ``K_i`` by the concurrency rule below every tuner
  (:func:`~.calls_in_flight.settled_concurrency`): its wait goes to threads, not processes. Such
  a stage keeps the workers it has until its calls in flight settle (processes bought for a
  wait its threads are about to take run idle after, and a run's peak memory is theirs).

A stage or fused group whose ``u`` exceeds its ``g`` by less than ``WAIT_NOISE`` (5%) is planned
at its CPU: that much is measurement noise in CPU-bound workers.

Where the run-queue delay is not measured (the simulator), ``q_i = g_i / phi - g_i`` with
``phi`` the CPU rate a runnable worker got: the median of ``g_i / a_i`` over CPU-bound stages
(1 when there are none, at most 1).

For a target rate ``T`` stage ``i`` needs ``n_i`` workers for ``T * u_i`` of need with
``HEADROOM`` (:func:`~.capacity.workers_for`, the rate model the split between host and
cluster uses too), each charged the CPU it would use, ``max(floor_i, T * g_i / n_i)`` of a core
(the safety policy's floors, :mod:`~torchtune_pipe.tuning.safety`). The plan
is the largest ``T`` (bisection) with ``T * sum g <= budget``, charged cores ``<= cpus``,
``sum n <= MAX_OVERSUBSCRIBE * cpus``, worst-case memory within the limit, and ``T`` no faster
than the consumer takes items. The budget is ``cpus`` while the busy stages' workers get a CPU
whenever they can run, and only the CPU they use now (``X * sum g``) once they wait for one a
fifth of their runnable time (``sum q >= (1 - SATURATED) * sum (g + q)``), in between in
proportion (:func:`~.run_queue.cpu_budget`), and never below what the running workers use at
the rate the model gives them (it holds back processes, it does not take away those that run):
workers that queue for a CPU run on cores that are taken, by the pipeline's own threads in
their bursts, the consumer or other processes, and another process would take its CPU from them.
In the simulator ``q`` comes from ``phi``, below 1 only when the machine is oversubscribed,
where ``X * sum g`` is ``cpus`` already.

Fusion. The plan also chooses which stages run fused (``Allocation.fused``): a group (a host and
the stages fused into it) is planned as one stage with the host's workers, costing the sum of
its members' ``g_i`` and ``u_i``, charged each member's floor for the share of its worker time
that member takes (a reader that waits 60 us per item with a 5 us CPU map fused into it is not
charged half a core per worker as the map alone would be). The plan takes a hop of
CPU (and worker time) per item per channel crossed (:func:`~.item_costs.channel_hops`, from the
time the stages' workers spend decoding and encoding frames, ``StageStats.hop_s_per_item``;
never below ``HOP_S_PER_ITEM``, the prior where nothing measures it): a stage whose output stops
crossing one (its next stage fused) saves it, and one that starts crossing pays it. From every
stage split, in pipeline order, a stage that may be fused (``StageStats.fusable``, or fused now)
is fused when the model gains more than ``FUSE_MIN_GAIN`` by it, or when it is cheap (its own
CPU per item at most ``CHEAP_HOPS`` hops) or fused now and loses nothing; else it runs split (a
channel inside a fused group is priced at what it cost when last crossed, ``known_hops``). Stages that
wait on I/O or keep calls in flight stay split, and nothing is fused into a host that waits on
I/O (a stage fused now stays fused while its host's calls in flight are rising: the wait
measured is what the host's threads are about to take): a fused stage runs one call at a time
in its host's workers, and a group that both waits and computes is one the plan's per-stage
split of wait and CPU time misjudges. The shape running now is kept when the shape so built is slower by the
same model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from multiproc.spec import fused_depth
from multiproc.stats import MAX_FUSED
from torchtune_pipe.tuning.base import Allocation, Observation, fusion_host
from torchtune_pipe.tuning.calls_in_flight import settled_concurrency
from torchtune_pipe.tuning.capacity import Station, capacity, rate_of, station_capacity, workers_for
from torchtune_pipe.tuning.item_costs import (
    channel_hops,
    cpu_and_idle,
    per_delivered,
    worker_seconds,
)
from torchtune_pipe.tuning.placement import local_headroom, local_wall, movable, place, remote_terms
from torchtune_pipe.tuning.run_queue import cpu_budget
from torchtune_pipe.tuning.safety import (
    MAX_OVERSUBSCRIBE,
    MEMORY_SAFE_SHARE,
    charge_floor,
    floored_buffers,
    is_io_bound,
    lean_buffers,
)

# Workers planned per unit of measured need: room for noise and heavy-tailed items.
HEADROOM = 1.2
# Share of the memory limit the planned workers and buffers may fill in the worst case: all the
# hard limits let any allocation fill (planned to less, memory-bound plans gave up workers
# the oracle runs: benchmarks/generalize.py, 29 cases under 0.9 of it against 56 at 0.9).
MEMORY_SHARE = MEMORY_SAFE_SHARE
_BISECT_STEPS = 40
# A group (a stage and those fused into it) whose worker seconds per item exceed its CPU by
# less than this share is CPU-bound: the rest is measurement noise (_Model.groups).
WAIT_NOISE = 0.05
# A stage is fused only when the model gains more than this by it: a split stage keeps its own
# workers, calls in flight and buffer, so a tie stays split.
FUSE_MIN_GAIN = 0.02
# A stage whose own CPU per item is at most this many hops is cheap: fused whenever that loses
# nothing (a hop then costs a third or more of what the stage does).
CHEAP_HOPS = 2.0
# Where memory bounds the plan, buffers shrink to their lean size (safety.lean_buffers) when
# the memory that frees buys more than this.
LEAN_MIN_GAIN = 0.02


@dataclass(frozen=True)
class Plan:
    """A planned allocation, the delivered rate the fluid model expects from it, and the rate
    the same model (same headroom) gives the allocation the plan was made under; ``rate_of``:
    the rate it gives any worker counts of the stages as they run (as many of them remote
    as run remote now; None: not given)."""

    allocation: Allocation
    throughput: float
    current: float = 0.0
    rate_of: Callable[[Sequence[int]], float] | None = field(default=None, compare=False)


def plan(
    obs: Observation,
    alloc: Allocation,
    *,
    per_worker_bytes: float | Sequence[float] = 0.0,
    fixed_bytes: float = 0.0,
    headroom: float = HEADROOM,
    fusion: bool = True,
    known_hops: Sequence[float] = (),
) -> Plan | None:
    """The worker counts (and fusion) that balance the stages of ``obs`` at the highest
    feasible rate, and the buffers for it.

    The buffers are ``alloc``'s, each raised to its floor where its reader's takes are
    measured (:func:`~.safety.floored_buffers`); where memory bounds the plan, each buffer
    that holds far more than it used (:func:`~.safety.lean_buffers`) shrinks where the memory
    it frees buys workers worth more than ``LEAN_MIN_GAIN`` by the same model. A buffer's
    budget is memory the hard limits count as full (their worst case), whatever it holds.

    Args:
        obs: one measured interval (every stage must have emitted items or be idle).
        alloc: the allocation in force (its buffers: above).
        per_worker_bytes: memory one more worker costs (:func:`~.safety.memory_parts`), one
            number or one per stage (:func:`_worker_bytes`).
        fixed_bytes: memory outside buffers and workers.
        headroom: workers per unit of measured need (>= 1).
        fusion: choose which fusable stages run fused (module docstring); False keeps the
            stages as they run.
        known_hops: per channel, its hop per item of the stage before it as last measured
            while crossed (:func:`~.item_costs.crossed_hops`; 0 or missing: not known), for channels
            that no stage measures now (inside a fused group).

    Returns:
        The plan, or None when the interval measured nothing to plan from.
    """
    if headroom < 1.0:
        raise ValueError(f"plan(): headroom must be >= 1, got {headroom}")
    kw = dict(
        per_worker_bytes=per_worker_bytes, fixed_bytes=fixed_bytes, headroom=headroom,
        fusion=fusion, known_hops=known_hops,
    )  # fmt: skip
    alloc = alloc.replace(buffer_bytes=floored_buffers(obs, alloc))
    found = _plan(obs, alloc, **kw)
    lean = lean_buffers(obs, alloc)
    if lean == tuple(alloc.buffer_bytes):
        return found
    roomier = _plan(obs, alloc.replace(buffer_bytes=lean), **kw)
    if roomier is not None and (
        found is None or roomier.throughput > (1.0 + LEAN_MIN_GAIN) * found.throughput
    ):
        return roomier
    return found


def _plan(
    obs: Observation,
    alloc: Allocation,
    *,
    per_worker_bytes: float | Sequence[float],
    fixed_bytes: float,
    headroom: float,
    fusion: bool,
    known_hops: Sequence[float],
) -> Plan | None:
    """:func:`plan` with ``alloc``'s buffers."""
    x = obs.stages[-1].items_per_s if obs.stages else 0.0
    if x <= 0 or obs.cpus <= 0 or any(s.items_per_s <= 0 and not s.idle for s in obs.stages):
        return None
    n = len(obs.stages)
    # An idle stage (no work this interval, e.g. a source done with the epoch) keeps its
    # workers: the interval says nothing about what it needs.
    io = [is_io_bound(s) for s in obs.stages]
    r = per_delivered(obs)
    g, idle = cpu_and_idle(obs, r)
    now = tuple(s.fused for s in obs.stages)
    per_item = worker_seconds(obs, r)
    a = per_item([s.busy for s in obs.stages])
    if all(s.runqueue is not None for s in obs.stages):
        q = per_item([s.runqueue for s in obs.stages])
    else:
        rates = sorted(g[i] / a[i] for i in range(n) if not io[i] and a[i] > 0 and g[i] > 0)
        phi = min(1.0, max(0.05, rates[len(rates) // 2])) if rates else 1.0
        q = [g[i] / phi - g[i] for i in range(n)]
    # A stage whose calls in flight the concurrency rule is raising (below every tuner) will
    # wait that many times less per item on each worker: threads take the wait, not processes.
    k = [s.concurrency / settled_concurrency(s) for s in obs.stages]
    rising = [x < 1.0 for x in k]
    u = local_wall(
        obs, [max(1e-12, g[i] + max(0.0, a[i] - g[i] - q[i]) * k[i]) for i in range(n)], r
    )
    floor = [charge_floor(s) for s in obs.stages]
    # (At least one: a fused stage reports 0 workers, and a shape may split it.)
    lo = [
        max(1, obs.workers[i]) if idle[i] else max(1, s.min_workers)
        for i, s in enumerate(obs.stages)
    ]
    hi = [lo[i] if idle[i] else max(lo[i], s.max_workers) for i, s in enumerate(obs.stages)]
    for i in range(n):
        if rising[i] and obs.workers[i] > 0 and not idle[i]:
            # Its calls in flight are still rising: the wait it measured is what its threads
            # are about to take, so it keeps its processes until they settle (module
            # docstring).
            lo[i] = hi[i] = min(hi[i], max(lo[i], obs.workers[i]))
    memory_left = obs.memory_limit_bytes * MEMORY_SHARE - fixed_bytes - sum(alloc.buffer_bytes)
    model = _Model(
        obs, g, u, floor, lo, hi, idle, headroom, _worker_bytes(obs, per_worker_bytes), memory_left
    )
    # (Never below what the running workers use at the rate the model gives them: the budget
    # holds back more processes, it does not take away the ones that run.)
    running = model.rate_of(now, obs.workers) * sum(g)
    model.cpus = min(obs.cpus, max(cpu_budget(x, g, q, idle, obs.cpus), running))
    hop = channel_hops(obs, r, known_hops)
    shape = now
    if fusion and any(s.fusable or s.fused for s in obs.stages):
        model.allow_split()
        shape = _fusion_shape(obs, model, hop, io, idle, rising)
    shape = _movable_apart(obs, shape)
    found = model.solve(shape, now, hop)
    kept = _apart_from_calls(obs, _movable_apart(obs, now), rising)
    if shape != kept:
        # The shape is built from every stage split and leaves apart what it may not fuse (a
        # stage flagged as waiting, which a fused stage's share of its host's time can be by
        # noise): it must not lose to the shape running now by the same model.
        as_now = model.solve(kept, now, hop)
        if as_now is not None and (found is None or as_now[0] > found[0]):
            shape, found = kept, as_now
    split = _split(obs, model, shape, now, hop, r, found)
    if found is None and split is None:
        return None
    remote: tuple[int, ...] = ()
    if split is not None:
        rate, workers, remote = split
    else:
        assert found is not None
        rate, workers = found
    fused = shape if any(shape) or any(now) else ()
    rate_of_now: Callable[[Sequence[int]], float] = functools.partial(model.rate_of, now)
    if any(obs.remote_workers):
        rate_of_now = functools.partial(_split_rate, obs, model, now, r)
    current = rate_of_now(obs.workers)
    plan_ = Allocation(workers, alloc.buffer_bytes, fused=fused, remote=remote)
    return Plan(plan_, rate, current, rate_of_now)


def _apart_from_calls(
    obs: Observation, shape: tuple[bool, ...], rising: list[bool]
) -> tuple[bool, ...]:
    """``shape`` with nothing fused into a host that keeps calls in flight once they settle:
    a fused stage runs one call at a time in its host's workers, which the model, pricing
    the group as the sum of its members' times, does not see (the shape running now is kept
    over the one built only by the same model, module docstring)."""
    out = list(shape)
    for j in range(1, len(shape)):
        h = fusion_host(shape, j - 1)
        if shape[j] and obs.stages[h].concurrency > 1 and not rising[h]:
            out[j] = False
    return tuple(out)


def _movable_apart(obs: Observation, shape: tuple[bool, ...]) -> tuple[bool, ...]:
    """With a cluster, no stage that may move (``remotable``) is fused, nor fused into: a
    fused group runs where its host runs, on the host, and the cluster is the larger budget
    (a fused shape that saves a hop's CPU per item keeps a stage of tens of microseconds per
    item from moving; in ``benchmarks/cluster_sim.py`` the best static splits ran every such
    stage split)."""
    if obs.cluster_cpus < 1:
        return shape
    movable = [s.remotable for s in obs.stages]
    return tuple(f and not movable[j] and not movable[j - 1] for j, f in enumerate(shape))


def _stations(obs: Observation, model: _Model, shape, now, hop, r) -> list[Station]:
    """The groups of ``shape`` as :func:`~.placement.place` sees them: a stage on its own
    that may run remote (``remotable``, hosting nothing) with its remote terms."""
    groups, _, _ = model.groups(shape, now, hop)
    n = len(shape)
    out = []
    for h, members, gg, ug, fl, lo, hi, idle, _ in groups:
        terms = (0.0, 0.0, 0.0)
        if len(members) == 1 and obs.stages[h].remotable and not (h + 1 < n and shape[h + 1]):
            terms = remote_terms(obs, h, r[h])
        headroom = local_headroom(gg, ug, model.headroom)
        out.append(Station(h, gg, ug, fl, lo, hi, idle, *terms, headroom=headroom))
    return out


def _split(obs: Observation, model: _Model, shape, now, hop, r, found):
    """With a cluster: the rate, workers and remote workers per stage of the best split of
    ``shape``'s stations between host and cluster (:func:`~.placement.place`), when it beats
    the host alone (``found``); else None. Remote workers are explicit (0: bring them back)."""
    if obs.cluster_cpus < 1 and not any(obs.remote_workers):
        return None
    stations = _stations(obs, model, shape, now, hop, r)
    busy = [s for s in stations if not s.idle]
    top = min([model.consumer_rate()] + [station_capacity(s, s.hi, 0) for s in busy])
    top = max(top, max((station_capacity(s, 0, s.hi) for s in busy if movable(s)), default=0))
    host = sum(min(s.g, s.h) if movable(s) else s.g for s in stations)
    top = min(top, obs.cpus / max(host, 1e-12), model.consumer_rate())
    placed = place(
        obs, stations, top, per_worker_bytes=model.per_worker_bytes,
        memory_left=model.memory_left, allowance=model.allowance,
    )  # fmt: skip
    if placed is None or (found is not None and placed.rate <= found[0] * (1 + 1e-9)):
        if found is None or not any(obs.remote_workers):
            return None
        return found[0], found[1], (0,) * len(shape)
    workers = list(found[1]) if found is not None else list(model.lo)
    remote = [0] * len(shape)
    for s, n_local, n_remote in zip(stations, placed.local, placed.remote, strict=True):
        workers[s.stage] = n_local + n_remote
        remote[s.stage] = n_remote
    return placed.rate, tuple(workers), tuple(remote)


def _split_rate(obs: Observation, model: _Model, now, r, workers=None) -> float:
    """The rate the plan's model gives the workers as they run, local and remote (or
    ``workers``, as many remote as run now)."""
    stations = _stations(obs, model, now, now, [0.0] * len(now), r)
    remote, workers = obs.remote_workers, obs.workers if workers is None else workers
    local = [max(0, workers[s.stage] - remote[s.stage]) for s in stations]
    far = [remote[s.stage] for s in stations]
    return rate_of(stations, local, far, obs.cpus, model.consumer_rate())


def _fusion_shape(
    obs: Observation,
    model: _Model,
    hop: list[float],
    io: list[bool],
    idle: list[bool],
    rising: list[bool],
) -> tuple[bool, ...]:
    """Which stages to fuse (module docstring): from every stage split, in pipeline order, a
    stage is fused when the model gains more than ``FUSE_MIN_GAIN`` by it, or when it is
    cheap (its own CPU per item at most ``CHEAP_HOPS`` hops) or fused now, and fusing loses
    nothing (the rates tie when the consumer or a bound limits them: the hop's CPU is still
    saved, and a fused stage's hop is not measured). Stages
    that wait on I/O or keep calls in flight, and stages after a host that waits on I/O, stay
    split; but a stage fused now into a host whose calls in flight are rising (``rising``: the
    concurrency rule is raising them) stays fused: the host's wait is what its threads are
    about to take."""
    n, now = len(obs.stages), tuple(s.fused for s in obs.stages)
    split, _ = model.costs([False] * n, now, hop)
    # What each stage's own function costs: its cost split, less the hop its output pays.
    own = [max(0.0, split[i] - hop[i]) for i in range(n)]
    shape = [False] * n
    best = model.solve(tuple(shape), now, hop)
    best_rate = best[0] if best is not None else 0.0
    for j in range(1, n):
        s = obs.stages[j]
        if not (s.fusable or s.fused) or s.concurrency > 1 or idle[j] or idle[j - 1]:
            continue
        if now[j] and rising[fusion_host(shape, j - 1)]:
            shape[j] = True
            continue
        if io[j] or io[fusion_host(shape, j - 1)]:
            continue  # a group that waits on I/O and computes: kept apart (module docstring)
        shape[j] = True
        host, end = fusion_host(shape, j), j
        while end + 1 < n and shape[end + 1]:
            end += 1
        found = model.solve(tuple(shape), now, hop) if end - host <= MAX_FUSED else None
        # A tie fuses a cheap stage, and keeps a fused one fused: inside a group nothing
        # measures the hop a split would pay, and splitting gains nothing the model sees.
        tie_fuses = now[j] or own[j] <= CHEAP_HOPS * hop[j - 1]
        if found is not None and (
            found[0] > (1.0 + FUSE_MIN_GAIN) * best_rate
            or (tie_fuses and found[0] >= best_rate * (1.0 - 1e-9))
        ):
            best_rate = max(best_rate, found[0])
        else:
            shape[j] = False
    return tuple(shape)


class _Model:
    """The fluid model the plan inverts, for any fusion shape (module docstring)."""

    def __init__(self, obs, g, u, floor, lo, hi, idle, headroom, worker_bytes, memory_left):
        self.obs, self.g, self.u, self.floor = obs, g, u, floor
        self.lo, self.hi, self.idle, self.headroom = lo, hi, idle, headroom
        self.worker_bytes, self.lightest = worker_bytes  # per stage, and the lightest worker's
        self.memory_left = memory_left
        # One worker's memory, the mean over the workers that run (the split between host
        # and cluster counts local workers alike).
        running = sum(obs.workers)
        self.per_worker_bytes = (
            sum(w * b for w, b in zip(obs.workers, self.worker_bytes, strict=True)) / running
            if running
            else max(self.worker_bytes, default=0.0)
        )
        self.allowance = 0.0  # the least CPU budget every shape gets (see solve)
        self.cpus = obs.cpus  # the CPU the pipeline may grow into (cpu_budget)

    def allow_split(self) -> None:
        """Give every shape the budget the fewest workers of every stage split are charged."""
        n = len(self.g)
        self.allowance = sum(max(1, self.lo[i]) * self.floor[i] for i in range(n))

    def costs(self, shape, now, hop) -> tuple[list[float], list[float]]:
        """CPU and worker seconds per delivered item per stage under ``shape``: a stage whose
        output stops (starts) crossing a channel saves (pays) a hop."""
        n = len(shape)
        g, u = list(self.g), list(self.u)
        for i in range(n):
            crosses = i + 1 == n or not shape[i + 1]
            crossed = i + 1 == n or not now[i + 1]
            if crosses != crossed:
                delta = hop[i] if crosses else -hop[i]
                g[i] = max(0.0, g[i] + delta)
                u[i] = max(1e-12, u[i] + delta)
        return g, u

    def groups(self, shape, now, hop):
        """Per group (host and the stages fused into it): its host, members, CPU and worker
        seconds per delivered item, charge floor, bounds, whether it is idle, and the memory
        one of its workers holds (the lightest worker's, and what each of its stages keeps in
        a worker beyond it)."""
        g, u = self.costs(shape, now, hop)
        out = []
        for h in (i for i in range(len(shape)) if not shape[i]):
            members = list(range(h, h + fused_depth(shape, h) + 1))
            gg = sum(g[i] for i in members) if len(members) > 1 else g[h]
            ug = sum(u[i] for i in members) if len(members) > 1 else u[h]
            if ug < gg * (1.0 + WAIT_NOISE):
                # The wall time of CPU-bound workers measures a few percent above their CPU
                # and run-queue delay (timer and accounting granularity; a fused stage's share
                # of its host's time): on 2 cores a need of 2.05 workers would be a third
                # worker that only time-slices them.
                ug = max(gg, 1e-12)
            # Each member's floor for its share of the group's worker time.
            fl = sum(self.floor[i] * u[i] for i in members) / max(sum(u[i] for i in members), 1e-12)
            mem = self.lightest + sum(
                max(0.0, self.worker_bytes[i] - self.lightest) for i in members
            )
            out.append((h, members, gg, ug, fl, self.lo[h], self.hi[h], self.idle[h], mem))
        return out, g, u

    def rate_of(self, shape, workers) -> float:
        """The rate the model gives ``workers`` (as they run) under ``shape``, all local
        (:func:`~.capacity.rate_of`)."""
        groups, _, _ = self.groups(shape, shape, [0.0] * len(shape))
        stations = [
            Station(h, gg, ug, fl, lo, hi, idle, headroom=self.headroom)
            for h, _, gg, ug, fl, lo, hi, idle, _ in groups
        ]
        local = [workers[st.stage] for st in stations]
        return rate_of(stations, local, [0] * len(stations), self.cpus, self.consumer_rate())

    def consumer_rate(self) -> float:
        """Items per second the consumer takes at most (inf: not measured)."""
        step = self.obs.consumer_step_s
        return 1.0 / step if step > 0 else math.inf

    def _top(self, groups) -> float:
        obs = self.obs
        top = self.cpus / max(sum(grp[2] for grp in groups), 1e-12)
        busy = [grp for grp in groups if not grp[7]]
        if busy:
            top = min(top, min(capacity(grp[6], grp[3], self.headroom) for grp in busy))
        if obs.consumer_step_s > 0:
            top = min(top, 1.0 / obs.consumer_step_s)
        return top

    def solve(self, shape, now, hop) -> tuple[float, tuple[int, ...]] | None:
        """The highest feasible rate under ``shape`` and the workers per stage for it (a
        fused stage's entry is what it would need split), or None."""
        obs, headroom = self.obs, self.headroom
        groups, _, u = self.groups(shape, now, hop)
        gs = [grp[2] for grp in groups]
        us = [grp[3] for grp in groups]
        fl = [grp[4] for grp in groups]
        lo = [grp[5] for grp in groups]
        hi = [grp[6] for grp in groups]
        mem = [grp[8] for grp in groups]
        m = len(groups)
        busy = [k for k in range(m) if not groups[k][7]]

        def charged(t: float, w: list[int]) -> float:
            # Each worker is charged the CPU it would use at rate t, at least its floor.
            return sum(w[k] * max(fl[k], min(1.0, t * gs[k] / w[k])) for k in range(m))

        # The fewest workers every stage must run are always allowed: on a machine with
        # fewer cores than stages they alone may pass the budget. Shapes are compared under
        # the allowance of every stage split: fewer groups run fewer workers in it, and must
        # not be charged a tighter budget for it.
        cpus = max(obs.cpus, charged(0.0, lo), self.allowance)

        def workers(t: float) -> list[int]:
            return [min(hi[k], max(lo[k], workers_for(t, us[k], headroom))) for k in range(m)]

        def feasible(t: float) -> bool:
            w = workers(t)
            return (
                t * sum(gs) <= self.cpus
                and charged(t, w) <= cpus + 1e-9
                and sum(w) <= max(sum(lo), MAX_OVERSUBSCRIBE * obs.cpus)
                and sum(w[k] * mem[k] for k in range(m)) <= self.memory_left
            )

        top = self._top(groups)
        low, high = 0.0, top
        if feasible(high):
            low = high
        else:
            for _ in range(_BISECT_STEPS):
                mid = (low + high) / 2
                low, high = (mid, high) if feasible(mid) else (low, mid)
        if low <= 0.0:
            return None
        # The rate the chosen workers support, and no worker beyond what that rate needs
        # (rounding at the bisection's edge can leave one stage a worker ahead of the others).
        w = workers(low)
        rate = min([low] + [capacity(w[k], us[k], headroom) for k in busy])
        per_group = workers(rate)
        out = [0] * len(shape)
        for k, (h, members, *_) in enumerate(groups):
            out[h] = per_group[k]
            for j in members[1:]:  # split again, it would need what it does alone
                need = workers_for(rate, u[j], headroom)
                out[j] = min(self.hi[j], max(self.lo[j], need))
        return rate, tuple(out)


def _worker_bytes(
    obs: Observation, per_worker_bytes: float | Sequence[float]
) -> tuple[list[float], float]:
    """Per stage, the memory one of its own workers holds, and the lightest worker's (a
    worker's own memory), from ``per_worker_bytes``: one number for every stage, or one per
    stage. A stage fused now measures none of its own: its entry is what its workers held
    when it last ran split (0: not known, then the lightest worker's), and that much beyond
    the lightest is taken off its host's (the host's workers hold it now). Charged its host's
    cache instead, every stage fused into a host with a 300 MiB cache looked too costly to
    split, and I/O stages that needed many workers of 150 MiB each stayed in the host's
    (``benchmarks/generalize.py``, ``memory_tight``); the hard limits charge a split stage
    its host's until it is measured."""
    n = len(obs.stages)
    if isinstance(per_worker_bytes, (int, float)):
        return [float(per_worker_bytes)] * n, float(per_worker_bytes)
    if len(per_worker_bytes) != n:
        raise ValueError(f"plan(): per_worker_bytes needs {n} entries, got {per_worker_bytes}")
    now = tuple(st.fused for st in obs.stages)
    split = [float(b) for b, f in zip(per_worker_bytes, now, strict=True) if not f]
    lightest = min(split, default=0.0)
    own = [
        float(b) if not f or b > 0 else lightest for b, f in zip(per_worker_bytes, now, strict=True)
    ]
    for j in range(n):
        if now[j]:
            h = fusion_host(now, j)
            own[h] = max(lightest, own[h] - max(0.0, own[j] - lightest))
    return own, lightest
