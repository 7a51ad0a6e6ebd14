"""A fast fluid model of a staged data pipeline, steerable through the :class:`Tunable` seam.

Each call to :meth:`SimPipeline.observe` advances simulated time by one interval and solves the
pipeline's steady state for that interval in closed form (no discrete events), so pre-training
an agent for tens of thousands of steps takes seconds. The model, per interval:

1. **Costs.** Stage ``i`` spends ``c_i`` CPU seconds and ``d_i`` seconds of CPU-free waiting
   (remote reads) per *input* item; ``c_i`` includes one DRAM copy of the output bytes and may
   drift over time. ``R_i`` is the number of stage-``i`` input items per item leaving the
   pipeline (batching makes it many-to-one).
2. **Processor sharing.** Every runnable worker gets the same CPU rate ``phi <= 1``. A stage's
   capacity is ``w_i / (R_i * (c_i / phi + d_i))`` pipeline items per second, so I/O-bound
   stages keep scaling past the core count (waiting uses no CPU). If the pipeline would need
   more than ``cpus`` cores, throughput is ``cpus / sum_i R_i c_i`` and ``phi`` is what makes
   the slowest stage meet it: a bottleneck's neighbours block and free CPU for it.
3. **Oversubscription.** More runnable workers than cores costs context switches and cache:
   usable cores are ``cpus / (1 + switch_overhead * (runnable / cpus - 1))``.
4. **Finite buffers.** Between two stages, a buffer of ``B`` bytes holds ``B / bytes_per_item``
   items. With variable costs, small buffers lose throughput; each buffer is treated as an
   M/M/1/N two-station line whose capacity ``N`` is scaled by ``1 / cv^2`` (deterministic
   costs need no buffer, heavy tails need a large one), giving an efficiency
   ``(1 - q^N) / (1 - q^(N+1))`` with ``q`` the rate ratio across it (folded below 1). The
   same queue gives each buffer's mean fill and its full/empty probabilities, which become
   the blocked-on-output/input fractions a real pipeline reports.
5. **Memory and OOM.** Memory used is filled buffer bytes + worker RSS + resident state (e.g.
   a shuffle buffer), the meaning :class:`~torchtune_pipe.tuning.base.Observation` gives it on
   both sides of the seam; each stage reports its workers' part (workers times the worker RSS
   plus the stage's ``worker_bytes``) as ``StageStats.memory_bytes``; resident state is held
   by no worker. Buffers fill at the rate imbalance across them, so an over-sized buffer
   upstream of a bottleneck fills and may push the pipeline out of memory a few intervals
   later. Past the limit the episode is over: throughput 0 until :meth:`SimPipeline.reset`.
6. **Noise.** Per interval, mean costs are resampled (lognormal, ``cv / sqrt(items)``) and the
   reported rates carry relative measurement noise ``noise``; ``noise=0`` is deterministic.
7. **Fusion.** A fused stage (``Allocation.fused``) runs in the workers of the stage before it,
   as live (:mod:`multiproc.fusion`): a group of a host and the stages fused into it is one
   station of the line, with the host's workers, costing per pipeline item the sum of its
   stages' ``R_i c_i`` (and waits ``R_i d_i``; a fused stage runs one call at a time). The
   hops inside the group disappear: the host no longer copies its output into a channel
   (``bytes_per_item / dram_gbps``) nor pays the channel's per-item cost
   (``Workload.hop_s_per_item``). A fused stage runs no workers (no worker RSS; its
   ``worker_bytes`` are held by each host worker), and its buffer is unused: the group's
   output goes to the host's buffer (the host worker's arena), in items of the group's last
   stage. Which stages may fuse follows the live rule (:meth:`SimPipeline.fusable`).
"""

from __future__ import annotations

import bisect
import copy as _copy
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from multiproc.spec import EXECUTOR_KIND, FUSABLE_INTO, FUSION_HOSTS
from multiproc.spec import PIPELINE_KINDS as STAGE_KINDS
from multiproc.stats import MAX_FUSED
from torchtune_pipe.tuning.base import (
    Allocation,
    MiB,
    Observation,
    StageStats,
    fusion_host,
    running_workers,
    waits_on_io,
)
from torchtune_pipe.tuning.concurrency import plan_concurrency

__all__ = ["Drift", "StageModel", "Workload", "SteadyState", "SimPipeline", "STAGE_KINDS"]

_CONSUMER_CV2 = 0.01  # a training step's time varies little (cv ~0.1)
_MIN_CV2 = 0.01


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

    def __post_init__(self) -> None:
        where = f"StageModel {self.name!r}"
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


def _overlapped(c: Sequence[float], d: Sequence[float], k: Sequence[int]) -> list[float]:
    """Waits per item once ``k`` calls are in flight per worker: they overlap on one core, so
    a worker spends ``max(c, (c + d) / k)`` seconds of wall time per item, ``c`` of it CPU."""
    return [
        max(0.0, (ci + di) / ki - ci) if ki > 1 else di for ci, di, ki in zip(c, d, k, strict=True)
    ]


def _mm1n(rho: float, n: float) -> tuple[float, float, float, float]:
    """M/M/1/N queue at load ``rho``: (efficiency, mean fill, P(empty), P(full))."""
    q = rho if rho <= 1.0 else 1.0 / rho
    if q > 1.0 - 1e-9:
        eff, fill, p_lo, p_hi = n / (n + 1), 0.5, 1 / (n + 1), 1 / (n + 1)
    else:
        qn = q**n if q > 0 else 0.0
        denom = 1.0 - qn * q
        eff = (1.0 - qn) / denom
        p_lo = (1.0 - q) / denom  # state 0 at load q < 1
        p_hi = qn * p_lo
        fill = min(1.0, (q / (1.0 - q) - (n + 1) * qn * q / denom) / n)
    if rho > 1.0:  # producer faster: mirror image, the buffer sits near full
        return eff, 1.0 - fill, p_hi, p_lo
    return eff, fill, p_lo, p_hi


def _schedule(value: float | Sequence[tuple[float, float]], what: str) -> tuple[tuple, tuple]:
    if isinstance(value, int | float):
        steps = [(0.0, float(value))]
    else:
        steps = sorted((float(t), float(v)) for t, v in value)
        if not steps:
            raise ValueError(f"SimPipeline: {what} schedule is empty")
    if any(v <= 0 for _, v in steps):
        raise ValueError(f"SimPipeline: {what} must be > 0, got {steps}")
    return tuple(t for t, _ in steps), tuple(v for _, v in steps)


def _at(sched: tuple[tuple, tuple], t: float) -> float:
    return sched[1][max(0, bisect.bisect_right(sched[0], t) - 1)]


@dataclass
class _State:
    t: float = 0.0
    alloc: Allocation | None = None
    prev_workers: tuple[int, ...] = ()
    levels: list[float] = field(default_factory=list)
    fused: tuple[bool, ...] = ()
    oom: bool = False
    last_x: float = 0.0
    last_obs: Observation | None = None


class SimPipeline:
    """A simulated pipeline implementing :class:`~torchtune_pipe.tuning.base.Tunable`.

    Args:
        workload: what to simulate.
        cpus: CPUs the pipeline may use, a number or a schedule ``[(t_start_s, cpus), ...]``.
        memory_limit_bytes: memory limit, a number or a schedule like ``cpus``.
        seed: seed of the per-interval noise.
        interval_s: simulated seconds each :meth:`observe` advances.
        initial: allocation at reset (default: one worker per stage, the workload's buffer).
        noise: relative measurement noise on reported rates; 0 also disables cost resampling.

    Example:
        >>> sim = SimPipeline(netflix_like(0), cpus=[(0, 32), (60, 64)], memory_limit_bytes=64 << 30)
        >>> obs = sim.observe(); sim.apply(tuner.reset(obs)); obs = sim.observe()
    """

    def __init__(
        self,
        workload: Workload,
        cpus: float | Sequence[tuple[float, float]],
        memory_limit_bytes: int | Sequence[tuple[float, float]],
        *,
        seed: int = 0,
        interval_s: float = 1.0,
        initial: Allocation | None = None,
        noise: float = 0.02,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"SimPipeline: interval_s must be > 0, got {interval_s}")
        if noise < 0:
            raise ValueError(f"SimPipeline: noise must be >= 0, got {noise}")
        self.workload = workload
        self.interval_s = float(interval_s)
        self.noise = float(noise)
        self.seed = seed
        self._cpus = _schedule(cpus, "cpus")
        self._mem = _schedule(memory_limit_bytes, "memory_limit_bytes")
        st = workload.stages
        n = len(st)
        self.n_stages = n
        # Items leaving stage i per pipeline item (S) and stage-i inputs per pipeline item (R).
        out_per_sink = [1.0] * n
        for i in range(n - 2, -1, -1):
            out_per_sink[i] = out_per_sink[i + 1] * st[i + 1].ratio
        self._S = tuple(out_per_sink)
        self._R = tuple(out_per_sink[i] * st[i].ratio for i in range(n))
        copy_s = 1.0 / (workload.dram_gbps * 1e9)
        hop = workload.hop_s_per_item
        # Per input item: the function, and the channel its output crosses (unless fused).
        self._c_fn = tuple(s.cpu_s_per_item for s in st)
        self._c_out = tuple((s.bytes_per_item * copy_s + hop) / s.ratio for s in st)
        # For each stage, how many of the stages after it its workers could run (live rule).
        self._chain_len = []
        for i, host in enumerate(st):
            k = 0
            while i + k + 1 < n and k < MAX_FUSED and _can_host(host, st[i + k + 1]):
                k += 1
            self._chain_len.append(k)
        self._d0 = tuple(s.io_s_per_item for s in st)
        self._cv2 = tuple(s.cpu_cv**2 for s in st)
        self._bytes = tuple(s.bytes_per_item for s in st)
        self._r_next = tuple(st[i + 1].ratio if i + 1 < n else 1.0 for i in range(n))
        self._resident = sum(s.resident_bytes for s in st)
        self._xc = 1.0 / workload.consumer_step_s if workload.consumer_step_s > 0 else math.inf
        buf = workload.initial_buffer_bytes
        default = Allocation(tuple(s.min_workers for s in st), (buf,) * n)
        self._initial = self._checked(initial) if initial is not None else default
        self.reset(seed)

    # -- Tunable -----------------------------------------------------------------------------

    def apply(self, allocation: Allocation) -> None:
        """Set workers and buffer bytes per stage; workers are clamped to each stage's bounds.
        Calls in flight per worker follow the allocation, or where it leaves them open the
        rule a live pipeline follows (:func:`~torchtune_pipe.tuning.concurrency.plan_concurrency`).
        Stages run fused as ``allocation.fused`` says (empty: as they run now).

        Raises:
            ValueError: when the allocation has the wrong number of stages, or fuses a stage
                that cannot be fused (as a live ``set_fused`` refuses it; the hard limits'
                :func:`~torchtune_pipe.tuning.safety.fusable_only` drops such requests).
        """
        a = self._checked(allocation)
        if self._s.last_obs is not None:
            a = plan_concurrency(self._s.last_obs, a)
        elif not a.concurrency and self._s.alloc is not None:
            a = a.replace(concurrency=self._concurrency(self._s.alloc))
        fused = a.fused or self._s.fused
        self._s.fused = fused
        self._s.alloc = a.replace(fused=fused if any(fused) else ())

    def observe(self) -> Observation:
        """Advance simulated time by ``interval_s`` and return that interval's statistics."""
        s, wl, dt = self._s, self.workload, self.interval_s
        t0, n = s.t, self.n_stages
        s.t = t0 + dt
        cpus, limit = _at(self._cpus, t0), int(_at(self._mem, t0))
        alloc = s.alloc
        if s.oom:
            return self._dead_observation(cpus, limit)
        fused = s.fused
        running = running_workers(alloc.replace(fused=fused))
        # A worker added since the last interval only works once it has started.
        warm = min(1.0, wl.worker_start_s / dt)
        w = tuple(
            a - (a - p) * warm if a > p else float(a)
            for a, p in zip(running, s.prev_workers, strict=True)
        )
        s.prev_workers = running
        c, d = self._costs(t0 + dt / 2, fused)
        calls = self._concurrency(alloc, fused)
        d = _overlapped(c, d, calls)
        if self.noise > 0:
            rng = self._rng
            x_ref = max(s.last_x, 1.0)
            for i in range(n):
                var = self._cv2[i] / max(1.0, x_ref * self._R[i] * dt)
                sig = math.sqrt(math.log1p(var))
                f = math.exp(sig * rng.gauss(0.0, 1.0) - sig * sig / 2)
                c[i] *= f
                d[i] *= f
        ss = self._solve(w, alloc.buffer_bytes, c, d, cpus, fused)
        x = ss.throughput
        # Buffers move toward their steady fill at the rate imbalance across them. A group's
        # stages run in lockstep: the host's buffer holds the group's last stage's items.
        rates, fills = [0.0] * n, [0.0] * n
        for i in range(n):
            if fused[i]:
                s.levels[i] = 0.0
                continue
            last = self._last(i, fused)
            k = self._capacity(alloc.buffer_bytes[i], last)
            target = ss.fill[i] * k
            flow = x * self._S[last]
            step = max(ss.gap[i], 0.1 * x) * self._S[last] * dt
            old = min(s.levels[i], k)
            new = min(target, old + step) if target > old else max(target, old - step)
            s.levels[i] = new
            for m in range(i, last + 1):
                rates[m] = max(0.0, flow + (new - old) / dt) * self._S[m] / self._S[last]
            fills[i] = new / k
        used = self._memory(running, s.levels, fused)
        if used > limit:
            s.oom = True
            return self._dead_observation(cpus, limit, used=int(used))
        s.last_x = x
        noisy = self._noisy
        fusable = self.fusable(fused)
        stages = []
        for i, sm in enumerate(wl.stages):
            # Live, a fused stage's time is its own share of its host's workers' wall time
            # and the group's waits are its host's (telemetry.py).
            idle = 0.0
            if not fused[i]:
                idle = max(0.0, 1.0 - sum(ss.busy[i : self._last(i, fused) + 1]))
            pe = ss.p_empty[fusion_host(fused, i - 1)] if i > 0 else 0.0
            pf = ss.p_full[i]
            share_in = pe / (pe + pf) if pe + pf > 1e-12 else 0.5
            stages.append(
                StageStats(
                    name=sm.name,
                    workers=running[i],
                    min_workers=sm.min_workers,
                    max_workers=sm.max_workers,
                    items_per_s=noisy(rates[i]),
                    busy=ss.busy[i],
                    blocked_in=idle * share_in,
                    blocked_out=idle * (1.0 - share_in),
                    buffer_bytes=alloc.buffer_bytes[i],
                    buffer_fill=fills[i],
                    cpu_s_per_item=noisy(c[i] * sm.ratio),
                    io_bound=waits_on_io(c[i], c[i] + d[i]),  # per item: CPU, CPU + wait
                    concurrency=calls[i],
                    max_concurrency=sm.max_concurrency,
                    memory_bytes=self._stage_memory(running, i, fused),
                    fused=fused[i],
                    fusable=fusable[i],
                )
            )
        latency = 0.0
        if x > 0:
            latency = sum(
                s.levels[i] / (x * self._S[self._last(i, fused)]) for i in range(n) if not fused[i]
            )
            latency += sum(self._R[i] * (c[i] / ss.phi + d[i]) for i in range(n))
        obs = Observation(
            stages=tuple(stages),
            throughput=noisy(x),
            cpus=cpus,
            memory_limit_bytes=limit,
            memory_used_bytes=int(used),
            latency_s=latency,
            consumer_step_s=wl.consumer_step_s,
            dram_gbps=wl.dram_gbps,
            cpu_ghz=wl.cpu_ghz,
            t=s.t,
        )
        s.last_obs = obs
        return obs

    # -- simulator extras --------------------------------------------------------------------

    def evaluate(
        self, allocation: Allocation, cpus: float | None = None, t: float | None = None
    ) -> float:
        """Steady-state throughput of a static allocation, without noise.

        At the simulator's current time unless ``t`` (seconds) is given: costs drift, so an
        allocation chosen at one time is judged with that time's costs. Returns 0 when the
        allocation's steady-state memory exceeds the limit then. Does not change the
        simulator's state.
        """
        at = self._when(t)
        ss = self.steady_state(allocation, cpus, at)
        return ss.throughput if ss.memory_bytes <= _at(self._mem, at) else 0.0

    def steady_state(
        self, allocation: Allocation, cpus: float | None = None, t: float | None = None
    ) -> SteadyState:
        """The noiseless steady state of ``allocation`` now (or at time ``t``) on ``cpus``."""
        a = self._checked(allocation)
        fused = a.fused or self._s.fused
        at = self._when(t)
        c, d = self._costs(at, fused)
        d = _overlapped(c, d, self._concurrency(a, fused))
        cpus = _at(self._cpus, at) if cpus is None else float(cpus)
        w = tuple(map(float, running_workers(a.replace(fused=fused))))
        return self._solve(w, a.buffer_bytes, c, d, cpus, fused)

    def upper_bound(self, cpus: float | None = None, t: float | None = None) -> float:
        """Throughput no allocation can beat now (or at ``t``): all CPU work on ``cpus`` cores,
        or the consumer.

        Every item's CPU cost must be paid, so ``cpus / sum_i R_i c_i`` bounds any allocation,
        with every stage that may be fused fused (the fewest hops).
        """
        at = self._when(t)
        c, _ = self._costs(at, self.widest_fusion())
        cpus = _at(self._cpus, at) if cpus is None else float(cpus)
        return min(self._xc, cpus / sum(self._R[i] * c[i] for i in range(self.n_stages)))

    def _when(self, t: float | None) -> float:
        return self._s.t if t is None else float(t)

    def reset(self, seed: int | None = None) -> None:
        """Back to time 0 with the initial allocation, empty buffers and no OOM."""
        if seed is not None:
            self.seed = seed
        self._rng = random.Random(self.seed)
        init = self._initial
        fused = init.fused or (False,) * self.n_stages
        self._s = _State(
            alloc=init,
            prev_workers=running_workers(init.replace(fused=fused)),
            levels=[0.0] * self.n_stages,
            fused=fused,
            last_x=0.0,
        )

    def fusable(self, fused: Sequence[bool] | None = None) -> tuple[bool, ...]:
        """Per stage, whether it may be fused into the stage before it, given the stages fused
        in ``fused`` (default: now); a fused stage is fusable. The live rule
        (``multiproc.fusion``): a fusable ``"map"`` after a ``"source"`` or ``"map"``, at most
        ``MAX_FUSED`` stages run in one host's workers."""
        state = list(self._s.fused if fused is None else fused)
        out = []
        for j in range(self.n_stages):
            want = list(state)
            want[j] = True
            out.append(self._fuse_error(j, want) is None)
        return tuple(out)

    def widest_fusion(self) -> tuple[bool, ...]:
        """Every stage that may be fused fused, in pipeline order (the fewest hops)."""
        fused = [False] * self.n_stages
        for j in range(1, self.n_stages):
            fused[j] = True
            fused[j] = self._fuse_error(j, fused) is None
        return tuple(fused)

    def copy(self) -> SimPipeline:
        """An independent copy, state and noise generator included."""
        return _copy.deepcopy(self)

    @property
    def t(self) -> float:
        """Simulated seconds since reset."""
        return self._s.t

    @property
    def oom(self) -> bool:
        """True once memory exceeded the limit (until :meth:`reset`)."""
        return self._s.oom

    @property
    def allocation(self) -> Allocation:
        """The allocation in force."""
        return self._s.alloc

    def cpus_at(self, t: float) -> float:
        """CPUs the schedule gives at time ``t``."""
        return _at(self._cpus, t)

    def memory_limit_at(self, t: float) -> int:
        """Memory limit the schedule gives at time ``t``."""
        return int(_at(self._mem, t))

    # -- internals ---------------------------------------------------------------------------

    def _checked(self, a: Allocation) -> Allocation:
        n = self.n_stages
        if len(a.workers) != n:
            raise ValueError(
                f"SimPipeline.apply: allocation has {len(a.workers)} stages, workload "
                f"{self.workload.name!r} has {n}"
            )
        st = self.workload.stages
        for j, f in enumerate(a.fused):
            if f and (why := self._fuse_error(j, a.fused)) is not None:
                raise ValueError(f"SimPipeline.apply: cannot fuse stage {st[j].name!r}: {why}")
        w = tuple(min(st[i].max_workers, max(st[i].min_workers, a.workers[i])) for i in range(n))
        b = tuple(max(0, x) for x in a.buffer_bytes)
        return (
            a if (w == a.workers and b == a.buffer_bytes) else a.replace(workers=w, buffer_bytes=b)
        )

    def _fuse_error(self, j: int, fused: Sequence[bool]) -> str | None:
        """Why stage ``j`` cannot run fused under ``fused`` (None: it can), as live."""
        if j == 0:
            return "the first stage has no stage before it"
        st = self.workload.stages
        if not _can_host(st[j - 1], st[j]):
            return f"stage {st[j].name!r} cannot run in the workers of {st[j - 1].name!r}"
        host = fusion_host(fused, j - 1)
        if j - host > self._chain_len[host]:
            return (
                f"stage {st[host].name!r} can run at most {self._chain_len[host]} stages after it"
            )
        return None

    def _last(self, i: int, fused: Sequence[bool]) -> int:
        """The last stage of the group hosted by stage ``i`` (``i`` when none is fused)."""
        while i + 1 < self.n_stages and fused[i + 1]:
            i += 1
        return i

    def _concurrency(self, a: Allocation, fused: Sequence[bool] = ()) -> tuple[int, ...]:
        st = self.workload.stages
        if not a.concurrency:
            return (1,) * self.n_stages
        # A fused stage's function runs one call at a time in its host's worker.
        return tuple(
            1 if fused and fused[i] else max(1, min(k, s.max_concurrency))
            for i, (k, s) in enumerate(zip(a.concurrency, st, strict=True))
        )

    def _costs(self, t: float, fused: Sequence[bool]) -> tuple[list[float], list[float]]:
        n = self.n_stages
        # The host of a fused stage hands it its output in-process: no copy, no hop.
        c = [
            self._c_fn[i] if i + 1 < n and fused[i + 1] else self._c_fn[i] + self._c_out[i]
            for i in range(n)
        ]
        d = list(self._d0)
        for i, sm in enumerate(self.workload.stages):
            if sm.drift is not None:
                f = sm.drift.factor(t)
                c[i] *= f
                d[i] *= f
        return c, d

    def _capacity(self, buffer_bytes: int, i: int) -> float:
        # A channel always admits one item, whatever its byte budget.
        return max(1.0, buffer_bytes / self._bytes[i])

    def _stage_memory(self, workers: Sequence[int], i: int, fused: Sequence[bool]) -> int:
        """What stage ``i``'s workers hold (``StageStats.memory_bytes``): a host's workers
        also hold what the stages fused into it keep per worker; a fused stage has none."""
        if fused[i]:
            return 0
        st = self.workload.stages
        held = sum(st[m].worker_bytes for m in range(i, self._last(i, fused) + 1))
        return int(workers[i] * (self.workload.worker_rss_bytes + held))

    def _memory(
        self, workers: Sequence[int], levels: Sequence[float], fused: Sequence[bool]
    ) -> float:
        n = self.n_stages
        buffered = sum(levels[i] * self._bytes[self._last(i, fused)] for i in range(n))
        held = sum(self._stage_memory(workers, i, fused) for i in range(n))
        return buffered + held + self._resident

    def _noisy(self, v: float) -> float:
        if self.noise <= 0 or v <= 0:
            return v
        return max(0.0, v * (1.0 + self.noise * self._rng.gauss(0.0, 1.0)))

    def _solve(self, w, buffers, c, d, cpus, fused) -> SteadyState:
        n = self.n_stages
        # The line's stations: each group (a host and the stages fused into it) is one, with
        # the host's workers and its members' costs per pipeline item; a stage on its own
        # keeps its per-input-item costs and R, so an unfused line is solved as it always was.
        hosts = [i for i in range(n) if not fused[i]]
        lasts = [self._last(i, fused) for i in hosts]
        R, cn, dn, cv2 = [], [], [], []
        for h, last in zip(hosts, lasts, strict=True):
            if h == last:
                R.append(self._R[h])
                cn.append(c[h])
                dn.append(d[h])
                cv2.append(self._cv2[h])
                continue
            group = range(h, last + 1)
            t = [self._R[i] * (c[i] + d[i]) for i in group]
            R.append(1.0)
            cn.append(sum(self._R[i] * c[i] for i in group))
            dn.append(sum(self._R[i] * d[i] for i in group))
            # Independent per-item times add: the group's squared cv weighs its members'.
            cv2.append(
                sum(ti * ti * self._cv2[i] for ti, i in zip(t, group, strict=True)) / sum(t) ** 2
            )
        m = len(hosts)
        wn = [w[h] for h in hosts]
        cost = sum(R[k] * cn[k] for k in range(m))
        x1 = min(self._xc, min(wn[k] / (R[k] * (cn[k] + dn[k])) for k in range(m)))
        x, phi = self._share(wn, R, cn, dn, cpus, cost, x1)
        if x * cost / phi > cpus:  # more runnable workers than cores: switching overhead
            runnable = min(x * cost / phi, sum(wn[k] * cn[k] / (cn[k] + dn[k]) for k in range(m)))
            usable = cpus / (1.0 + self.workload.switch_overhead * max(0.0, runnable / cpus - 1))
            x, phi = self._share(wn, R, cn, dn, usable, cost, x1)
        caps = [wn[k] / (R[k] * (cn[k] / phi + dn[k])) for k in range(m)]
        bottleneck = min(range(m), key=caps.__getitem__)
        up = list(caps)
        for k in range(1, m):
            up[k] = min(up[k], up[k - 1])
        down = [self._xc] * m
        for k in range(m - 2, -1, -1):
            down[k] = min(caps[k + 1], down[k + 1])
        eff = 1.0
        fill, p_empty, p_full, gap = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        mem = 0.0
        for k, (h, last) in enumerate(zip(hosts, lasts, strict=True)):
            gap[h] = abs(up[k] - down[k]) if down[k] < math.inf else up[k]
            cap = self._capacity(buffers[h], last)
            r = self._r_next[last]
            v = (cv2[k] + (cv2[k + 1] if k + 1 < m else _CONSUMER_CV2) / r) / 2
            n_eff = (cap / r + 2.0) / max(v, _MIN_CV2)
            e, fill[h], p_empty[h], p_full[h] = _mm1n(
                up[k] / down[k] if down[k] < math.inf else 0.0, n_eff
            )
            eff *= e
            mem += fill[h] * cap * self._bytes[last]
        x *= eff
        host = [fusion_host(fused, i) for i in range(n)]
        busy = tuple(min(1.0, x * self._R[i] * (c[i] / phi + d[i]) / w[host[i]]) for i in range(n))
        mem += sum(self._stage_memory(w, i, fused) for i in range(n)) + self._resident
        return SteadyState(
            x,
            phi,
            busy,
            tuple(fill),
            tuple(p_empty),
            tuple(p_full),
            mem,
            hosts[bottleneck],
            tuple(gap),
        )

    def _share(self, w, R, c, d, cpus, cost, x1) -> tuple[float, float]:
        """Throughput and per-worker CPU rate under processor sharing of ``cpus`` cores."""
        if x1 * cost <= cpus:
            return x1, 1.0
        x = cpus / cost
        # The rate phi at which the slowest station just meets x; others then block part-time.
        phi = max(
            (c[k] / (w[k] / (R[k] * x) - d[k]) for k in range(len(w)) if c[k] > 0),
            default=1.0,
        )
        return x, min(1.0, phi)

    def _dead_observation(self, cpus: float, limit: int, used: int | None = None) -> Observation:
        s, wl = self._s, self.workload
        running = running_workers(s.alloc.replace(fused=s.fused))
        fusable = self.fusable(s.fused)
        stages = tuple(
            StageStats(
                name=sm.name,
                workers=running[i],
                min_workers=sm.min_workers,
                max_workers=sm.max_workers,
                buffer_bytes=s.alloc.buffer_bytes[i],
                memory_bytes=self._stage_memory(running, i, s.fused),
                fused=s.fused[i],
                fusable=fusable[i],
            )
            for i, sm in enumerate(wl.stages)
        )
        used = int(self._memory(running, s.levels, s.fused)) if used is None else used
        return Observation(
            stages=stages,
            throughput=0.0,
            cpus=cpus,
            memory_limit_bytes=limit,
            memory_used_bytes=used,
            consumer_step_s=wl.consumer_step_s,
            dram_gbps=wl.dram_gbps,
            cpu_ghz=wl.cpu_ghz,
            t=s.t,
            oom=True,
        )


def _can_host(host: StageModel, stage: StageModel) -> bool:
    """Whether ``stage`` may run in the workers of ``host``, the stage before it: the live
    rule (``multiproc.spec.fuse_blocker``) on the executor kinds the simulator's kinds map to."""
    kind = EXECUTOR_KIND.get(host.kind)  # type: ignore[call-overload]
    return (
        stage.fusable and kind in FUSION_HOSTS and EXECUTOR_KIND.get(stage.kind) in FUSABLE_INTO  # type: ignore[call-overload]
    )
