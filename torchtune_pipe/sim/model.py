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
8. **Remote workers.** ``Allocation.remote`` of a stage's workers run on a cluster of
   ``cluster_cpus`` CPUs (:mod:`torchtune_pipe.sim.remote`): the function's CPU on a cluster
   CPU of their own, a round trip per call and bytes over a shared link as waits, the hop's
   CPU on the host, no worker memory on the host.
"""

from __future__ import annotations

import bisect
import copy as _copy
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from multiproc.stats import MAX_FUSED
from torchtune_pipe.tuning.base import (
    Allocation,
    Observation,
    StageStats,
    fusion_host,
    running_workers,
    waits_on_io,
)
from torchtune_pipe.tuning.calls_in_flight import plan_concurrency

from .fused import FusionRule, can_host
from .remote import RemoteModel
from .solve import Solver, overlapped
from .workload import STAGE_KINDS, Drift, StageModel, SteadyState, Workload

__all__ = ["Drift", "StageModel", "Workload", "SteadyState", "SimPipeline", "STAGE_KINDS"]


def _schedule(
    value: float | Sequence[tuple[float, float]], what: str, zero: bool = False
) -> tuple[tuple, tuple]:
    if isinstance(value, int | float):
        steps = [(0.0, float(value))]
    else:
        steps = sorted((float(t), float(v)) for t, v in value)
        if not steps:
            raise ValueError(f"SimPipeline: {what} schedule is empty")
    if any(v < 0 or (v == 0 and not zero) for _, v in steps):
        raise ValueError(f"SimPipeline: {what} must be {'>=' if zero else '>'} 0, got {steps}")
    return tuple(t for t, _ in steps), tuple(v for _, v in steps)


def _at(sched: tuple[tuple, tuple], t: float) -> float:
    return sched[1][max(0, bisect.bisect_right(sched[0], t) - 1)]


@dataclass
class _State:
    t: float = 0.0
    alloc: Allocation | None = None
    prev_workers: tuple[int, ...] = ()
    prev_remote: tuple[int, ...] = ()
    levels: list[float] = field(default_factory=list)
    fused: tuple[bool, ...] = ()
    oom: bool = False
    last_x: float = 0.0
    last_obs: Observation | None = None


class SimPipeline(Solver, FusionRule, RemoteModel):
    """A simulated pipeline implementing :class:`~torchtune_pipe.tuning.base.Tunable`.

    Args:
        workload: what to simulate.
        cpus: CPUs the pipeline may use, a number or a schedule ``[(t_start_s, cpus), ...]``.
        memory_limit_bytes: memory limit, a number or a schedule like ``cpus``.
        seed: seed of the per-interval noise.
        interval_s: simulated seconds each :meth:`observe` advances.
        initial: allocation at reset (default: one worker per stage, the workload's buffer).
        noise: relative measurement noise on reported rates; 0 also disables cost resampling.
        cluster_cpus: CPUs a cluster offers remote workers (0: none), a number or a schedule
            like ``cpus``.

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
        cluster_cpus: float | Sequence[tuple[float, float]] = 0.0,
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
        self._cluster = _schedule(cluster_cpus, "cluster_cpus", zero=True)
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
            while i + k + 1 < n and k < MAX_FUSED and can_host(host, st[i + k + 1]):
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
        self._s = _State(fused=self._initial.fused or (False,) * n)
        why = self._remote_error(self._initial.remote, self._s.fused)
        if why is not None:
            raise ValueError(f"SimPipeline: initial: {why}")
        self.reset(seed)

    # -- Tunable -----------------------------------------------------------------------------

    def apply(self, allocation: Allocation) -> None:
        """Set workers and buffer bytes per stage; workers are clamped to each stage's bounds.
        Calls in flight per worker follow the allocation, or where it leaves them open the
        rule a live pipeline follows
        (:func:`~torchtune_pipe.tuning.calls_in_flight.plan_concurrency`).
        Stages run fused as ``allocation.fused`` says (empty: as they run now), and
        ``allocation.remote`` of their workers on the cluster (empty: each stage keeps its
        placement); remote workers past ``cluster_cpus`` wait (pending) and do nothing.

        Raises:
            ValueError: when the allocation has the wrong number of stages, fuses a stage
                that cannot be fused (as a live ``set_fused`` refuses it; the hard limits'
                :func:`~torchtune_pipe.tuning.safety.fusable_only` drops such requests), or
                runs remote workers of a stage that cannot have them (a source, shuffle or
                batch, a fused stage or its host; :func:`~torchtune_pipe.tuning.safety.placed`
                keeps such a stage's placement).
        """
        a = self._checked(allocation)
        if self._s.last_obs is not None:
            a = plan_concurrency(self._s.last_obs, a)
        elif not a.concurrency and self._s.alloc is not None:
            a = a.replace(concurrency=self._concurrency(self._s.alloc))
        fused = a.fused or self._s.fused
        remote = self._remote_asked(a, fused)
        if (why := self._remote_error(remote, fused)) is not None:
            raise ValueError(f"SimPipeline.apply: {why}")
        self._s.fused = fused
        self._s.alloc = a.replace(
            fused=fused if any(fused) else (), remote=remote if any(remote) else ()
        )

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
        cluster = _at(self._cluster, t0)
        local = self._local(alloc.remote, running)
        remote = self._running_remote(alloc.remote, running, cluster)
        # A worker added since the last interval only works once it has started.
        warm = min(1.0, wl.worker_start_s / dt)
        w_local, w_remote = (
            tuple(
                a - (a - p) * warm if a > p else float(a) for a, p in zip(now, before, strict=True)
            )
            for now, before in ((local, s.prev_workers), (remote, s.prev_remote))
        )
        s.prev_workers, s.prev_remote = local, tuple(remote)
        c, d = self._costs(t0 + dt / 2, fused)
        calls = self._concurrency(alloc, fused)
        d = overlapped(c, d, calls)
        if self.noise > 0:
            rng = self._rng
            x_ref = max(s.last_x, 1.0)
            for i in range(n):
                var = self._cv2[i] / max(1.0, x_ref * self._R[i] * dt)
                sig = math.sqrt(math.log1p(var))
                f = math.exp(sig * rng.gauss(0.0, 1.0) - sig * sig / 2)
                c[i] *= f
                d[i] *= f
        ss, cb, db, share = self._placed_solve(
            w_local, w_remote, alloc.buffer_bytes, c, d, cpus, fused
        )
        hop, _, net, _ = self._hop(c, fused)
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
        used = self._memory(local, s.levels, fused)
        if used > limit:
            s.oom = True
            return self._dead_observation(cpus, limit, used=int(used))
        s.last_x = x
        noisy = self._noisy
        fusable = self.fusable(fused)
        remotable = self.remotable()
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
                    hop_s_per_item=0.0 if fused[i] else self._hop_out(i, fused),
                    io_bound=waits_on_io(c[i], c[i] + d[i]),  # per item: CPU, CPU + wait
                    concurrency=calls[i],
                    max_concurrency=sm.max_concurrency,
                    memory_bytes=self._stage_memory(local, i, fused),
                    fused=fused[i],
                    fusable=fusable[i],
                    remote_workers=remote[i],
                    remotable=remotable[i],
                    remote_items_per_s=noisy(rates[i] * share[i]),
                    bytes_per_item=float(sm.bytes_per_item),
                    net_s_per_item=net[i] * sm.ratio if remote[i] else 0.0,
                    hop_cpu_s_per_item=noisy(hop[i] * sm.ratio) if remote[i] else 0.0,
                    items_per_call=float(sm.items_per_call),
                )
            )
        latency = 0.0
        if x > 0:
            latency = sum(
                s.levels[i] / (x * self._S[self._last(i, fused)]) for i in range(n) if not fused[i]
            )
            latency += sum(self._R[i] * (cb[i] / ss.phi + db[i]) for i in range(n))
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
            cluster_cpus=cluster,
            network_bytes_per_s=wl.network_bytes_per_s,
            rpc_s=wl.rpc_s,
        )
        s.last_obs = obs
        return obs

    # -- simulator extras --------------------------------------------------------------------

    def evaluate(
        self,
        allocation: Allocation,
        cpus: float | None = None,
        t: float | None = None,
        cluster_cpus: float | None = None,
    ) -> float:
        """Steady-state throughput of a static allocation, without noise.

        At the simulator's current time unless ``t`` (seconds) is given: costs drift, so an
        allocation chosen at one time is judged with that time's costs. Returns 0 when the
        allocation's steady-state memory exceeds the limit then. Does not change the
        simulator's state.
        """
        at = self._when(t)
        ss = self.steady_state(allocation, cpus, at, cluster_cpus)
        return ss.throughput if ss.memory_bytes <= _at(self._mem, at) else 0.0

    def steady_state(
        self,
        allocation: Allocation,
        cpus: float | None = None,
        t: float | None = None,
        cluster_cpus: float | None = None,
    ) -> SteadyState:
        """The noiseless steady state of ``allocation`` now (or at time ``t``) on ``cpus``
        and ``cluster_cpus`` (default: the schedules' at that time).

        Raises:
            ValueError: as :meth:`apply` for an allocation it would refuse.
        """
        a = self._checked(allocation)
        fused = a.fused or self._s.fused
        asked = self._remote_asked(a, fused)
        if (why := self._remote_error(asked, fused)) is not None:
            raise ValueError(f"SimPipeline.steady_state: {why}")
        at = self._when(t)
        c, d = self._costs(at, fused)
        d = overlapped(c, d, self._concurrency(a, fused))
        cpus = _at(self._cpus, at) if cpus is None else float(cpus)
        cluster = _at(self._cluster, at) if cluster_cpus is None else float(cluster_cpus)
        running = running_workers(a.replace(fused=fused))
        local = self._local(asked, running)
        remote = self._running_remote(asked, running, cluster)
        return self._placed_solve(local, remote, a.buffer_bytes, c, d, cpus, fused)[0]

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
        running = running_workers(init.replace(fused=fused))
        remote = tuple(
            min(r, w) for r, w in zip(init.remote or (0,) * len(running), running, strict=True)
        )
        self._s = _State(
            alloc=init,
            prev_workers=tuple(w - r for w, r in zip(running, remote, strict=True)),
            prev_remote=remote,
            levels=[0.0] * self.n_stages,
            fused=fused,
            last_x=0.0,
        )

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

    def cluster_cpus_at(self, t: float) -> float:
        """Cluster CPUs the schedule gives at time ``t``."""
        return _at(self._cluster, t)

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

    def _hop_out(self, i: int, fused: Sequence[bool]) -> float:
        """Seconds per item stage ``i`` emits that its group's output pays to cross its
        channel (the host reports it, as live: its workers encode the group's output)."""
        last = self._last(i, fused)
        st = self.workload.stages[last]
        return self._c_out[last] * st.ratio * self._S[last] / self._S[i]

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
