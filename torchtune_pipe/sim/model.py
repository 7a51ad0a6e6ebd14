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
   both sides of the seam; each stage reports its process workers' part (each the worker RSS
   plus the stage's ``worker_bytes``) as ``StageStats.memory_bytes``; a thread worker holds
   its ``worker_bytes`` in the consumer's process, and resident state is held by no worker.
   Buffers fill at the rate imbalance across them, so an over-sized buffer upstream of a
   bottleneck fills and may push the pipeline out of memory a few intervals later. Past the
   limit the episode is over: throughput 0 until :meth:`SimPipeline.reset`.
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
   stage. Which stages may fuse follows the live rule (:meth:`SimPipeline.fusable`,
   :mod:`torchtune_pipe.sim.fused`).
8. **Remote workers.** ``Allocation.remote`` of a stage's workers run on a cluster of
   ``cluster_cpus`` CPUs (:mod:`torchtune_pipe.sim.remote`): the function's CPU on a cluster
   CPU of their own, a round trip per call and bytes over a shared link as waits, the hop's
   CPU on the host, no worker memory on the host.
9. **Thread workers.** ``Allocation.threads`` of a stage's local workers run as threads of the
   consumer's process (:mod:`torchtune_pipe.sim.threads`): cores, hops and ``worker_bytes`` as
   a process worker, no worker RSS, and ``StageModel.gil_share`` of their CPU holding the one
   interpreter lock they share with the consumer (``Workload.gil``,
   ``Workload.consumer_gil_s_per_item``): past one lock-second per second they wait for it.
   Where an allocation leaves ``threads`` empty, the live rule decides for threadable stages
   (:class:`~torchtune_pipe.tuning.worker_kind.KindRule`, one per simulator).

:class:`SimPipeline` is the front end: it holds the schedules and the state that changes as
it runs (:class:`_State`), and each interval asks its collaborators, built once from the
workload: the coefficients (:class:`~torchtune_pipe.sim.workload.Coefficients`), the fusion
rule (:class:`~torchtune_pipe.sim.fused.FusionRule`), the solver of steps 1-5
(:class:`~torchtune_pipe.sim.solve.Solver`), the remote workers of step 8
(:class:`~torchtune_pipe.sim.remote.RemoteModel`) and the thread workers of step 9
(:class:`~torchtune_pipe.sim.threads.ThreadModel`).
"""

from __future__ import annotations

import copy as _copy
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from torchtune_pipe.sim.fused import FusionRule
from torchtune_pipe.sim.remote import RemoteModel
from torchtune_pipe.sim.schedule import schedule, value_at
from torchtune_pipe.sim.solve import Solver, overlapped
from torchtune_pipe.sim.threads import ThreadModel
from torchtune_pipe.sim.workload import (
    STAGE_KINDS,
    Coefficients,
    Drift,
    StageModel,
    SteadyState,
    Workload,
)
from torchtune_pipe.tuning.base import (
    Allocation,
    Observation,
    StageStats,
    fusion_host,
    local_workers,
    running_workers,
    waits_on_io,
)
from torchtune_pipe.tuning.calls_in_flight import plan_concurrency
from torchtune_pipe.tuning.worker_kind import KindRule

__all__ = ["Drift", "StageModel", "Workload", "SteadyState", "SimPipeline", "STAGE_KINDS"]


@dataclass
class _State:
    """What a simulated pipeline changes as it runs; :meth:`SimPipeline.reset` starts it anew."""

    alloc: Allocation  # the allocation in force
    fused: tuple[bool, ...]  # per stage: runs in the previous stage's workers
    prev_workers: tuple[int, ...]  # per stage: local workers asked for in the interval before
    prev_remote: tuple[int, ...]  # per stage: remote workers that ran in the interval before
    levels: list[float]  # per stage: items in its buffer now
    t: float = 0.0  # simulated seconds since reset
    oom: bool = False  # memory went past the limit: no throughput until reset
    last_x: float = 0.0  # the last interval's throughput, without noise (pipeline items/s)
    last_obs: Observation | None = None  # the last observation (plan_concurrency reads it)


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
        self._cpus = schedule(cpus, "cpus")
        self._mem = schedule(memory_limit_bytes, "memory_limit_bytes")
        self._cluster = schedule(cluster_cpus, "cluster_cpus", zero=True)
        st = workload.stages
        n = len(st)
        self.n_stages = n
        self._coef = Coefficients.of(workload)
        self._rule = FusionRule(st)
        self._solver = Solver(workload, self._coef, self._rule)
        self._remote = RemoteModel(workload, self._coef, self._solver)
        self._threads = ThreadModel(workload, self._coef, self._rule, self._remote)
        buf = workload.initial_buffer_bytes
        default = Allocation(tuple(s.min_workers for s in st), (buf,) * n)
        self._initial = self._checked(initial) if initial is not None else default
        why = self._remote.error(self._initial.remote, self._initial.fused or (False,) * n)
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
        ``allocation.threads`` of a threadable stage's local workers run as threads (empty:
        as the live rule decides, :class:`~torchtune_pipe.tuning.worker_kind.KindRule`); a
        stage that is not threadable keeps its kind.

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
        elif not a.concurrency:
            a = a.replace(concurrency=self._concurrency(self._s.alloc))
        fused = a.fused or self._s.fused
        remote = self._remote.asked(a, fused, self._s.alloc)
        if (why := self._remote.error(remote, fused)) is not None:
            raise ValueError(f"SimPipeline.apply: {why}")
        self._s.fused = fused
        a = a.replace(fused=fused if any(fused) else (), remote=remote if any(remote) else ())
        if not a.threads and self._s.last_obs is not None and any(self._threads.threadable(fused)):
            a = self._kinds.plan(self._s.last_obs, a)
        threads = self._threads.asked(a, fused, local_workers(a), *self._kinds_now())
        self._s.alloc = a.replace(threads=threads if any(threads) else ())

    def observe(self) -> Observation:
        """Advance simulated time by ``interval_s`` and return that interval's statistics."""
        s, wl, dt = self._s, self.workload, self.interval_s
        t0, n = s.t, self.n_stages
        co, rule, solver, rm = self._coef, self._rule, self._solver, self._remote
        s.t = t0 + dt
        cpus, limit = value_at(self._cpus, t0), int(value_at(self._mem, t0))
        alloc = s.alloc
        if s.oom:
            return self._dead_observation(cpus, limit)
        fused = s.fused
        running = running_workers(alloc.replace(fused=fused))
        cluster = value_at(self._cluster, t0)
        local = rm.local(alloc.remote, running)
        remote = rm.running(alloc.remote, running, cluster)
        threads = alloc.threads or (0,) * n
        procs = [w - t for w, t in zip(local, threads, strict=True)]
        # A worker added since the last interval only works once it has started.
        warm = min(1.0, wl.worker_start_s / dt)
        w_local, w_remote = (
            tuple(
                a - (a - p) * warm if a > p else float(a) for a, p in zip(now, before, strict=True)
            )
            for now, before in ((local, s.prev_workers), (remote, s.prev_remote))
        )
        s.prev_workers, s.prev_remote = local, tuple(remote)
        c, d = co.costs(t0 + dt / 2, fused)
        calls = self._concurrency(alloc, fused)
        d = overlapped(c, d, calls)
        if self.noise > 0:
            rng = self._rng
            x_ref = max(s.last_x, 1.0)
            for i in range(n):
                var = co.cv2[i] / max(1.0, x_ref * co.R[i] * dt)
                sig = math.sqrt(math.log1p(var))
                f = math.exp(sig * rng.gauss(0.0, 1.0) - sig * sig / 2)
                c[i] *= f
                d[i] *= f
        w_threads = [min(float(t), w) for t, w in zip(threads, w_local, strict=True)]
        ss, cb, db, share, dl = self._threads.solve(
            w_local, w_threads, w_remote, alloc.buffer_bytes, c, d, cpus, fused
        )
        hop, _, net, _ = rm.hop(c, fused)
        c_seen = self._threads.handed_over(c, w_local, w_threads, fused)  # as solve() ran it
        x = ss.throughput
        # Buffers move toward their steady fill at the rate imbalance across them. A group's
        # stages run in lockstep: the host's buffer holds the group's last stage's items.
        rates, fills = [0.0] * n, [0.0] * n
        for i in range(n):
            if fused[i]:
                s.levels[i] = 0.0
                continue
            last = rule.last(i, fused)
            k = solver.capacity(alloc.buffer_bytes[i], last)
            target = ss.fill[i] * k
            flow = x * co.S[last]
            step = max(ss.gap[i], 0.1 * x) * co.S[last] * dt
            old = min(s.levels[i], k)
            new = min(target, old + step) if target > old else max(target, old - step)
            s.levels[i] = new
            for m in range(i, last + 1):
                rates[m] = max(0.0, flow + (new - old) / dt) * co.S[m] / co.S[last]
            fills[i] = new / k
        used = solver.memory(procs, s.levels, fused, alloc.threads)
        if used > limit:
            s.oom = True
            return self._dead_observation(cpus, limit, used=int(used))
        s.last_x = x
        noisy = self._noisy
        fusable = rule.fusable(fused)
        remotable = rm.remotable()
        threadable = self._threads.threadable(fused)
        stages = []
        for i, sm in enumerate(wl.stages):
            # Live, a fused stage's time is its own share of its host's workers' wall time
            # and the group's waits are its host's (telemetry.py).
            idle = 0.0
            if not fused[i]:
                idle = max(0.0, 1.0 - sum(ss.busy[i : rule.last(i, fused) + 1]))
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
                    cpu_s_per_item=noisy(c_seen[i] * sm.ratio),
                    hop_s_per_item=0.0 if fused[i] else self._hop_out(i, fused, w_threads, w_local),
                    io_bound=waits_on_io(c[i], c[i] + dl[i]),  # per item: CPU, CPU + wait
                    concurrency=calls[i],
                    max_concurrency=sm.max_concurrency,
                    memory_bytes=solver.stage_memory(procs, i, fused),
                    fused=fused[i],
                    fusable=fusable[i],
                    remote_workers=remote[i],
                    remotable=remotable[i],
                    threads=threads[i],
                    threadable=threadable[i],
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
                s.levels[i] / (x * co.S[rule.last(i, fused)]) for i in range(n) if not fused[i]
            )
            latency += sum(co.R[i] * (cb[i] / ss.phi + db[i]) for i in range(n))
        obs = self._observation(tuple(stages), noisy(x), cpus, limit, int(used), cluster, latency)
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
        return ss.throughput if ss.memory_bytes <= value_at(self._mem, at) else 0.0

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
        rm = self._remote
        asked = rm.asked(a, fused, self._s.alloc)
        if (why := rm.error(asked, fused)) is not None:
            raise ValueError(f"SimPipeline.steady_state: {why}")
        at = self._when(t)
        c, d = self._coef.costs(at, fused)
        d = overlapped(c, d, self._concurrency(a, fused))
        cpus = value_at(self._cpus, at) if cpus is None else float(cpus)
        cluster = value_at(self._cluster, at) if cluster_cpus is None else float(cluster_cpus)
        running = running_workers(a.replace(fused=fused))
        local = rm.local(asked, running)
        remote = rm.running(asked, running, cluster)
        threads = self._threads.asked(a, fused, local, *self._kinds_now())
        return self._threads.solve(local, threads, remote, a.buffer_bytes, c, d, cpus, fused)[0]

    def upper_bound(self, cpus: float | None = None, t: float | None = None) -> float:
        """Throughput no allocation can beat now (or at ``t``): all CPU work on ``cpus`` cores,
        or the consumer.

        Every item's CPU cost must be paid, so ``cpus / sum_i R_i c_i`` bounds any allocation,
        with every stage that may be fused fused (the fewest hops).
        """
        at = self._when(t)
        co = self._coef
        c, _ = co.costs(at, self._rule.widest())
        cpus = value_at(self._cpus, at) if cpus is None else float(cpus)
        return min(co.xc, cpus / sum(co.R[i] * c[i] for i in range(self.n_stages)))

    def fusable(self, fused: Sequence[bool] | None = None) -> tuple[bool, ...]:
        """Per stage, whether it may be fused into the stage before it, given the stages fused
        in ``fused`` (default: now); a fused stage is fusable. The live rule
        (``multiproc.fusion``): a fusable ``"map"`` after a ``"source"`` or ``"map"``, at most
        ``MAX_FUSED`` stages run in one host's workers."""
        return self._rule.fusable(self._s.fused if fused is None else fused)

    def widest_fusion(self) -> tuple[bool, ...]:
        """Every stage that may be fused fused, in pipeline order (the fewest hops)."""
        return self._rule.widest()

    def remotable(self) -> tuple[bool, ...]:
        """Per stage, whether its workers may run on the cluster (``StageStats.remotable``): a
        remotable map; only while it is neither fused nor hosting a fused stage."""
        return self._remote.remotable()

    def threadable(self) -> tuple[bool, ...]:
        """Per stage, whether its local workers may move between processes and threads now
        (``StageStats.threadable``): a threadable stage, while it is not fused."""
        return self._threads.threadable(self._s.fused)

    def _when(self, t: float | None) -> float:
        return self._s.t if t is None else float(t)

    def reset(self, seed: int | None = None) -> None:
        """Back to time 0 with the initial allocation, empty buffers, no OOM, and a kind rule
        that has measured nothing."""
        if seed is not None:
            self.seed = seed
        self._rng = random.Random(self.seed)
        self._kinds = KindRule(threads_first=not self.workload.gil)
        init = self._initial
        fused = init.fused or (False,) * self.n_stages
        running = running_workers(init.replace(fused=fused))
        remote = tuple(
            min(r, w) for r, w in zip(init.remote or (0,) * len(running), running, strict=True)
        )
        if init.threads:  # of any stage: how a stage that runs threads only is modelled
            local = local_workers(init.replace(fused=fused))
            threads = tuple(min(t, w) for t, w in zip(init.threads, local, strict=True))
            init = init.replace(threads=threads if any(threads) else ())
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
        return value_at(self._cpus, t)

    def cluster_cpus_at(self, t: float) -> float:
        """Cluster CPUs the schedule gives at time ``t``."""
        return value_at(self._cluster, t)

    def memory_limit_at(self, t: float) -> int:
        """Memory limit the schedule gives at time ``t``."""
        return int(value_at(self._mem, t))

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
            if f and (why := self._rule.error(j, a.fused)) is not None:
                raise ValueError(f"SimPipeline.apply: cannot fuse stage {st[j].name!r}: {why}")
        w = tuple(min(st[i].max_workers, max(st[i].min_workers, a.workers[i])) for i in range(n))
        b = tuple(max(0, x) for x in a.buffer_bytes)
        return (
            a if (w == a.workers and b == a.buffer_bytes) else a.replace(workers=w, buffer_bytes=b)
        )

    def _kinds_now(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The thread workers per stage now and the local workers they are among."""
        now = self._s.alloc
        return now.threads, local_workers(now)

    def _hop_out(
        self, i: int, fused: Sequence[bool], threads: Sequence[float], local: Sequence[float]
    ) -> float:
        """Seconds per item stage ``i`` emits that its group's output pays to cross its
        channel (the host reports it, as live: its workers encode the group's output). The
        group's last stage's thread workers hand theirs to the consumer as objects: no hop
        (:meth:`~torchtune_pipe.sim.threads.ThreadModel.handed_over`)."""
        co, last = self._coef, self._rule.last(i, fused)
        st = self.workload.stages[last]
        hop = co.c_out[last] * st.ratio * co.S[last] / co.S[i]
        if last == self.n_stages - 1:
            hop *= 1.0 - self._threads.handed_share(local, threads, fused)
        return hop

    def _concurrency(self, a: Allocation, fused: Sequence[bool] = ()) -> tuple[int, ...]:
        st = self.workload.stages
        if not a.concurrency:
            return (1,) * self.n_stages
        # A fused stage's function runs one call at a time in its host's worker.
        return tuple(
            1 if fused and fused[i] else max(1, min(k, s.max_concurrency))
            for i, (k, s) in enumerate(zip(a.concurrency, st, strict=True))
        )

    def _dead_observation(self, cpus: float, limit: int, used: int | None = None) -> Observation:
        """The observation of a pipeline that ran out of memory: no throughput."""
        s, wl = self._s, self.workload
        running = running_workers(s.alloc.replace(fused=s.fused))
        remote = s.alloc.remote or (0,) * len(running)
        threads = s.alloc.threads or (0,) * len(running)
        procs = [w - min(r, w) - t for w, r, t in zip(running, remote, threads, strict=True)]
        fusable = self._rule.fusable(s.fused)
        remotable = self._remote.remotable()
        threadable = self._threads.threadable(s.fused)
        stage_memory = self._solver.stage_memory
        stages = tuple(
            StageStats(
                name=sm.name,
                workers=running[i],
                min_workers=sm.min_workers,
                max_workers=sm.max_workers,
                buffer_bytes=s.alloc.buffer_bytes[i],
                memory_bytes=stage_memory(procs, i, s.fused),
                fused=s.fused[i],
                fusable=fusable[i],
                remote_workers=min(remote[i], running[i]),
                remotable=remotable[i],
                threads=threads[i],
                threadable=threadable[i],
                bytes_per_item=float(sm.bytes_per_item),
                items_per_call=float(sm.items_per_call),
            )
            for i, sm in enumerate(wl.stages)
        )
        if used is None:
            used = int(self._solver.memory(procs, s.levels, s.fused, s.alloc.threads))
        cluster = self.cluster_cpus_at(s.t)
        return self._observation(stages, 0.0, cpus, limit, used, cluster, oom=True)

    def _observation(
        self,
        stages: tuple[StageStats, ...],
        throughput: float,
        cpus: float,
        limit: int,
        used: int,
        cluster: float,
        latency_s: float = 0.0,
        oom: bool = False,
    ) -> Observation:
        """The observation now of ``stages``, with the fields the workload fixes."""
        wl = self.workload
        return Observation(
            stages=stages,
            throughput=throughput,
            cpus=cpus,
            memory_limit_bytes=limit,
            memory_used_bytes=used,
            latency_s=latency_s,
            consumer_step_s=wl.consumer_step_s,
            dram_gbps=wl.dram_gbps,
            cpu_ghz=wl.cpu_ghz,
            t=self._s.t,
            oom=oom,
            cluster_cpus=cluster,
            network_bytes_per_s=wl.network_bytes_per_s,
            rpc_s=wl.rpc_s,
        )

    def _noisy(self, v: float) -> float:
        if self.noise <= 0 or v <= 0:
            return v
        return max(0.0, v * (1.0 + self.noise * self._rng.gauss(0.0, 1.0)))
