"""The seam every tuner uses: what a tuner sees, what it decides, and who applies it.

A real running pipeline and the simulator both implement :class:`Tunable`, so a tuner is
trained and tested on the simulator and deployed unchanged on a live pipeline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

MiB = 1 << 20


@dataclass(frozen=True)
class StageStats:
    """One stage's state over the last observation interval.

    Attributes:
        name: stage name.
        workers: workers currently running.
        min_workers: lower bound of the stage's worker knob (>= 1).
        max_workers: upper bound of the stage's worker knob.
        items_per_s: items the stage emitted per second.
        items_in_per_s: items the stage took in per second (0 when not measured); with
            ``items_per_s`` it gives the stage's in/out ratio (a batch of 4 takes in 4 items
            per item out), which holds while a stage runs ahead of the others.
        runqueue: mean fraction of wall time a worker was runnable but waiting for a CPU
            (the kernel's run-queue delay; None when not measured).
        busy: mean fraction of wall time a worker spent running the stage function (0..1).
        blocked_in: mean fraction of wall time a worker waited for input (0..1).
        blocked_out: mean fraction of wall time a worker waited for output space (0..1).
        buffer_bytes: byte budget of the stage's outbound buffer (channel).
        buffer_fill: fraction of that budget in use (0..1).
        cpu_s_per_item: busy CPU seconds spent per emitted item (0 when nothing emitted).
        io_bound: True when the stage's time is mostly waiting (I/O), not CPU.
        idle: True when the stage emitted items before but neither emitted nor computed in
            this interval: it has no work (its share of the epoch is done), which is not the
            same as "not measured yet".
        concurrency: calls of the stage function in flight per worker (threads of a worker
            running calls that wait); ``busy`` counts wall time in the function, so a worker
            with several calls in flight is busy once, and ``cpu_s_per_item`` counts the CPU
            of all of them.
        max_concurrency: upper bound of the concurrency knob (1: the stage has none).
        memory_bytes: memory the stage's workers hold, its buffer excluded: the part of
            :attr:`Observation.memory_used_bytes` they account for (live: their proportional
            set sizes less the shared-memory arenas; simulator: workers times the worker RSS
            plus the stage's resident state). 0 when not measured.
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


@dataclass(frozen=True)
class Observation:
    """A snapshot of a pipeline and the machine it runs on, as a tuner sees it.

    Attributes:
        stages: per-stage stats in pipeline order (source first).
        throughput: items per second delivered to the consumer.
        latency_s: mean time an item spends in the pipeline (0 when unknown).
        consumer_step_s: time the consumer (model) spends between two ``next()`` calls.
        cpus: CPUs the pipeline may use (affinity and cgroup quota, whichever is smaller).
        memory_limit_bytes: the most memory the pipeline may use (the meaning of
            ``memory_used_bytes``): the user's limit; else what the cgroup's limit (the smaller
            of ``memory.max`` and ``memory.high``, or v1's ``memory.limit_in_bytes``, the
            tightest along the cgroup's ancestors) leaves once the rest of the cgroup is
            counted; else what the machine leaves (used plus available memory). Simulator:
            the workload's limit.
        memory_used_bytes: the whole pipeline's memory now, one meaning on both sides of the
            seam: the bytes its buffers hold, plus every process of the pipeline (each
            worker and the fork server, by proportional set size so that pages they share
            count once; shared-memory arenas only once, as buffers), plus what the consumer's
            process holds for it (prefetched copies). Per stage, the workers' part is
            :attr:`StageStats.memory_bytes`; :func:`memory_parts` splits the total.
        dram_gbps: DRAM copy bandwidth in GB/s (0 when unknown).
        cpu_ghz: CPU clock in GHz (0 when unknown).
        t: seconds since the pipeline started.
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
        return Allocation(self.workers, self.buffer_bytes)


@dataclass(frozen=True)
class Allocation:
    """Workers per stage, outbound buffer bytes per stage and, optionally, calls in flight per
    worker of each stage, in pipeline order.

    ``concurrency`` empty means "not decided by the tuner": the pipeline sets it from its own
    measurements (:func:`torchtune_pipe.tuning.concurrency.plan_concurrency`), live and in the
    simulator alike.
    """

    workers: tuple[int, ...]
    buffer_bytes: tuple[int, ...]
    concurrency: tuple[int, ...] = ()

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

    def replace(self, **changes) -> Allocation:
        return dataclasses.replace(self, **changes)


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
        its stage's workers costs now, plus the fixed part."""
        workers = sum(w * p for w, p in zip(alloc.workers, self.per_worker_bytes, strict=True))
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
    cap = max(sum(max(1, x) for x in lo), int(limits.cpus * oversubscribe + 0.5))
    while sum(workers) > cap:
        i = max(range(n), key=lambda j: (workers[j] - max(1, lo[j]), workers[j]))
        if workers[i] <= max(1, lo[i]):
            break
        workers[i] -= 1
    buffers = [max(limits.min_buffer_bytes, b) for b in alloc.buffer_bytes]
    total = sum(buffers)
    if total > limits.memory_bytes > 0:
        scale = limits.memory_bytes / total
        buffers = [max(limits.min_buffer_bytes, int(b * scale)) for b in buffers]
    return Allocation(tuple(workers), tuple(buffers), alloc.concurrency)


@runtime_checkable
class Tunable(Protocol):
    """Something a tuner can steer: a running pipeline or a simulated one."""

    def observe(self) -> Observation:
        """Stats since the previous call, plus machine facts."""
        ...

    def apply(self, allocation: Allocation) -> None:
        """Set workers per stage and buffer bytes per stage."""
        ...


@runtime_checkable
class Tuner(Protocol):
    """Decides allocations from observations."""

    def reset(self, obs: Observation) -> Allocation:
        """Start tuning a pipeline; returns the first allocation to apply."""
        ...

    def step(self, obs: Observation) -> Allocation:
        """One tuning step; returns the allocation to apply (may equal the current one)."""
        ...
