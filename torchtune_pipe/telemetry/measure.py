"""Telemetry: executor counters turned into rates, plus the machine facts a tuner needs.

:func:`observe` turns two executor snapshots into an
:class:`~torchtune_pipe.tuning.base.Observation`; :class:`Meter` keeps the previous snapshot
for one reader (a tuner and a progress display each hold their own, so neither shortens the
other's interval). Machine facts: free CPUs (affinity and cgroup v2 ``cpu.max``, whichever is
smaller), available memory (psutil and the memory cgroup), DRAM copy bandwidth (measured
once, cached on disk) and CPU clock. The pipeline's own memory (its processes, arenas and
prefetched copies) comes from :class:`torchtune_pipe.telemetry.memory.MemoryProbe`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from multiproc import Snapshot
from torchtune_pipe.remote.stats import network, placement_stats
from torchtune_pipe.telemetry import memory as _memory
from torchtune_pipe.tuning.base import Observation, StageStats, fusion_host, waits_on_io

log = logging.getLogger(__name__)

_CGROUP = Path("/sys/fs/cgroup")
# Workers report their run-queue delay where the kernel exports it (multiproc.worker).
_RUNQUEUE = os.path.exists("/proc/thread-self/schedstat")


# ---------------------------------------------------------------------------- machine facts
def cpus_available(cgroup: Path = _CGROUP) -> float:
    """CPUs this process may use: its affinity mask and the cgroup v2 quota, whichever is
    smaller (a quota of 150000/100000 is 1.5 CPUs)."""
    try:
        n = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        n = float(os.cpu_count() or 1)
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return n


def memory_available_bytes(cgroup: Path = _CGROUP) -> int:
    """Memory that can still be allocated: psutil's ``available``, capped by what the memory
    cgroup's limit leaves (v2 ``memory.max``/``memory.high`` or v1, see
    :func:`torchtune_pipe.telemetry.memory.cgroup_memory`; ``cgroup`` is where cgroups are mounted)."""
    return _memory.memory_available_bytes(cgroup)


def resident_bytes(pids: Iterable[int]) -> int:
    """Memory of the given processes, summed (:func:`torchtune_pipe.telemetry.memory.process_bytes`:
    proportional set size less shared-memory mappings); gone processes count zero."""
    return sum(_memory.process_bytes(pid) or 0 for pid in set(pids) if pid > 0)


def cpu_ghz() -> float:
    """Current CPU clock in GHz (0.0 when the platform does not say)."""
    try:
        freq = psutil.cpu_freq()
    except (OSError, NotImplementedError, FileNotFoundError):
        freq = None
    if freq and freq.current:
        return float(freq.current) / 1000.0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1000.0
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchtune_pipe"


def measure_dram_gbps(size_bytes: int = 64 << 20, repeats: int = 5) -> float:
    """DRAM copy bandwidth in GB/s: the best of ``repeats`` numpy copies of ``size_bytes``
    (read + write bytes counted, as STREAM's copy does)."""
    import numpy as np

    src = np.ones(size_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * size_bytes / best / 1e9


def dram_gbps(
    cache_dir: Path | None = None, measure: Callable[[], float] = measure_dram_gbps
) -> float:
    """DRAM copy bandwidth, measured on first use and cached per host in ``cache_dir``
    (default ``~/.cache/torchtune_pipe/dram.json``); 0.0 if it cannot be measured."""
    path = (cache_dir or _cache_dir()) / "dram.json"
    host = os.uname().nodename
    try:
        cached = json.loads(path.read_text())
        if cached.get("host") == host:
            return float(cached["gbps"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        gbps = float(measure())
    except (MemoryError, ValueError) as e:
        log.warning("could not measure DRAM bandwidth: %s", e)
        return 0.0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"host": host, "gbps": gbps}))
        tmp.replace(path)  # atomic: concurrent processes never read half a file
    except OSError as e:
        log.debug("could not cache DRAM bandwidth in %s: %s", path, e)
    return gbps


@dataclass(frozen=True)
class Machine:
    """Facts about the machine, as one value.

    Attributes:
        cpus: CPUs available (see :func:`cpus_available`).
        memory_available_bytes: memory that can still be allocated.
        dram_gbps: DRAM copy bandwidth (0.0 if unknown).
        cpu_ghz: CPU clock (0.0 if unknown).
    """

    cpus: float
    memory_available_bytes: int
    dram_gbps: float = 0.0
    cpu_ghz: float = 0.0

    @classmethod
    def probe(cls, measure_dram: bool = True) -> Machine:
        """Read every fact now (the DRAM bandwidth comes from the on-disk cache after the
        first measurement)."""
        return cls(
            cpus_available(),
            memory_available_bytes(),
            dram_gbps() if measure_dram else 0.0,
            cpu_ghz(),
        )


# ---------------------------------------------------------------------------- rates
@dataclass(frozen=True)
class Bounds:
    """The worker and concurrency bounds of one stage (from its spec), and whether its
    workers may move between processes and threads (``worker_type="auto"``)."""

    min_workers: int = 1
    max_workers: int = 1 << 16
    max_concurrency: int = 1
    threadable: bool | Callable[[], bool] = False  # a callable is asked at each observation


def observe(
    prev: Snapshot,
    cur: Snapshot,
    machine: Machine,
    *,
    bounds: Sequence[Bounds] = (),
    memory_limit_bytes: int | None = None,
    consumer_items: tuple[int, int] | None = None,
    consumer_step_s: float = 0.0,
    t: float = 0.0,
    memory: _memory.MemoryReading | None = None,
    memory_before: _memory.MemoryReading | None = None,
    cluster_cpus: float = 0.0,
    consumer_cpus: float = 0.0,
    data_wait_share: float | None = None,
) -> Observation:
    """Turn two snapshots into an :class:`Observation` of the interval between them.

    Memory has the meaning :class:`Observation` defines: with a ``memory`` reading the
    pipeline's buffers, processes and prefetched copies; without one (no probe), only what
    the buffers hold.

    Args:
        prev, cur: executor snapshots, ``prev`` taken first.
        machine: machine facts (CPUs, memory, bandwidth, clock).
        bounds: per-stage worker bounds, in pipeline order (default: 1 and unbounded).
        memory_limit_bytes: memory the pipeline may use (default: what it uses plus what the
            machine and its cgroup leave available, ``machine.memory_available_bytes``).
        consumer_items: items the consumer took at ``prev`` and at ``cur``; throughput is
            measured from them (default: outputs the executor delivered, which count a
            pipeline's bookkeeping outputs too: the loader always passes its own count).
        consumer_step_s: the consumer's mean time between ``next()`` calls.
        t: seconds since the pipeline started.
        memory, memory_before: the pipeline's memory read at (about) ``cur`` and at ``prev``
            (:class:`~torchtune_pipe.telemetry.memory.MemoryProbe`); a worker death between them while
            the cgroup's OOM-kill count grew is an OOM.
        cluster_cpus: CPUs the cluster of the pipeline's remote stages offers (0: none).
        consumer_cpus: cores the consumer's process used besides the stages
            (:attr:`Observation.consumer_cpus`; :class:`Meter` measures it).
        data_wait_share: the share of the consumer's time it waited for items
            (:attr:`Observation.data_wait_share`; :class:`Meter` measures it).

    A stage whose ``placement`` is not ``"local"`` (``placement="ray"``) runs every worker
    remote: ``remote_workers`` is its workers, ``remote_items_per_s`` its items, and
    ``net_s_per_item`` its calls' wall time beyond the function's own on the actor, per item
    (the round trips and the bytes' time, as the workers book each call). A
    ``placement="auto"`` stage connected to Ray is ``remotable``: the same fields from its
    offload workers' own counters (0 while none runs remote). ``bytes_per_item`` is what the
    stage's outputs measured (0 where they were not), ``items_per_call`` its items per frame.
    ``rpc_s`` and
    ``network_bytes_per_s`` are fitted to the interval's remote calls (a line of each call's
    wait beyond its function's time over its bytes, :func:`~torchtune_pipe.remote.stats.network`); 0 without any.
    """
    dt_ns = max(1, cur.t_ns - prev.t_ns)
    dt = dt_ns / 1e9
    before = {s.name: s for s in prev.stages}
    stages = []
    fused = tuple(s.fused for s in cur.stages)
    runq = _runqueue_shares(cur, before, fused)
    for i, s in enumerate(cur.stages):
        p = before.get(s.name)

        def d(attr: str, s=s, p=p) -> int:
            return getattr(s, attr) - (getattr(p, attr) if p is not None else 0)

        # A fused stage's time is a share of the workers that run it.
        capacity = dt_ns * max(1, cur.stages[fusion_host(fused, i)].workers)
        out = d("items_out")
        ran_ns = max(0, d("busy_ns"))
        # Workers time their whole stage call, which includes waiting for output space: count
        # that wait as blocked_out only (busy + blocked_in + blocked_out <= 1, as the simulator
        # reports them), or a stage held back by a full buffer looks like it needs workers.
        blocked_out_ns = max(0, d("blocked_out_ns"))
        busy_ns = max(0, ran_ns - blocked_out_ns)
        cpu_ns = max(0, d("cpu_ns"))
        runq_ns = runq[i]
        b = bounds[i] if i < len(bounds) else Bounds()
        stages.append(
            StageStats(
                name=s.name,
                workers=s.workers,
                min_workers=b.min_workers,
                max_workers=b.max_workers,
                items_per_s=max(0, out) / dt,
                busy=min(1.0, busy_ns / capacity),
                blocked_in=min(1.0, max(0, d("blocked_in_ns")) / capacity),
                blocked_out=min(1.0, blocked_out_ns / capacity),
                buffer_bytes=s.buffer_budget_bytes,
                buffer_fill=min(1.0, s.buffer_used_bytes / max(1, s.buffer_budget_bytes)),
                cpu_s_per_item=cpu_ns / 1e9 / out if out > 0 else 0.0,
                hop_s_per_item=max(0, d("hop_ns")) / 1e9 / out if out > 0 else 0.0,
                # Runnable but waiting for a CPU is not waiting on I/O (as in the simulator:
                # a stage's CPU against its CPU and I/O wait): on a busy machine it would
                # make every stage look I/O-bound, and keep cheap stages from being fused.
                io_bound=waits_on_io(cpu_ns, max(0, busy_ns - runq_ns)),
                idle=out <= 0 and ran_ns == 0 and s.items_out > 0,
                items_in_per_s=max(0, d("items_in")) / dt,
                runqueue=min(1.0, runq_ns / capacity) if _RUNQUEUE else None,
                concurrency=s.concurrency,
                max_concurrency=b.max_concurrency,
                memory_bytes=memory.stage_bytes.get(s.name, 0) if memory is not None else 0,
                fused=s.fused,
                fusable=s.fusable,
                threads=s.threads,
                threadable=not s.fused
                and (b.threadable() if callable(b.threadable) else b.threadable),
                **placement_stats(s, p, out, dt),
            )
        )
    if consumer_items is not None:
        delivered = consumer_items[1] - consumer_items[0]
    else:
        delivered = cur.delivered_items - prev.delivered_items
    used = sum(s.buffer_used_bytes for s in cur.stages)
    if memory is not None:
        used = memory.used_bytes
    if memory_limit_bytes is None:
        memory_limit_bytes = used + machine.memory_available_bytes
    rpc_s, bandwidth = network(cur, before)
    return Observation(
        stages=tuple(stages),
        throughput=max(0, delivered) / dt,
        cpus=machine.cpus,
        memory_limit_bytes=int(memory_limit_bytes),
        memory_used_bytes=int(used),
        consumer_step_s=consumer_step_s,
        dram_gbps=machine.dram_gbps,
        cpu_ghz=machine.cpu_ghz,
        t=t,
        oom=used > memory_limit_bytes or _killed_for_memory(prev, cur, memory_before, memory),
        cluster_cpus=cluster_cpus,
        rpc_s=rpc_s,
        network_bytes_per_s=bandwidth,
        consumer_cpus=consumer_cpus,
        data_wait_share=data_wait_share,
    )


def _runqueue_shares(cur: Snapshot, before: dict, fused: tuple[bool, ...]) -> list[int]:
    """Each stage's run-queue delay over the interval (ns). A worker reads its thread's delay
    into its host stage's row, so a fused group's is shared among its stages in proportion to
    the time each stage's function ran."""
    n = len(cur.stages)

    def d(i: int, attr: str) -> int:
        s, p = cur.stages[i], before.get(cur.stages[i].name)
        return max(0, getattr(s, attr) - (getattr(p, attr) if p is not None else 0))

    busy = [d(i, "busy_ns") for i in range(n)]
    out = [d(i, "runq_ns") if not fused[i] else 0 for i in range(n)]
    for h in range(n):
        if fused[h]:
            continue
        group = [h] + [j for j in range(h + 1, n) if fusion_host(fused, j) == h]
        total = sum(busy[j] for j in group)
        if len(group) > 1 and total > 0:
            q = out[h]
            for j in group:
                out[j] = q * busy[j] // total
    return out


def _killed_for_memory(
    prev: Snapshot,
    cur: Snapshot,
    before: _memory.MemoryReading | None,
    now: _memory.MemoryReading | None,
) -> bool:
    """A worker died between the snapshots while the kernel's OOM killer acted in the cgroup.

    The executor's snapshot counts deaths (``restarts``) but not their signals, so a SIGKILL
    from elsewhere cannot be told from an OOM kill; the cgroup's ``oom_kill`` count can.
    """
    if before is None or now is None or before.oom_kills is None or now.oom_kills is None:
        return False
    died = sum(s.restarts for s in cur.stages) > sum(s.restarts for s in prev.stages)
    return died and now.oom_kills > before.oom_kills


class ConsumerClock:
    """Times the consumer: how long it spends between two ``next()`` calls (the model step),
    and how long inside ``next()`` waiting for the pipeline's next item.

    The loader calls :meth:`asked` when ``next()`` arrives and :meth:`took` when it hands an
    item over; the gap from a hand-over to the next ask is the consumer's step time (an
    exponential moving average, ``alpha`` weighting the newest step), the gap from an ask to
    the hand-over its wait for data. :meth:`totals` sums both since the start (a span still
    open counts up to now), for the share of an interval the consumer waited.

    Single writer (the consumer's thread); readers take the sums without a lock.
    """

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.items = 0
        self.step_s = 0.0
        self._handed_at: float | None = None
        self._asked_at: float | None = None
        self._waited_s = 0.0
        self._stepped_s = 0.0

    def asked(self) -> None:
        """``next()`` was called."""
        now = time.perf_counter()
        if self._handed_at is not None:
            gap = now - self._handed_at
            self._stepped_s += gap
            self.step_s = (
                gap if self.items <= 1 else self.alpha * gap + (1 - self.alpha) * self.step_s
            )
            self._handed_at = None
        self._asked_at = now

    def took(self) -> None:
        """An item was handed to the consumer."""
        now = time.perf_counter()
        if self._asked_at is not None:
            self._waited_s += now - self._asked_at
            self._asked_at = None
        self.items += 1
        self._handed_at = now

    def pause(self) -> None:
        """The consumer stopped iterating (end of epoch): the next gap is not a step, and a
        wait still open (for the epoch's end) ends here."""
        if self._asked_at is not None:
            self._waited_s += time.perf_counter() - self._asked_at
            self._asked_at = None
        self._handed_at = None

    def totals(self) -> tuple[float, float]:
        """``(waited_s, stepped_s)``: seconds the consumer has spent inside ``next()`` waiting
        for items, and between items (its steps), the span open now counted up to now."""
        now = time.perf_counter()
        asked, handed = self._asked_at, self._handed_at
        waited, stepped = self._waited_s, self._stepped_s
        if asked is not None:
            waited += max(0.0, now - asked)
        elif handed is not None:
            stepped += max(0.0, now - handed)
        return waited, stepped


def wait_share(before: tuple[float, float], now: tuple[float, float]) -> float | None:
    """The share of the consumer's time between two :meth:`ConsumerClock.totals` spent
    waiting for data (None: it neither waited nor stepped, e.g. between epochs)."""
    waited = max(0.0, now[0] - before[0])
    total = waited + max(0.0, now[1] - before[1])
    return waited / total if total > 0 else None


class Meter:
    """One reader's view of a running executor: each :meth:`observe` covers the time since
    the previous one.

    Args:
        snapshot: returns the executor's current snapshot.
        machine: returns machine facts (called at every observation; cheap except the first).
        bounds: per-stage worker bounds.
        clock: the consumer clock (for throughput and step time), optional.
        memory_limit_bytes: memory the pipeline may use (None: see :func:`observe`).
        memory: reads the pipeline's memory (the snapshots must then list the workers:
            ``Executor.snapshot(per_worker=True)``); None: only the buffers are counted.
        cluster: returns the CPUs the cluster of the pipeline's remote stages offers (None:
            no remote stage, 0).
        in_process: names of the stages whose workers are all threads of this process (thread
            and Ray stages): their CPU is the stages', not the consumer's
            (:attr:`Observation.consumer_cpus`); so is the CPU of the thread workers of any
            other stage (``StageSnapshot.thread_cpu_ns``).
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        machine: Callable[[], Machine],
        bounds: Sequence[Bounds] = (),
        clock: ConsumerClock | None = None,
        memory_limit_bytes: int | None = None,
        memory: _memory.MemoryProbe | None = None,
        cluster: Callable[[], float] | None = None,
        in_process: Sequence[str] = (),
    ):
        self._snapshot = snapshot
        self.in_process = frozenset(in_process)
        self.cluster = cluster
        self._machine = machine
        self.bounds = tuple(bounds)
        self.clock = clock
        self.memory_limit_bytes = memory_limit_bytes
        self.memory = memory
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._prev = snapshot()
        self._prev_memory = memory.read(self._prev) if memory is not None else None
        self._prev_items = clock.items if clock is not None else 0
        self._prev_totals = clock.totals() if clock is not None else (0.0, 0.0)
        self._prev_cpu_s = time.process_time()
        self.last: Observation | None = None
        self.last_snapshot: Snapshot = self._prev

    def observe(self, read_memory: bool = True) -> Observation:
        """An observation of the interval since the previous call (or since creation).
        ``read_memory=False``: the memory as last read (at the previous call, or at creation),
        not read again (a read walks every process's page tables)."""
        with self._lock:
            cur = self._snapshot()
            cpu_s = time.process_time()
            reading = self._prev_memory
            if self.memory is not None and read_memory:
                reading = self.memory.read(cur)
            items = self.clock.items if self.clock is not None else None
            totals = self.clock.totals() if self.clock is not None else None
            obs = observe(
                self._prev,
                cur,
                self._machine(),
                bounds=self.bounds,
                memory_limit_bytes=self.memory_limit_bytes,
                consumer_items=None if items is None else (self._prev_items, items),
                consumer_step_s=self.clock.step_s if self.clock is not None else 0.0,
                t=time.perf_counter() - self._start,
                memory=reading,
                memory_before=self._prev_memory,
                cluster_cpus=self.cluster() if self.cluster is not None else 0.0,
                consumer_cpus=self._consumer_cpus(self._prev, cur, cpu_s - self._prev_cpu_s),
                data_wait_share=None if totals is None else wait_share(self._prev_totals, totals),
            )
            self._prev, self._prev_items, self._prev_memory = cur, items or 0, reading
            self._prev_totals = totals or (0.0, 0.0)
            self._prev_cpu_s = cpu_s
            self.last, self.last_snapshot = obs, cur
            return obs

    def _consumer_cpus(self, prev: Snapshot, cur: Snapshot, cpu_s: float) -> float:
        """Cores this process used between the snapshots besides its thread workers."""
        dt = max(1, cur.t_ns - prev.t_ns) / 1e9
        before = {s.name: s for s in prev.stages}
        stages_ns = 0
        for s in cur.stages:
            p = before.get(s.name)
            if s.name in self.in_process:
                stages_ns += max(0, s.cpu_ns - (p.cpu_ns if p is not None else 0))
            else:
                stages_ns += max(0, s.thread_cpu_ns - (p.thread_cpu_ns if p is not None else 0))
        return max(0.0, cpu_s - stages_ns / 1e9) / dt
