"""The seam every tuner uses: what a tuner sees, what it decides, and who applies it.

A real running pipeline and the simulator both implement :class:`Tunable`, so a tuner is
trained and tested on the simulator and deployed unchanged on a live pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# One rule for which stage's workers run a fused stage, live and in the simulator.
from multiproc.errors import ExecutorClosedError as ExecutorClosedError
from multiproc.spec import fusion_host as fusion_host
from multiproc.stats import MAX_FUSED

MiB = 1 << 20

# A stage whose workers spend less than this share of their busy (in-function) wall time on a
# CPU waits on I/O: the one definition of "I/O-bound", live and in the simulator.
IO_CPU_SHARE = 0.5


@dataclass(frozen=True)
class StageStats:
    """One stage's state over the last observation interval.

    Every field means the same on a live pipeline (:mod:`torchtune_pipe.telemetry.measure`) and in
    the simulator (:mod:`torchtune_pipe.sim.model`), in the units given here. Fractions of wall
    time are per worker, averaged over the stage's workers. Three fields are measured live
    only and keep their default in the simulator: ``items_in_per_s`` (0), ``runqueue``
    (None) and ``idle`` (False); ``hop_cpu_s_per_item`` is simulator-only (0 live), and
    live only a ``placement="auto"`` stage connected to Ray is ``remotable``; a tuner must
    read those defaults as "not measured", never as "zero" (``tests/tuning/test_seam.py`` checks both sides).

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
        hop_s_per_item: CPU seconds per emitted item the stage's workers spent moving items
            across channels (s/item, part of ``cpu_s_per_item``, so that the two compare on a
            busy machine): live, decoding their input frames and encoding their output
            frames; in the simulator, the hop its output pays (``Workload.hop_s_per_item``
            plus copying its bytes). 0 for a fused stage (its items cross no channel: the
            host's encoding covers the group's output; live, once its own workers have
            finished the frames queued for them), and when nothing was emitted.
        fusable: the stage may be fused into the previous stage now (stateless, runs where
            that one runs, and the group it would join is not at its longest).
        remote_workers: of ``workers``, how many run on the cluster (count, 0..workers): each
            a worker whose stage function runs on one cluster CPU (live: a Ray actor, of a
            ``placement="ray"`` stage all its workers, of a ``placement="auto"`` stage the
            executor's offload workers) and whose local side only sends and
            receives (no share of the host's cores beyond ``hop_cpu_s_per_item``, no worker
            memory: ``memory_bytes`` is the local workers'). The rest run on the host.
        remotable: the tuner may move the stage's workers between host and cluster (a
            stateless map stage; never a source, shuffle or batch). Fusion and remote workers
            exclude each other: a fused stage, or one hosting a fused stage, runs none (the
            guard drops them). Live: a ``placement="auto"`` stage while the process is
            connected to Ray (its workers move with ``Allocation.remote``); a
            ``placement="ray"`` stage keeps every worker remote, a local stage every worker
            local.
        remote_items_per_s: items the stage's remote workers emitted per second (items/s,
            part of ``items_per_s``; 0 without remote workers).
        threads: of ``workers``, how many run as threads of the consumer's process (count,
            0..workers less ``remote_workers``); the rest of its local workers are processes.
            A thread worker uses CPU as a process does but holds no process of its own
            (``memory_bytes`` is the process workers'); its Python work shares the
            consumer's interpreter lock with the consumer and the other thread workers.
        threadable: the tuner may move the stage's local workers between processes and
            threads (a stage built with ``worker_type="auto"``, not fused). Else the stage
            keeps the kind it runs.
        bytes_per_item: bytes of one item the stage emits, as it crosses a channel or the
            network (B/item; 0: not measured). An item sent to a remote worker of stage ``i``
            costs stage ``i - 1``'s ``bytes_per_item`` in, its own out.
        net_s_per_item: wall seconds a remote worker waited on the network per item it
            emitted (the call's round trip shared over its items, plus bytes over bandwidth
            both ways; s/item). Live: its remote calls' wall time beyond the function's own wall
            time on the actor, per item. 0 without remote workers (a tuner predicts it from
            ``Observation.rpc_s`` and ``Observation.network_bytes_per_s``).
        hop_cpu_s_per_item: host CPU seconds a remote worker spent per item it emitted on the
            hop to the cluster (packing, unpacking, the call), charged to local cores (s/item;
            the network hop, not the channel hop of ``hop_s_per_item``). Simulator
            only (0 live and without remote workers: live the hop's CPU is in
            ``cpu_s_per_item``, with the actor's).
        items_per_call: items one remote call carries (the stage's frame, count >= 1; 1 when
            not known).
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
    remote_workers: int = 0
    remotable: bool = False
    threads: int = 0
    threadable: bool = False
    remote_items_per_s: float = 0.0
    bytes_per_item: float = 0.0
    net_s_per_item: float = 0.0
    hop_cpu_s_per_item: float = 0.0
    items_per_call: float = 1.0


def waits_on_io(cpu_s: float, busy_s: float) -> bool:
    """True when workers that spent ``busy_s`` seconds in the stage function (wall time) used
    less than :data:`IO_CPU_SHARE` of it on a CPU: they wait on I/O. How both sides of the seam
    set :attr:`StageStats.io_bound` (any unit of time, the same for both arguments)."""
    return busy_s > 0 and cpu_s < IO_CPU_SHARE * busy_s


def is_io_bound(stage: StageStats) -> bool:
    """True when the stage's workers mostly wait on I/O: :attr:`StageStats.io_bound`, which
    both sides of the seam set by :func:`waits_on_io`, the one rule. What every tuner reads;
    stats that carry no verdict (built by hand, replayed from an old log) read as not
    I/O-bound, as the flag's default says."""
    return stage.io_bound


@dataclass(frozen=True)
class Observation:
    """A snapshot of a pipeline and the machine it runs on, as a tuner sees it.

    One meaning on both sides of the seam (see :class:`StageStats`). ``latency_s`` is
    simulator-only (0 live: the loader does not time items end to end); ``network_bytes_per_s``
    and ``rpc_s`` are measured live only from remote calls (0 for a pipeline that made none in
    the interval); a tuner must read 0 as "not measured".

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
            is :attr:`StageStats.memory_bytes`; :func:`~.safety.memory_parts` splits the total.
        dram_gbps: DRAM copy bandwidth in GB/s (0 when unknown).
        cpu_ghz: CPU clock in GHz (0 when unknown).
        t: seconds since the pipeline started (live: since the meter started; simulator:
            simulated time at the end of the interval).
        oom: the pipeline ran out of memory in this interval: ``memory_used_bytes`` passed
            ``memory_limit_bytes``, or the kernel killed a worker for memory (live: a worker
            died while the cgroup's OOM-kill count grew). Simulator: the episode ended.
        cluster_cpus: CPUs a cluster offers the pipeline's remote workers besides ``cpus``
            (0: no cluster). Live: Ray's ``cluster_resources()["CPU"]`` while a remote stage
            runs (the host's own share of it included, as Ray counts it), else 0. Simulator:
            the schedule's count. Each remote worker takes one (``Allocation.remote``).
        network_bytes_per_s: bandwidth between the host and the cluster, in bytes/s, shared
            by every remote worker (0: not measured, a tuner takes its prior). Live: the slope
            of a least-squares line of the interval's remote calls' wait (call time less the
            function's own time on the actor) over their bytes both ways; 0 when their sizes
            do not tell it apart from the round trip.
        rpc_s: seconds one remote call costs besides its bytes (its round trip), shared by the
            items of the call (0: not measured; a tuner takes its prior). Live: that line's
            value at 0 bytes (the mean wait when the line is not measured).
        consumer_cpus: cores of ``cpus`` the consumer's process used over the interval besides
            the pipeline's stages: its training step, the loader's receiving and decoding of
            batches, the tuning loop. The workers cannot have them. Live: that process's CPU
            time over the interval (every thread) less the CPU of stages whose workers are its
            threads, per second. Simulator: 0 (its consumer takes items every
            ``consumer_step_s`` without using the pipeline's CPUs).
        data_wait_share: the share of the consumer's time over the interval spent inside
            ``next()`` waiting for the pipeline's next item, 0..1: near 0 the pipeline keeps
            ahead of training, near 1 training is stalled on data. Live only (None: not
            measured, or the consumer neither waited nor stepped, as between epochs; the
            simulator leaves it None, its consumer's waits follow from ``throughput`` and
            ``consumer_step_s``).
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
    cluster_cpus: float = 0.0
    network_bytes_per_s: float = 0.0
    rpc_s: float = 0.0
    consumer_cpus: float = 0.0
    data_wait_share: float | None = None

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(s.workers for s in self.stages)

    @property
    def buffer_bytes(self) -> tuple[int, ...]:
        return tuple(s.buffer_bytes for s in self.stages)

    @property
    def concurrency(self) -> tuple[int, ...]:
        return tuple(s.concurrency for s in self.stages)

    @property
    def remote_workers(self) -> tuple[int, ...]:
        return tuple(s.remote_workers for s in self.stages)

    def allocation(self) -> Allocation:
        """The allocation the pipeline runs with now (concurrency left to the pipeline)."""
        fused = tuple(s.fused for s in self.stages)
        remote = self.remote_workers
        return Allocation(
            self.workers,
            self.buffer_bytes,
            fused=fused if any(fused) else (),
            remote=remote if any(remote) else (),
        )


@dataclass(frozen=True)
class Allocation:
    """Workers per stage, outbound buffer bytes per stage and, optionally, calls in flight per
    worker of each stage and which stages run fused, in pipeline order.

    ``concurrency`` empty means "not decided by the tuner": the pipeline sets it from its own
    measurements (:func:`torchtune_pipe.tuning.calls_in_flight.plan_concurrency`), live and in the
    simulator alike. ``fused`` empty means "as it is now"; ``fused[j]`` True runs stage ``j``
    in stage ``j - 1``'s workers (see :attr:`StageStats.fused`), and ``workers[j]`` is then
    the stage's target for when it is split again, not processes that run (the CPU budget
    counts the stages that run their own workers). ``remote`` empty means "each stage keeps
    its placement": a stage whose workers all run on the cluster keeps all of them there,
    another keeps its remote count (at most its workers); ``remote[j]`` is how many of
    ``workers[j]`` run on the cluster (:attr:`StageStats.remote_workers`; more than
    ``workers[j]`` reads as all of them). Local workers count against ``cpus``, remote ones
    against ``Observation.cluster_cpus`` (:func:`~.safety.placed`). ``threads`` empty means
    "not decided by the tuner": the pipeline's kind rule moves a ``threadable`` stage's local
    workers between processes and threads from its own measurements
    (:class:`torchtune_pipe.tuning.worker_kind.KindRule`), live and in the simulator alike;
    ``threads[j]`` is how many of stage ``j``'s local workers run as threads
    (:attr:`StageStats.threads`; more than its local workers reads as all of them), the rest
    as processes. Thread workers count against ``cpus`` as processes do; only process
    workers hold memory of their own (:func:`process_workers`).
    """

    workers: tuple[int, ...]
    buffer_bytes: tuple[int, ...]
    concurrency: tuple[int, ...] = ()
    fused: tuple[bool, ...] = ()
    remote: tuple[int, ...] = ()
    threads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(int(w) for w in self.workers))
        object.__setattr__(self, "buffer_bytes", tuple(int(b) for b in self.buffer_bytes))
        if len(self.workers) != len(self.buffer_bytes):
            raise ValueError(
                f"Allocation: workers has {len(self.workers)} stages but buffer_bytes has "
                f"{len(self.buffer_bytes)}"
            )
        self._per_stage_counts("concurrency", least=1)
        object.__setattr__(self, "fused", tuple(bool(f) for f in self.fused))
        if self.fused and len(self.fused) != len(self.workers):
            raise ValueError(
                f"Allocation: fused has {len(self.fused)} stages, workers {len(self.workers)}"
            )
        if self.fused and self.fused[0]:
            raise ValueError("Allocation: the first stage cannot be fused (nothing before it)")
        self._per_stage_counts("remote", least=0)
        self._per_stage_counts("threads", least=0)

    def _per_stage_counts(self, name: str, least: int) -> None:
        """Field ``name`` as ints: empty, or one per stage, each at least ``least``."""
        values = tuple(int(v) for v in getattr(self, name))
        object.__setattr__(self, name, values)
        if values and len(values) != len(self.workers):
            raise ValueError(
                f"Allocation: {name} has {len(values)} stages, workers {len(self.workers)}"
            )
        if any(v < least for v in values):
            raise ValueError(f"Allocation: {name} must be >= {least}, got {values}")

    def replace(self, **changes) -> Allocation:
        return dataclasses.replace(self, **changes)


def running_workers(alloc: Allocation) -> tuple[int, ...]:
    """Workers each stage of ``alloc`` runs as processes: 0 for a fused stage (its
    ``workers`` entry is its target for when it is split again)."""
    if not alloc.fused:
        return alloc.workers
    return tuple(0 if f else w for w, f in zip(alloc.workers, alloc.fused, strict=True))


def process_workers(alloc: Allocation) -> tuple[int, ...]:
    """Worker processes each stage of ``alloc`` runs on the host: its local workers
    (:func:`local_workers`) less those that run as threads (``alloc.threads`` taken as given).
    What a worker holds of its own is a process's: a thread worker's is the consumer's."""
    own = local_workers(alloc)
    if not alloc.threads:
        return own
    return tuple(max(0, w - t) for w, t in zip(own, alloc.threads, strict=True))


def threads_as_now(stage: StageStats, local: int) -> int:
    """The thread workers a stage that keeps its kind runs with ``local`` local workers: all of
    them where all its local workers are threads now (a ``worker_type="thread"`` stage), else
    as many as now, at most ``local``."""
    now_local = stage.workers - stage.remote_workers
    if stage.threads > 0 and stage.threads >= now_local:
        return local
    return min(stage.threads, local)


def local_workers(alloc: Allocation) -> tuple[int, ...]:
    """Workers each stage of ``alloc`` runs on the host: those that run
    (:func:`running_workers`) less its remote ones (``alloc.remote`` taken as given)."""
    own = running_workers(alloc)
    if not alloc.remote:
        return own
    return tuple(max(0, w - r) for w, r in zip(own, alloc.remote, strict=True))


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


def clamp(
    alloc: Allocation,
    limits: Limits,
    oversubscribe: float = 1.0,
    was: Sequence[int] = (),
) -> Allocation:
    """Enforce the safety rules on any tuner's decision.

    Never fewer than ``min_workers`` (>= 1) per stage, never more than ``max_workers``, total
    workers within ``cpus * oversubscribe`` (stages that wait on I/O may legitimately run more
    workers than cores, so callers pass ``oversubscribe > 1`` for them), and total buffer bytes
    within ``memory_bytes``. When over a budget, the largest allocations shrink first; over
    the CPU budget, first those of the stages that grow past ``was`` (the workers running now,
    when given): growth is refused before what runs is cut.
    """
    n = len(alloc.workers)
    lo = limits.min_workers or (1,) * n
    hi = limits.max_workers or (1 << 16,) * n
    workers = [max(max(1, lo[i]), min(hi[i], alloc.workers[i])) for i in range(n)]
    # A fused stage runs no workers of its own, a remote worker runs on the cluster: only the
    # others (local workers) count against the CPUs.
    own = [i for i in range(n) if not (alloc.fused and alloc.fused[i])]
    remote = alloc.remote or (0,) * n

    def local(i: int) -> int:
        return max(0, workers[i] - remote[i])

    floor = sum(max(0, max(1, lo[i]) - remote[i]) for i in own)
    cap = max(floor, int(limits.cpus * oversubscribe + 0.5))
    while sum(local(i) for i in own) > cap:
        i = max(
            own,
            key=lambda j: (
                min(local(j), workers[j] - max(1, lo[j])) > 0,
                bool(was) and workers[j] > was[j],
                min(local(j), workers[j] - max(1, lo[j])),
                local(j),
            ),
        )
        if workers[i] <= max(1, lo[i]) or local(i) <= 0:
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
        """Stats since the previous call, plus machine facts.

        Raises:
            ExecutorClosedError: (a live pipeline) its executor was closed; so does
                ``apply``. A tuning loop that has stepped the pipeline ends quietly on it.
        """
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

    A tuner whose first allocation fuses every stage that may be fused (:func:`fuse_fusable`)
    says so with a true ``starts_fused`` attribute: the loader then starts the pipeline's
    workers in that shape, not a worker per stage for the first step to fuse away.
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


def fuse_fusable(obs: Observation) -> tuple[bool, ...]:
    """Every stage that may be fused now fused, in pipeline order, at most ``MAX_FUSED`` after
    one host: the fewest processes (tf.data's map fusion; InTune's first shape)."""
    fused = [s.fused for s in obs.stages]
    for j, s in enumerate(obs.stages):
        if s.fusable and not fused[j]:
            fused[j] = True
            if j - fusion_host(fused, j) > MAX_FUSED:
                fused[j] = False
    return tuple(fused)
