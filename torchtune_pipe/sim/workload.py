"""What the simulator models: stages, a workload, cost drift, and a solved steady state.

:class:`StageModel` and :class:`Workload` describe a pipeline and the machine it runs on (per
item CPU and waits, output bytes, variability, worker memory, hop costs); :class:`Drift` makes
a cost change over time; :class:`Coefficients` are the per-stage constants the model derives
from a workload; :class:`SteadyState` is what :class:`~torchtune_pipe.sim.model.SimPipeline`
solves for an allocation. See :mod:`torchtune_pipe.sim.model` for the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from multiproc.spec import PIPELINE_KINDS as STAGE_KINDS
from torchtune_pipe.tuning.base import MiB
from torchtune_pipe.tuning.cluster import HOP_COPIES, NETWORK_BYTES_PER_S, RPC_CPU_S, RPC_S

__all__ = ["Drift", "StageModel", "Workload", "SteadyState", "STAGE_KINDS"]


@dataclass(frozen=True)
class Drift:
    """Slow periodic drift of a stage's costs: ``1 + amplitude * sin(2 pi t / period_s + phase)``."""

    period_s: float
    amplitude: float
    phase: float = 0.0

    def __post_init__(self) -> None:
        if self.period_s <= 0:
            raise ValueError(f"Drift: period_s must be > 0, got {self.period_s}")
        if not 0 <= self.amplitude < 1:
            raise ValueError(f"Drift: amplitude must be in [0, 1), got {self.amplitude}")

    def factor(self, t: float) -> float:
        """Cost multiplier at time ``t`` seconds."""
        return 1.0 + self.amplitude * math.sin(2 * math.pi * t / self.period_s + self.phase)


@dataclass(frozen=True)
class StageModel:
    """The cost model of one pipeline stage.

    Attributes:
        name: stage name (unique in a workload).
        kind: one of ``STAGE_KINDS``.
        cpu_s_per_item: mean CPU seconds per *input* item.
        cpu_cv: coefficient of variation of the per-item time (heavy tails: > 1).
        io_s_per_item: mean CPU-free wait per input item (latency per unit / items per unit,
            plus bytes / bandwidth).
        ratio: input items per output item (the batch size for ``"batch"``, else 1).
        bytes_per_item: size of one output item in bytes.
        min_workers: lower bound of the worker knob (>= 1).
        max_workers: upper bound of the worker knob.
        drift: optional cost drift; a ``(period_s, amplitude[, phase])`` tuple is accepted.
        resident_bytes: memory the stage holds regardless of its knobs (a shuffle buffer): not
            its workers' (``StageStats.memory_bytes`` leaves it out), so a tuner or the hard
            limits see a worker cost what a worker costs.
        worker_bytes: memory each of the stage's workers holds besides the worker RSS (a cache
            every worker builds): it grows with the workers, as it does live.
        max_concurrency: calls in flight per worker the stage allows (1: none). A worker with
            ``k`` calls in flight overlaps their waits on one core: per input item it costs
            ``max(c, (c + d) / k)`` seconds of wall time, of which ``c`` are CPU.
        fusable: the stage's function holds nothing across calls and may run where the stage
            before it runs; with a ``"map"`` kind after a ``"source"`` or ``"map"`` stage it
            may then be fused into it, the live rule (``multiproc.spec.fuse_blocker``). False
            for a map that must keep workers of its own (another worker type).
        remotable: the stage's workers may run on the cluster (``Allocation.remote``): only a
            ``"map"`` stage, and not while it is fused or hosts a fused stage (live: a
            ``placement="ray"`` stage; a source, shuffle or batch keeps its state local).
        items_per_call: items one remote call carries (the stage's frame): the call's round
            trip and host CPU are shared by them.
        gil_share: the share of the stage's CPU time (its output's hop included) that holds
            the interpreter lock, 0..1: ~1 for pure Python (a tokenizer), ~0.1-0.3 for a decode
            or a numpy/torch kernel that releases it. Only thread workers pay for it: they
            share one lock with the consumer and every other thread worker
            (:mod:`torchtune_pipe.sim.threads`).
        threadable: the stage's local workers may run as threads of the consumer's process
            (``Allocation.threads``; live: a stage built with ``worker_type="auto"``). Else
            they keep the kind they run (processes, unless the initial allocation says
            threads).
    """

    name: str
    kind: str
    cpu_s_per_item: float
    cpu_cv: float = 0.0
    io_s_per_item: float = 0.0
    ratio: float = 1.0
    bytes_per_item: int = 1024
    min_workers: int = 1
    max_workers: int = 256
    drift: Drift | None = None
    resident_bytes: int = 0
    max_concurrency: int = 1
    worker_bytes: int = 0
    fusable: bool = True
    remotable: bool = True
    items_per_call: int = 1
    gil_share: float = 1.0
    threadable: bool = False

    def __post_init__(self) -> None:
        where = f"StageModel {self.name!r}"
        if not 0.0 <= self.gil_share <= 1.0:
            raise ValueError(f"{where}: gil_share must be in [0, 1], got {self.gil_share}")
        if not isinstance(self.items_per_call, int) or self.items_per_call < 1:
            raise ValueError(
                f"{where}: items_per_call must be an int >= 1, got {self.items_per_call!r}"
            )
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ValueError(f"{where}: max_concurrency must be an int >= 1")
        if self.kind not in STAGE_KINDS:
            raise ValueError(f"{where}: kind must be one of {STAGE_KINDS}, got {self.kind!r}")
        if self.cpu_s_per_item < 0 or self.io_s_per_item < 0:
            raise ValueError(f"{where}: cpu_s_per_item and io_s_per_item must be >= 0")
        if self.cpu_s_per_item + self.io_s_per_item <= 0:
            raise ValueError(f"{where}: a stage must cost some time per item")
        if self.cpu_cv < 0:
            raise ValueError(f"{where}: cpu_cv must be >= 0, got {self.cpu_cv}")
        if self.ratio <= 0:
            raise ValueError(f"{where}: ratio must be > 0, got {self.ratio}")
        if self.resident_bytes < 0 or self.worker_bytes < 0:
            raise ValueError(f"{where}: resident_bytes and worker_bytes must be >= 0")
        if self.bytes_per_item <= 0:
            raise ValueError(f"{where}: bytes_per_item must be > 0, got {self.bytes_per_item}")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"{where}: need 1 <= min_workers <= max_workers, got "
                f"{self.min_workers}..{self.max_workers}"
            )
        if self.drift is not None and not isinstance(self.drift, Drift):
            object.__setattr__(self, "drift", Drift(*self.drift))


@dataclass(frozen=True)
class Workload:
    """A pipeline to simulate: its stages and the machine/consumer around them.

    Attributes:
        name: workload name.
        stages: stage models, source first.
        consumer_step_s: model time per item leaving the pipeline (0: infinitely fast).
        worker_rss_bytes: memory one worker process costs.
        worker_start_s: time before a newly added worker produces anything.
        switch_overhead: fraction of CPU lost per unit of oversubscription.
        dram_gbps: DRAM copy bandwidth; every output byte is copied once into a channel.
        cpu_ghz: CPU clock, reported to tuners (costs are given for this machine).
        initial_buffer_bytes: buffer per stage when no initial allocation is given.
        hop_s_per_item: CPU seconds an item costs to cross a channel between two stages
            besides the DRAM copy (framing, encoding and decoding, the router's messages),
            charged to the producing stage; fusion removes it. 0 where the stage costs already
            include it (the presets and generated workloads); BENCHMARKS.md measures ~2.5 us
            per row on this project's machine.
        rpc_s: seconds a remote call's round trip costs a remote worker, shared by the items
            of the call (``StageModel.items_per_call``); ``benchmarks/remote.py`` measures
            1.3-1.5 ms (:mod:`torchtune_pipe.tuning.cluster`).
        network_bytes_per_s: bandwidth between host and cluster, shared by every remote worker
            (bytes/s); every byte a remote worker takes in and sends back crosses it.
        rpc_cpu_s: host CPU seconds per remote call (the calling thread's part of it).
        hop_copies: host copies of every byte that crosses to or from a remote worker (at
            ``dram_gbps``).
        gil: the consumer's interpreter has a global interpreter lock (False: a free-threaded
            build, where thread workers share nothing but the cores).
        consumer_gil_s_per_item: seconds the consumer holds the interpreter lock per item
            leaving the pipeline (its Python, decoding the items it takes): thread workers
            share the lock with it. Part of ``consumer_step_s`` where that is longer; the
            consumer takes at least this long per item.
    """

    name: str
    stages: tuple[StageModel, ...]
    consumer_step_s: float = 0.0
    worker_rss_bytes: int = 150 * MiB
    worker_start_s: float = 0.5
    switch_overhead: float = 0.05
    dram_gbps: float = 20.0
    cpu_ghz: float = 2.5
    initial_buffer_bytes: int = 4 * MiB
    hop_s_per_item: float = 0.0
    rpc_s: float = RPC_S
    network_bytes_per_s: float = NETWORK_BYTES_PER_S
    rpc_cpu_s: float = RPC_CPU_S
    hop_copies: float = HOP_COPIES
    gil: bool = True
    consumer_gil_s_per_item: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError(f"Workload {self.name!r}: needs at least one stage")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"Workload {self.name!r}: stage names must be unique, got {names}")
        if self.consumer_step_s < 0 or self.worker_rss_bytes < 0 or self.worker_start_s < 0:
            raise ValueError(
                f"Workload {self.name!r}: consumer_step_s, worker_rss_bytes and "
                "worker_start_s must be >= 0"
            )
        if self.dram_gbps <= 0:
            raise ValueError(f"Workload {self.name!r}: dram_gbps must be > 0")
        if self.hop_s_per_item < 0:
            raise ValueError(f"Workload {self.name!r}: hop_s_per_item must be >= 0")
        for what in ("rpc_s", "rpc_cpu_s", "hop_copies", "consumer_gil_s_per_item"):
            if getattr(self, what) < 0:
                raise ValueError(f"Workload {self.name!r}: {what} must be >= 0")
        if self.network_bytes_per_s <= 0:
            raise ValueError(f"Workload {self.name!r}: network_bytes_per_s must be > 0")


@dataclass(frozen=True)
class Coefficients:
    """The per-stage constants of a workload's model (:mod:`torchtune_pipe.sim.model`, steps
    1-4 and 7), per stage in pipeline order; "pipeline item" is an item leaving the pipeline.
    """

    S: tuple[float, ...]  # items leaving stage i per pipeline item
    R: tuple[float, ...]  # stage-i input items per pipeline item
    c_fn: tuple[float, ...]  # CPU seconds of the stage's function per input item
    c_out: tuple[float, ...]  # CPU seconds per input item of its output crossing a channel
    d0: tuple[float, ...]  # CPU-free wait per input item
    cv2: tuple[float, ...]  # squared coefficient of variation of the per-item time
    nbytes: tuple[int, ...]  # bytes of one output item
    r_next: tuple[float, ...]  # the next stage's ratio (1 after the last stage)
    drift: tuple[Drift | None, ...]  # the drift of the stage's costs, if any
    resident: int  # bytes held whatever the allocation (resident state of every stage)
    xc: float  # pipeline items per second the consumer takes (inf: no consumer)

    @classmethod
    def of(cls, workload: Workload) -> Coefficients:
        """The coefficients of ``workload``."""
        st = workload.stages
        n = len(st)
        out_per_sink = [1.0] * n
        for i in range(n - 2, -1, -1):
            out_per_sink[i] = out_per_sink[i + 1] * st[i + 1].ratio
        copy_s = 1.0 / (workload.dram_gbps * 1e9)
        hop = workload.hop_s_per_item
        return cls(
            S=tuple(out_per_sink),
            R=tuple(out_per_sink[i] * st[i].ratio for i in range(n)),
            c_fn=tuple(s.cpu_s_per_item for s in st),
            c_out=tuple((s.bytes_per_item * copy_s + hop) / s.ratio for s in st),
            d0=tuple(s.io_s_per_item for s in st),
            cv2=tuple(s.cpu_cv**2 for s in st),
            nbytes=tuple(s.bytes_per_item for s in st),
            r_next=tuple(st[i + 1].ratio if i + 1 < n else 1.0 for i in range(n)),
            drift=tuple(s.drift for s in st),
            resident=sum(s.resident_bytes for s in st),
            xc=1.0 / workload.consumer_step_s if workload.consumer_step_s > 0 else math.inf,
        )

    def costs(self, t: float, fused: Sequence[bool]) -> tuple[list[float], list[float]]:
        """CPU seconds and CPU-free waits per input item of each stage at time ``t``, with the
        stages in ``fused`` fused: the host of a fused stage hands it its output in-process
        (no copy, no hop)."""
        n = len(self.c_fn)
        c = [
            self.c_fn[i] if i + 1 < n and fused[i + 1] else self.c_fn[i] + self.c_out[i]
            for i in range(n)
        ]
        d = list(self.d0)
        for i, drift in enumerate(self.drift):
            if drift is not None:
                f = drift.factor(t)
                c[i] *= f
                d[i] *= f
        return c, d


@dataclass(frozen=True)
class SteadyState:
    """The solved steady state of one allocation (see the module docstring).

    ``throughput`` is in items leaving the pipeline per second; ``fill`` is each buffer's mean
    fill fraction; ``memory_bytes`` counts filled buffers, worker RSS and resident state;
    ``gap`` is, per buffer, the difference between the line's rate above and below it (in
    pipeline items per second), the rate at which the buffer fills or drains after a change.
    Per stage, in pipeline order; a fused stage's buffer is unused (fill, probabilities and
    gap 0) and its host's entries are its group's output buffer's.
    """

    throughput: float
    phi: float
    busy: tuple[float, ...]
    fill: tuple[float, ...]
    p_empty: tuple[float, ...]
    p_full: tuple[float, ...]
    memory_bytes: float
    bottleneck: int
    gap: tuple[float, ...] = ()
