"""What the InTune agent can do: its actions, their masks, and how allocations carry over.

See :mod:`torchtune_pipe.tuning.intune` for the action set and the masking rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Allocation, MiB, Observation, StageStats, fusion_host, memory_parts
from .calls_in_flight import settled_concurrency
from .cluster import local_total, remote_of
from .planner import Plan, cpu_saturated
from .safety import MEMORY_SAFE_SHARE, is_io_bound, oversubscribe_factor

WORKER_DELTAS = (1, -1, 5, -5)
ACTIONS_PER_STAGE = len(WORKER_DELTAS) + 2
# Buffer bytes per stage that fit_memory keeps while it can remove workers instead.
KEEP_BUFFER_BYTES = 64 * MiB
# A stage gains workers by a small move only when its workers compute at least this share of
# the time (or wait on I/O): the others wait on their neighbours, and more of them wait too.
GROW_MIN_BUSY = 0.5


@dataclass(frozen=True)
class Action:
    """One decoded action: ``stage`` None is the no-op."""

    stage: int | None
    workers: int = 0
    buffer: int = 0
    plan: bool = False


def _buffer_step(b: int, up: bool) -> int:
    if up:
        return max(MiB, round(b * 1.5 / MiB) * MiB, b + MiB)
    return max(MiB, min(b - MiB, round(b / 1.5 / MiB) * MiB))


class ActionSpace:
    """The discrete actions of an ``n_stages`` pipeline, their masks and their effect."""

    def __init__(self, n_stages: int) -> None:
        if n_stages < 1:
            raise ValueError(f"ActionSpace: n_stages must be >= 1, got {n_stages}")
        self.n_stages = n_stages
        self.n = 2 + ACTIONS_PER_STAGE * n_stages
        self.plan_index = self.n - 1

    def worker_moves(self) -> torch.Tensor:
        """Bool mask of the actions that change workers: every stage's worker deltas and the
        plan."""
        moves = torch.zeros(self.n, dtype=torch.bool)
        for i in range(self.n_stages):
            base = 1 + ACTIONS_PER_STAGE * i
            moves[base : base + len(WORKER_DELTAS)] = True
        moves[self.plan_index] = True
        return moves

    def decode(self, index: int) -> Action:
        """The action with number ``index`` (0 is the no-op)."""
        if not 0 <= index < self.n:
            raise ValueError(f"ActionSpace.decode: index must be in [0, {self.n}), got {index}")
        if index == 0:
            return Action(None)
        if index == self.plan_index:
            return Action(None, plan=True)
        stage, k = divmod(index - 1, ACTIONS_PER_STAGE)
        if k < len(WORKER_DELTAS):
            return Action(stage, workers=WORKER_DELTAS[k])
        return Action(stage, buffer=1 if k == len(WORKER_DELTAS) else -1)

    def apply(
        self,
        alloc: Allocation,
        index: int,
        obs: Observation | None = None,
        planned: Plan | None = None,
    ) -> Allocation:
        """The allocation after taking action ``index``.

        The plan action takes the workers of ``planned`` (no change without one). With
        ``obs``, a worker increase that does not fit in the CPU budget takes the missing workers
        from the other stages with the most idle workers (:func:`idlest_donor`), one at a time,
        and only from stages less busy than the one growing: growing a stage on a full machine
        is a move, not an overdraft, and a move from a busier stage to an idler one cannot
        raise throughput (it is masked).
        """
        act = self.decode(index)
        if act.plan:
            return (
                alloc
                if planned is None
                else planned.allocation.replace(buffer_bytes=alloc.buffer_bytes)
            )
        if act.stage is None:
            return alloc
        workers, buffers = list(alloc.workers), list(alloc.buffer_bytes)
        # A stage fused now runs no workers of its own: an unmasked removal leaves it at 0.
        workers[act.stage] = max(0, workers[act.stage] + act.workers)
        if act.buffer:
            buffers[act.stage] = _buffer_step(buffers[act.stage], act.buffer > 0)
        if obs is not None and act.workers > 0:
            need = sum(workers) - cpu_cap(
                obs, alloc.replace(workers=tuple(workers), buffer_bytes=tuple(buffers))
            )
            below = group_busy(obs)[act.stage]
            for _ in range(max(0, need)):
                j = idlest_donor(workers, obs, keep=act.stage, below=below)
                if j is None:
                    break
                workers[j] -= 1
        # The stages keep the shape they run in (only the plan changes fusion).
        return alloc.replace(workers=tuple(workers), buffer_bytes=tuple(buffers))

    def mask(
        self,
        obs: Observation,
        alloc: Allocation,
        memory: MemoryModel | None = None,
        planned: Plan | None = None,
    ) -> torch.Tensor:
        """Bool mask of the actions that keep ``alloc`` within every hard limit.

        The plan action is open when ``planned`` changes the workers or which stages run
        fused (the planner already kept the plan within the CPU and memory budgets). A stage
        whose workers run flat out (:func:`working_flat_out`) loses none but for memory.
        """
        mask = torch.zeros(self.n, dtype=torch.bool)
        mask[0] = True
        mask[self.plan_index] = planned is not None and changes_workers(alloc, planned.allocation)
        total_w = local_total(alloc, obs)  # a remote worker holds no memory on the host
        limit = obs.memory_limit_bytes * MEMORY_SAFE_SHARE
        per_worker, fixed = (memory or MemoryModel()).split(obs)
        worst = sum(alloc.buffer_bytes) + fixed + per_worker * total_w
        over_memory = worst > limit
        # When the consumer (the model) is the bottleneck every buffer fills, and a larger
        # one only holds more waiting items: no buffer may grow then.
        consumer_bound = obs.consumer_step_s * obs.throughput >= CONSUMER_BOUND
        # Workers that queue for a CPU: another process would take its CPU from them (the
        # plan's budget, planner.cpu_saturated); workers only move or go.
        saturated = cpu_saturated(obs)
        flat_out = working_flat_out(obs)
        for i, st in enumerate(obs.stages):
            base = 1 + ACTIONS_PER_STAGE * i
            if st.fused:
                continue  # no workers and no buffer of its own: nothing to move
            w, b = alloc.workers[i], alloc.buffer_bytes[i]
            for k, dw in enumerate(WORKER_DELTAS):
                if dw < 0:
                    keep = flat_out[i] and not over_memory
                    mask[base + k] = w + dw >= max(1, st.min_workers) and not keep
                elif not over_memory and w + dw <= st.max_workers and can_use_workers(st):
                    new = self.apply(alloc, base + k, obs)
                    grown = local_total(new, obs) - total_w
                    if saturated and grown > 0:
                        continue
                    fits_mem = worst + per_worker * grown <= limit
                    fits_cpu = grown <= 0 or sum(new.workers) <= cpu_cap(obs, new)
                    mask[base + k] = fits_mem and fits_cpu and new.workers[i] == w + dw
            up = _buffer_step(b, True)
            # More room only helps a buffer that fills: growing an idle one reserves memory
            # (the budget other stages and the model could use) for nothing.
            mask[base + 4] = (
                not over_memory
                and not consumer_bound
                and worst + (up - b) <= limit
                and st.buffer_fill >= BUFFER_GROW_MIN_FILL
            )
            # Below KEEP_BUFFER_BYTES a buffer shrinks only for memory or when every buffer
            # just holds items waiting for the model: a small buffer between two busy stages
            # makes them wait on each other, and the workers hold most of the memory anyway.
            mask[base + 5] = b > MiB and (over_memory or consumer_bound or b > KEEP_BUFFER_BYTES)
        return mask


# Workers busy at least this share of the time, less the time they waited for a CPU, work
# flat out: one fewer slows their stage by its share (unless for memory, none is removed).
FLAT_OUT_BUSY = 0.9


def group_busy(obs: Observation, less_runqueue: bool = False) -> list[float]:
    """Each stage's busy share, a stage that hosts fused stages busy for the whole group its
    workers run: its own share plus theirs (each a share of the host's workers), at most 1.
    ``less_runqueue``: less the time the workers waited for a CPU (where measured)."""
    fused = tuple(st.fused for st in obs.stages)
    busy = [st.busy - ((st.runqueue or 0.0) if less_runqueue else 0.0) for st in obs.stages]
    for j in range(len(busy)):
        h = fusion_host(fused, j)
        if h != j:
            busy[h] += busy[j]
    return [clip(b, 0.0, 1.0) for b in busy]


def working_flat_out(obs: Observation) -> list[bool]:
    """Which stages' workers run flat out (:data:`FLAT_OUT_BUSY`, by :func:`group_busy` less
    the run queue): two Criteo readers that spend a fifth of their time reading and the rest
    in a fused UDF work flat out, not as idle readers to take away."""
    return [b >= FLAT_OUT_BUSY for b in group_busy(obs, less_runqueue=True)]


# The consumer is the bottleneck when it is busy at least this share of the time.
CONSUMER_BOUND = 0.9
# A buffer may grow only when at least this share of it is in use.
BUFFER_GROW_MIN_FILL = 0.5


def changes_workers(old: Allocation, new: Allocation) -> bool:
    """Whether ``new`` runs other workers than ``old``: other counts, other stages fused, or
    other workers remote (``remote`` empty: as now)."""
    n = len(old.workers)
    if new.remote and (old.remote or (0,) * n) != new.remote:
        return True
    return old.workers != new.workers or (old.fused or (False,) * n) != (new.fused or (False,) * n)


def changes_processes(old: Allocation, new: Allocation) -> bool:
    """Whether ``new`` runs other worker processes than ``old``: other counts on the stages
    that run their own, other stages fused, or other workers remote. Unlike
    :func:`changes_workers`, a fused stage's count (only its target for when it is split
    again) does not count: the undo judges what ran, and a plan that only moves such a target
    ran the same processes (``fused`` empty: as in ``old``)."""
    n = len(old.workers)
    if new.remote and (old.remote or (0,) * n) != new.remote:
        return True
    was = old.fused or (False,) * n
    now = new.fused or was
    return was != now or [w for w, f in zip(old.workers, was, strict=True) if not f] != [
        w for w, f in zip(new.workers, now, strict=True) if not f
    ]


def can_use_workers(st: StageStats) -> bool:
    """Whether more workers could raise ``st``'s rate: it is not measured yet, its workers are
    busy at least ``GROW_MIN_BUSY`` of the time, or it waits on I/O. A stage whose workers
    mostly wait for input or for output space (or that had nothing to do) is held back by its
    neighbours; one whose calls in flight the concurrency rule is still raising waits for
    reads its threads are about to take (the plan keeps its workers too,
    :mod:`~.planner`)."""
    if st.idle or st.concurrency < settled_concurrency(st):
        return False
    if st.items_per_s <= 0.0:
        return True
    return st.busy >= GROW_MIN_BUSY or is_io_bound(st)


def cpu_cap(obs: Observation, alloc: Allocation) -> int:
    """Workers ``alloc`` may run in total: cores times the I/O oversubscription factor, plus
    its remote workers (they take the cluster's CPUs, not the host's: the guard keeps them
    within those)."""
    local = max(len(alloc.workers), int(obs.cpus * oversubscribe_factor(obs, alloc) + 0.5))
    return local + sum(remote_of(alloc, obs))


def idlest_donor(
    workers: list[int], obs: Observation, keep: int | None = None, below: float = math.inf
) -> int | None:
    """The stage that can best give up a worker: the most idle workers (``workers * (1 -
    busy)``, a stage hosting fused stages busy for its group, :func:`group_busy`) among
    stages above their minimum and busy less than ``below``, ``keep`` excepted; None when
    none can."""
    busy = group_busy(obs)
    donors = [
        j
        for j, st in enumerate(obs.stages)
        if j != keep and workers[j] > max(1, st.min_workers) and busy[j] < below
    ]
    if not donors:
        return None
    return max(donors, key=lambda j: workers[j] * (1.0 - busy[j]))


def rescale(alloc: Allocation, obs: Observation, old_cpus: float) -> Allocation:
    """Carry an allocation over to a new CPU count: scale every stage, then trim to the cap.

    Keeping the learned proportions means a resized machine starts near its new optimum; the
    agent then corrects the rest one action at a time. Trimming removes workers from the
    stages with the most idle workers first.
    """
    f = obs.cpus / max(old_cpus, 1e-9)
    workers = [
        w if st.fused else min(st.max_workers, max(max(1, st.min_workers), round(w * f)))
        for w, st in zip(alloc.workers, obs.stages, strict=True)
    ]  # a fused stage runs in its host's workers: it has none to rescale
    while sum(workers) > cpu_cap(obs, alloc.replace(workers=tuple(workers))):
        j = idlest_donor(workers, obs)
        if j is None:
            break
        workers[j] -= 1
    return alloc.replace(workers=tuple(workers))


class MemoryModel:
    """Memory outside the buffers, split into a per-worker cost and a fixed part.

    Fitted from two observations with different worker counts (a worker's memory is the
    slope; on a live pipeline ``memory_used_bytes`` counts every worker process, so the slope
    is what a worker really holds). Until then a worker costs the mean of what the workers
    hold where the observation measures it (``StageStats.memory_bytes``, read from every
    worker live, modelled in the simulator; :func:`~.base.memory_parts`), else everything
    outside the buffers spread over the workers; either overestimates what a new worker costs
    when a stage holds resident state: the safe side for OOM checks. Whatever a worker does
    not account for (the fork server, prefetched copies, memory grown since the fit) is the
    fixed part, so the worst case always starts from the memory measured now.
    """

    def __init__(self) -> None:
        self._last: tuple[int, float] | None = None
        self.slope: float | None = None

    @staticmethod
    def _other(obs: Observation) -> float:
        buffered = sum(s.buffer_bytes * s.buffer_fill for s in obs.stages)
        return max(0.0, obs.memory_used_bytes - buffered)

    def update(self, obs: Observation) -> None:
        """Refine the per-worker cost from a new observation."""
        if obs.oom:
            return
        w, other = _local_count(obs), self._other(obs)
        if self._last is not None and self._last[0] != w:
            slope = (other - self._last[1]) / (w - self._last[0])
            self.slope = clip(slope, 0.0, other / max(1, w))
        self._last = (w, other)

    def split(self, obs: Observation) -> tuple[float, float]:
        """(bytes per worker, fixed bytes) for ``obs``."""
        w, other = max(1, _local_count(obs)), self._other(obs)
        if self.slope is not None:
            per_worker = self.slope
        elif any(s.memory_bytes > 0 for s in obs.stages):
            parts = memory_parts(obs)
            local = [s.workers - s.remote_workers for s in obs.stages]
            held = sum(n * p for n, p in zip(local, parts.per_worker_bytes, strict=True))
            per_worker = held / w
        else:
            per_worker = other / w
        return per_worker, max(0.0, other - per_worker * w)

    def per_stage(self, obs: Observation) -> tuple[list[float], float]:
        """(bytes one more worker of each stage costs, fixed bytes): what each stage's workers
        hold where the observation measures it (``StageStats.memory_bytes``,
        :func:`~.base.memory_parts`), else :meth:`split`'s cost for every stage. A stage whose
        workers each build a cache costs what they hold, not the mean of every worker (nor a
        slope fitted across a change of what the workers hold, which read a 380 MiB cache
        moved from 15 workers to one as workers that cost nothing)."""
        if any(s.memory_bytes > 0 for s in obs.stages):
            parts = memory_parts(obs)
            return list(parts.per_worker_bytes), parts.fixed_bytes
        per_worker, fixed = self.split(obs)
        return [per_worker] * len(obs.stages), fixed


def _local_count(obs: Observation) -> int:
    """Workers that run on the host (a remote worker holds no memory there)."""
    return sum(obs.workers) - sum(obs.remote_workers)


def distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return float(sum(abs(x - y) for x, y in zip(a, b, strict=True)))


def clip(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def fit_memory(
    alloc: Allocation, obs: Observation, memory: MemoryModel | None = None, share: float = 1.0
) -> Allocation:
    """Shrink buffers, then the largest stages, until the worst case fits in memory.

    Buffers go down to ``KEEP_BUFFER_BYTES`` each before any worker goes (small buffers make
    neighbouring stages block each other, and where workers hold most of the memory they save
    little), then down to 1 MiB.
    """
    per_worker, fixed = (memory or MemoryModel()).split(obs)
    limit = obs.memory_limit_bytes * MEMORY_SAFE_SHARE * share
    workers, buffers = list(alloc.workers), list(alloc.buffer_bytes)
    remote = remote_of(alloc, obs)  # a remote worker holds no memory on the host

    def local() -> list[int]:
        return [w - min(r, w) for w, r in zip(workers, remote, strict=True)]

    while sum(buffers) + fixed + per_worker * sum(local()) > limit:
        if any(b > KEEP_BUFFER_BYTES for b in buffers):
            buffers = [max(KEEP_BUFFER_BYTES, b // 2) if b > KEEP_BUFFER_BYTES else b
                       for b in buffers]  # fmt: skip
        elif sum(local()) > len(workers) - sum(1 for r in remote if r) and per_worker > 0:
            i = max(range(len(workers)), key=local().__getitem__)
            workers[i] -= 1
        elif sum(buffers) > len(buffers) * MiB:
            buffers = [max(MiB, b // 2) for b in buffers]
        else:
            break
    return alloc.replace(workers=tuple(workers), buffer_bytes=tuple(buffers))
