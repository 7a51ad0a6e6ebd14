"""The seam every tuner uses: what a tuner sees, what it decides, and who applies it.

A real running pipeline and the simulator both implement :class:`Tunable`, so a tuner is
trained and tested on the simulator and deployed unchanged on a live pipeline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# One rule for which stage's workers run a fused stage, live and in the simulator.
from multiproc.spec import fusion_host as fusion_host

MiB = 1 << 20

# A stage whose workers spend less than this share of their busy (in-function) wall time on a
# CPU waits on I/O: the one definition of "I/O-bound", live and in the simulator.
IO_CPU_SHARE = 0.5


@dataclass(frozen=True)
class StageStats:
    """One stage's state over the last observation interval.

    Every field means the same on a live pipeline (:mod:`torchtune_pipe.telemetry`) and in
    the simulator (:mod:`torchtune_pipe.sim.model`), in the units given here. Fractions of wall
    time are per worker, averaged over the stage's workers. Three fields are measured live
    only and keep their default in the simulator: ``items_in_per_s`` (0), ``runqueue``
    (None) and ``idle`` (False); a tuner must read those defaults as "not measured", never as
    "zero" (``tests/tuning/test_seam.py`` checks both sides).

    Attributes:
        name: stage name.
        workers: workers currently running (count).
        min_workers: lower bound of the stage's worker knob (count, >= 1).
        max_workers: upper bound of the stage's worker knob (count).
        items_per_s: items the stage emitted per second of wall time (items/s).
        items_in_per_s: items the stage took in per second (items/s). Live only (0: not
            measured); with ``items_per_s`` it gives the stage's in/out ratio (a batch of 4
            takes in 4 items per item out), which holds while a stage runs ahead of the others.
        runqueue: fraction of wall time a worker was runnable but waiting for a CPU (the
            kernel's run-queue delay, 0..1). Live only, where the kernel exports it (None: not
            measured; the simulator has no run queue).
        busy: fraction of wall time a worker spent in the stage function (0..1), waiting on
            I/O inside it included; waiting for output space is ``blocked_out``, not busy.
        blocked_in: fraction of wall time a worker waited for input (0..1).
        blocked_out: fraction of wall time a worker waited for output space (0..1). In the
            simulator ``busy + blocked_in + blocked_out`` is 1; live it is at most 1 over a
            long interval, but a wait is counted when it ends, with all its time, so over a
            short one the sum may pass 1 (each fraction is clipped to 1).
        buffer_bytes: byte budget of the stage's outbound buffer (channel), in bytes.
        buffer_fill: fraction of that budget in use at the end of the interval (0..1).
        cpu_s_per_item: CPU seconds the stage's workers spent per emitted item (s/item; 0
            when nothing was emitted). CPU time, not wall time: a call that waits on I/O costs
            little of it.
        io_bound: the stage's workers mostly wait on I/O: they spent less than
            :data:`IO_CPU_SHARE` of their busy time on a CPU (:func:`waits_on_io`, the one
            definition both sides use; read it through :func:`is_io_bound`).
        idle: the stage emitted items before but neither emitted nor computed in this
            interval: it has no work (its share of the epoch is done), which is not the same
            as "not measured yet". Live only (the simulated pipeline never runs dry).
        concurrency: calls of the stage function in flight per worker (count, >= 1; threads
            of a worker running calls that wait); ``busy`` counts wall time in the function,
            so a worker with several calls in flight is busy once, and ``cpu_s_per_item``
            counts the CPU of all of them.
        max_concurrency: upper bound of the concurrency knob (1: the stage has none).
        memory_bytes: bytes the stage's workers hold, its buffer excluded: the part of
            :attr:`Observation.memory_used_bytes` they account for (live: their proportional
            set sizes less the shared-memory arenas; simulator: workers times the worker RSS
            plus what each of its workers holds, ``StageModel.worker_bytes``; its resident
            state, held whatever the knobs, is no worker's). A worker added to the stage is
            taken to cost what one holds now. 0 when not measured.
        fused: the stage's function runs in the previous stage's workers (fusion, see
            :mod:`multiproc.fusion`), on their outputs, with no hop between them. Its
            ``workers`` is then 0 (its own workers are retired; :attr:`Allocation.workers`
            keeps its target for when it is split again) and its time, items and CPU are still
            its own function's; ``busy`` is that time as a fraction of the wall time of the
            workers that run it (the host group's).
        hop_s_per_item: seconds per emitted item the stage's workers spent moving items
            across channels (s/item, part of their ``busy`` time and, being CPU work, of
            ``cpu_s_per_item``): live, decoding their input frames and encoding their output
            frames; in the simulator, the hop its output pays (``Workload.hop_s_per_item``
            plus copying its bytes). 0 for a fused stage (its items cross no channel: the
            host's encoding covers the group's output; live, once its own workers have
            finished the frames queued for them), and when nothing was emitted.
        fusable: the stage may be fused into the previous stage now (stateless, runs where
            that one runs, and the group it would join is not at its longest).
    """

    name: str
    workers: int
    min_workers: int = 1
    max_workers: int = 1 << 16
    items_per_s: float = 0.0
    busy: float = 0.0
    blocked_in: float = 0.0
    blocked_out: float = 0.0
    buffer_bytes: int = 0
    buffer_fill: float = 0.0
    cpu_s_per_item: float = 0.0
    io_bound: bool = False
    idle: bool = False
    items_in_per_s: float = 0.0
    runqueue: float | None = None
    concurrency: int = 1
    max_concurrency: int = 1
    memory_bytes: int = 0
    fused: bool = False
    fusable: bool = False
    hop_s_per_item: float = 0.0


def waits_on_io(cpu_s: float, busy_s: float) -> bool:
    """True when workers that spent ``busy_s`` seconds in the stage function (wall time) used
    less than :data:`IO_CPU_SHARE` of it on a CPU: they wait on I/O. How both sides of the seam
    set :attr:`StageStats.io_bound` (any unit of time, the same for both arguments)."""
    return busy_s > 0 and cpu_s < IO_CPU_SHARE * busy_s


@dataclass(frozen=True)
class Observation:
    """A snapshot of a pipeline and the machine it runs on, as a tuner sees it.

    One meaning on both sides of the seam (see :class:`StageStats`). ``latency_s`` is
    simulator-only (0 live: the loader does not time items end to end); a tuner must read 0
    as "not measured".

    Attributes:
        stages: per-stage stats in pipeline order (source first).
        throughput: items per second delivered to the consumer over the interval (items/s,
            items of the last stage).
        latency_s: mean seconds an item spends in the pipeline. Simulator only (0: unknown).
        consumer_step_s: seconds the consumer (model) spends between two ``next()`` calls
            (0: not measured, or a consumer that never waits).
        cpus: CPUs the pipeline may use (affinity and cgroup quota, whichever is smaller;
            fractional under a quota). Simulator: the schedule's count at this time.
        memory_limit_bytes: the most memory the pipeline may use, in bytes (the meaning of
            ``memory_used_bytes``): the user's limit; else what the cgroup's limit (the smaller
            of ``memory.max`` and ``memory.high``, or v1's ``memory.limit_in_bytes``, the
            tightest along the cgroup's ancestors) leaves once the rest of the cgroup is
            counted; else what the machine leaves (used plus available memory). Simulator:
            the workload's limit.
        memory_used_bytes: the whole pipeline's memory now, in bytes, one meaning on both
            sides of the seam: the bytes its buffers hold, plus every process of the pipeline
            (each worker and the fork server, by proportional set size so that pages they
            share count once; shared-memory arenas only once, as buffers), plus what the
            consumer's process holds for it (prefetched copies). Per stage, the workers' part
            is :attr:`StageStats.memory_bytes`; :func:`memory_parts` splits the total.
        dram_gbps: DRAM copy bandwidth in GB/s (0 when unknown).
        cpu_ghz: CPU clock in GHz (0 when unknown).
        t: seconds since the pipeline started (live: since the meter started; simulator:
            simulated time at the end of the interval).
        oom: the pipeline ran out of memory in this interval: ``memory_used_bytes`` passed
            ``memory_limit_bytes``, or the kernel killed a worker for memory (live: a worker
            died while the cgroup's OOM-kill count grew). Simulator: the episode ended.
    """

    stages: tuple[StageStats, ...]
    throughput: float
    cpus: float
    memory_limit_bytes: int
    memory_used_bytes: int
    latency_s: float = 0.0
    consumer_step_s: float = 0.0
    dram_gbps: float = 0.0
    cpu_ghz: float = 0.0
    t: float = 0.0
    oom: bool = False

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(s.workers for s in self.stages)

    @property
    def buffer_bytes(self) -> tuple[int, ...]:
        return tuple(s.buffer_bytes for s in self.stages)

    @property
    def concurrency(self) -> tuple[int, ...]:
        return tuple(s.concurrency for s in self.stages)

    def allocation(self) -> Allocation:
        """The allocation the pipeline runs with now (concurrency left to the pipeline)."""
        fused = tuple(s.fused for s in self.stages)
        return Allocation(self.workers, self.buffer_bytes, fused=fused if any(fused) else ())


# A stage counts as I/O-bound by its busy share alone (CPU not measured) when it computes less
# than this fraction of the time...
IO_BUSY_MAX = 0.5
# ...and waits on its neighbours' channels less than this fraction.
IO_BLOCKED_MAX = 0.2


def is_io_bound(stage: StageStats) -> bool:
    """True when the stage's workers mostly wait on I/O rather than compute or wait on their
    neighbours: :attr:`StageStats.io_bound` as measured (:func:`waits_on_io`). Where the CPU
    time was not measured (``cpu_s_per_item`` 0: stats built by hand, logs), a stage busy less
    than ``IO_BUSY_MAX`` and blocked on its channels less than ``IO_BLOCKED_MAX`` of the time
    counts as waiting on something outside the pipeline."""
    if stage.io_bound:
        return True
    if stage.items_per_s <= 0.0 or stage.cpu_s_per_item > 0.0:
        return False
    blocked = stage.blocked_in + stage.blocked_out
    return stage.busy < IO_BUSY_MAX and blocked < IO_BLOCKED_MAX


@dataclass(frozen=True)
class Allocation:
    """Workers per stage, outbound buffer bytes per stage and, optionally, calls in flight per
    worker of each stage and which stages run fused, in pipeline order.

    ``concurrency`` empty means "not decided by the tuner": the pipeline sets it from its own
    measurements (:func:`torchtune_pipe.tuning.concurrency.plan_concurrency`), live and in the
    simulator alike. ``fused`` empty means "as it is now"; ``fused[j]`` True runs stage ``j``
    in stage ``j - 1``'s workers (see :attr:`StageStats.fused`), and ``workers[j]`` is then
    the stage's target for when it is split again, not processes that run (the CPU budget
    counts the stages that run their own workers).
    """

    workers: tuple[int, ...]
    buffer_bytes: tuple[int, ...]
    concurrency: tuple[int, ...] = ()
    fused: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(int(w) for w in self.workers))
        object.__setattr__(self, "buffer_bytes", tuple(int(b) for b in self.buffer_bytes))
        object.__setattr__(self, "concurrency", tuple(int(c) for c in self.concurrency))
        if len(self.workers) != len(self.buffer_bytes):
            raise ValueError(
                f"Allocation: workers has {len(self.workers)} stages but buffer_bytes has "
                f"{len(self.buffer_bytes)}"
            )
        if self.concurrency and len(self.concurrency) != len(self.workers):
            raise ValueError(
                f"Allocation: concurrency has {len(self.concurrency)} stages, workers "
                f"{len(self.workers)}"
            )
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"Allocation: concurrency must be >= 1, got {self.concurrency}")
        object.__setattr__(self, "fused", tuple(bool(f) for f in self.fused))
        if self.fused and len(self.fused) != len(self.workers):
            raise ValueError(
                f"Allocation: fused has {len(self.fused)} stages, workers {len(self.workers)}"
            )
        if self.fused and self.fused[0]:
            raise ValueError("Allocation: the first stage cannot be fused (nothing before it)")

    def replace(self, **changes) -> Allocation:
        return dataclasses.replace(self, **changes)


def running_workers(alloc: Allocation) -> tuple[int, ...]:
    """Workers each stage of ``alloc`` runs as processes: 0 for a fused stage (its
    ``workers`` entry is its target for when it is split again)."""
    if not alloc.fused:
        return alloc.workers
    return tuple(0 if f else w for w, f in zip(alloc.workers, alloc.fused, strict=True))


@dataclass(frozen=True)
class MemoryParts:
    """:attr:`Observation.memory_used_bytes` split by what holds it.

    Attributes:
        buffered_bytes: bytes the buffers hold (budget times fill, per stage).
        per_worker_bytes: per stage, what one of its workers holds now (its measured memory
            over its workers; where a stage is not measured, the mean of the measured ones,
            or, when none is, everything outside the buffers spread over every worker).
        fixed_bytes: the rest (the fork server, prefetched copies, arena pages a shrunk
            budget still holds); never negative.
    """

    buffered_bytes: float
    per_worker_bytes: tuple[float, ...]
    fixed_bytes: float

    def worst_case_bytes(self, alloc: Allocation) -> float:
        """Memory ``alloc`` may reach: every buffer full, every worker costing what one of
        its stage's workers costs now, plus the fixed part. A fused stage runs no workers."""
        own = running_workers(alloc)
        workers = sum(w * p for w, p in zip(own, self.per_worker_bytes, strict=True))
        return self.fixed_bytes + workers + sum(alloc.buffer_bytes)


def memory_parts(obs: Observation) -> MemoryParts:
    """Split ``obs.memory_used_bytes`` into buffers, workers per stage and the rest."""
    buffered = sum(s.buffer_bytes * s.buffer_fill for s in obs.stages)
    other = max(0.0, obs.memory_used_bytes - buffered)
    measured = [s for s in obs.stages if s.memory_bytes > 0 and s.workers > 0]
    if not measured:
        each = other / max(1, sum(obs.workers))
        return MemoryParts(buffered, (each,) * len(obs.stages), 0.0)
    mean = sum(s.memory_bytes for s in measured) / sum(s.workers for s in measured)
    per_worker = tuple(
        s.memory_bytes / s.workers if s.memory_bytes > 0 and s.workers > 0 else mean
        for s in obs.stages
    )
    in_workers = sum(w * p for w, p in zip(obs.workers, per_worker, strict=True))
    return MemoryParts(buffered, per_worker, max(0.0, other - in_workers))


@dataclass(frozen=True)
class Limits:
    """Hard limits that sit below every tuner (see :func:`clamp`)."""

    cpus: float
    memory_bytes: int
    min_workers: tuple[int, ...] = field(default=())
    max_workers: tuple[int, ...] = field(default=())
    min_buffer_bytes: int = 1 * MiB


def limits_of(obs: Observation, memory_fraction: float = 1.0) -> Limits:
    """The hard limits implied by an observation."""
    return Limits(
        cpus=obs.cpus,
        memory_bytes=int(obs.memory_limit_bytes * memory_fraction),
        min_workers=tuple(s.min_workers for s in obs.stages),
        max_workers=tuple(s.max_workers for s in obs.stages),
    )


def clamp(alloc: Allocation, limits: Limits, oversubscribe: float = 1.0) -> Allocation:
    """Enforce the safety rules on any tuner's decision.

    Never fewer than ``min_workers`` (>= 1) per stage, never more than ``max_workers``, total
    workers within ``cpus * oversubscribe`` (stages that wait on I/O may legitimately run more
    workers than cores, so callers pass ``oversubscribe > 1`` for them), and total buffer bytes
    within ``memory_bytes``. When over a budget, the largest allocations shrink first.
    """
    n = len(alloc.workers)
    lo = limits.min_workers or (1,) * n
    hi = limits.max_workers or (1 << 16,) * n
    workers = [max(max(1, lo[i]), min(hi[i], alloc.workers[i])) for i in range(n)]
    # A fused stage runs no workers of its own: only the others count against the CPUs.
    own = [i for i in range(n) if not (alloc.fused and alloc.fused[i])]
    cap = max(sum(max(1, lo[i]) for i in own), int(limits.cpus * oversubscribe + 0.5))
    while sum(workers[i] for i in own) > cap:
        i = max(own, key=lambda j: (workers[j] - max(1, lo[j]), workers[j]))
        if workers[i] <= max(1, lo[i]):
            break
        workers[i] -= 1
    buffers = [max(limits.min_buffer_bytes, b) for b in alloc.buffer_bytes]
    total = sum(buffers)
    if total > limits.memory_bytes > 0:
        scale = limits.memory_bytes / total
        buffers = [max(limits.min_buffer_bytes, int(b * scale)) for b in buffers]
    return alloc.replace(workers=tuple(workers), buffer_bytes=tuple(buffers))


@runtime_checkable
class Tunable(Protocol):
    """Something a tuner can steer: a running pipeline or a simulated one."""

    def observe(self) -> Observation:
        """Stats since the previous call, plus machine facts."""
        ...

    def apply(self, allocation: Allocation) -> None:
        """Set workers per stage and buffer bytes per stage, as given: the hard limits are
        applied once, above every tunable, by :class:`~.safety.Guarded`."""
        ...


@runtime_checkable
class Tuner(Protocol):
    """Decides allocations from observations.

    A tuner proposes; it does not enforce the hard limits. Whoever drives it (the tuning loop,
    :func:`~.loop.run_episode`, the loader) applies its decisions through
    :class:`~.safety.Guarded`, which clamps them to :class:`Limits` and fits them to memory.
    What ran is in the next observation (:meth:`Observation.allocation`): a tuner that keeps
    its own idea of the current allocation takes it from there, not from what it proposed.
    Fields documented as measured on one side only carry their "not measured" default on the
    other; a tuner reads them as unknown.
    """

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        """Start tuning a pipeline; returns the first allocation to apply.

        Args:
            obs: the pipeline as it runs now.
            start: start from this allocation (a restored checkpoint, a random start in
                pre-training): the tuner returns it, or its own first step from it, and
                carries on from there.
        """
        ...

    def step(self, obs: Observation) -> Allocation:
        """One tuning step; returns the allocation to apply (may equal the current one)."""
        ...
