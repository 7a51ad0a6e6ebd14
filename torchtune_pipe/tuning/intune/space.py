"""What the InTune agent can do: its actions, their masks, and how allocations carry over.

See :mod:`torchtune_pipe.tuning.intune.agent` for the action set and the masking rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from multiproc.spec import fused_depth
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats, fusion_host
from torchtune_pipe.tuning.calls_in_flight import settled_concurrency
from torchtune_pipe.tuning.cluster import local_total, remote_of
from torchtune_pipe.tuning.planner import HEADROOM, Plan
from torchtune_pipe.tuning.run_queue import cpu_saturated
from torchtune_pipe.tuning.safety import (
    LEAN_ITEMS,
    MEMORY_SAFE_SHARE,
    is_io_bound,
    memory_parts,
    oversubscribe_factor,
    take_bytes,
)

WORKER_DELTAS = (1, -1, 5, -5)
ACTIONS_PER_STAGE = len(WORKER_DELTAS) + 2
# Buffer bytes per stage the network shrinks a buffer below only for memory or for a waiting
# model (the mask).
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

        The plan action takes ``planned`` as it is, workers, fusion and buffers (no change
        without one). With
        ``obs``, a worker increase that does not fit in the CPU budget takes the missing workers
        from the other stages with the most idle workers (:func:`idlest_donor`), one at a time,
        and only from stages less busy than the one growing: growing a stage on a full machine
        is a move, not an overdraft, and a move from a busier stage to an idler one cannot
        raise throughput (it is masked).
        """
        act = self.decode(index)
        if act.plan:
            if planned is None:
                return alloc
            return planned.allocation  # its buffers too (planner.plan sizes them)
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
            below, least = group_busy(obs)[act.stage], least_workers(obs)
            for _ in range(max(0, need)):
                j = idlest_donor(workers, obs, keep=act.stage, below=below, least=least)
                if j is None:
                    break
                workers[j] -= 1
        # The stages keep the shape they run in (only the plan changes fusion).
        return alloc.replace(workers=tuple(workers), buffer_bytes=tuple(buffers))

    def mask(
        self,
        obs: Observation,
        alloc: Allocation,
        planned: Plan | None = None,
    ) -> torch.Tensor:
        """Bool mask of the actions that keep ``alloc`` within every hard limit.

        The plan action is open when ``planned`` changes the workers or which stages run
        fused (the planner already kept the plan within the CPU and memory budgets). A stage
        whose workers run flat out (:func:`working_flat_out`) loses none but for memory; nor
        does one go below ``HEADROOM`` times the workers' worth of work it does now (its busy
        share of those that ran) but for memory or while every core is taken
        (``CORES_FULL``).
        Memory is the guard's worst case (:meth:`~.safety.MemoryParts.worst_case_bytes`):
        a worker added to a stage costs what one of its workers holds now.
        """
        mask = torch.zeros(self.n, dtype=torch.bool)
        mask[0] = True
        mask[self.plan_index] = planned is not None and changes_workers(alloc, planned.allocation)
        total_w = local_total(alloc, obs)  # a remote worker holds no memory on the host
        limit = obs.memory_limit_bytes * MEMORY_SAFE_SHARE
        parts = memory_parts(obs)

        def worst_case(a: Allocation) -> float:
            return parts.worst_case_bytes(a.replace(remote=remote_of(a, obs)))

        worst = worst_case(alloc)
        over_memory = worst > limit
        # When the consumer (the model) is the bottleneck every buffer fills, and a larger
        # one only holds more waiting items: no buffer may grow then.
        consumer_bound = obs.consumer_step_s * obs.throughput >= CONSUMER_BOUND
        # Workers that queue for a CPU: another process would take its CPU from them (the
        # plan's budget, run_queue.cpu_saturated); workers only move or go.
        saturated = cpu_saturated(obs)
        flat_out = working_flat_out(obs)
        takes = [LEAN_ITEMS * b for b in take_bytes(obs)]
        least = least_workers(obs)
        for i, st in enumerate(obs.stages):
            base = 1 + ACTIONS_PER_STAGE * i
            if st.fused:
                continue  # no workers and no buffer of its own: nothing to move
            w, b = alloc.workers[i], alloc.buffer_bytes[i]
            for k, dw in enumerate(WORKER_DELTAS):
                if dw < 0:
                    short = w + dw < least[i]
                    keep = (flat_out[i] or short) and not over_memory
                    mask[base + k] = w + dw >= max(1, st.min_workers) and not keep
                elif not over_memory and w + dw <= st.max_workers and can_use_workers(st):
                    new = self.apply(alloc, base + k, obs)
                    grown = local_total(new, obs) - total_w
                    if saturated and grown > 0:
                        continue
                    fits_mem = worst_case(new) <= limit
                    fits_cpu = grown <= 0 or sum(new.workers) <= cpu_cap(obs, new)
                    mask[base + k] = fits_mem and fits_cpu and new.workers[i] == w + dw
            up = _buffer_step(b, True)
            # More room only helps a buffer that fills while its reader at times finds it
            # empty (items come and go in bursts): growing an idle one reserves memory (the
            # budget other stages and the model could use) for nothing, and one that stays
            # full holds its producer ahead of a slower reader, whose wait is not for room.
            mask[base + 4] = (
                not over_memory
                and not consumer_bound
                and worst + (up - b) <= limit
                and st.buffer_fill >= BUFFER_GROW_MIN_FILL
                and _reader_waits(obs, i)
            )
            # Below KEEP_BUFFER_BYTES a buffer shrinks only for memory or when every buffer
            # just holds items waiting for the model: a small buffer between two busy stages
            # makes them wait on each other, and the workers hold most of the memory anyway.
            # Never below room for a few takes of its reader (a collate's buffer smaller than
            # its batch's rows stalls every stage before it): workers go instead.
            mask[base + 5] = (
                b > MiB
                and (over_memory or consumer_bound or b > KEEP_BUFFER_BYTES)
                and _buffer_step(b, False) >= takes[i]
            )
        return mask


def _reader_waits(obs: Observation, i: int) -> bool:
    """Whether the stage that reads stage ``i``'s buffer (the next one that runs its own
    workers) waited for input at least ``READER_WAIT_MIN`` of its time; True for the last
    stage's (the consumer reads it: ``CONSUMER_BOUND`` judges that one)."""
    j = i + fused_depth(tuple(st.fused for st in obs.stages), i) + 1
    return j >= len(obs.stages) or obs.stages[j].blocked_in >= READER_WAIT_MIN


# The pipeline's workers use at least this share of the CPUs: every core is taken.
CORES_FULL = 0.95
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
# ... and only when its reader waited for input at least this share of its time.
READER_WAIT_MIN = 0.05


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


def least_workers(obs: Observation) -> list[float]:
    """Per stage, the fewest workers that keep its rate: ``HEADROOM`` times the work its
    workers do now, in workers (their busy share, less the run queue, of those that ran); 0
    for every stage while every core is taken (the stages use ``CORES_FULL`` of the CPUs, or
    their workers queue for one): a worker fewer then frees a core others wait for."""
    used = sum(st.cpu_s_per_item * st.items_per_s for st in obs.stages)
    if cpu_saturated(obs) or used >= CORES_FULL * obs.cpus:
        return [0.0] * len(obs.stages)
    busy = group_busy(obs, less_runqueue=True)
    return [HEADROOM * b * st.workers for b, st in zip(busy, obs.stages, strict=True)]


def idlest_donor(
    workers: list[int],
    obs: Observation,
    keep: int | None = None,
    below: float = math.inf,
    least: Sequence[float] = (),
) -> int | None:
    """The stage that can best give up a worker: the most idle workers (``workers * (1 -
    busy)``, a stage hosting fused stages busy for its group, :func:`group_busy`) among
    stages above their minimum and ``least`` (:func:`least_workers`; empty: none) and busy
    less than ``below``, ``keep`` excepted; None when none can."""
    busy = group_busy(obs)
    least = least or [0.0] * len(workers)
    donors = [
        j
        for j, st in enumerate(obs.stages)
        if j != keep
        and workers[j] > max(1, st.min_workers)
        and workers[j] - 1 >= least[j]
        and busy[j] < below
    ]
    if not donors:
        return None
    return max(donors, key=lambda j: workers[j] * (1.0 - busy[j]))


def reshape_to(before: Allocation, after: Allocation, obs: Observation) -> tuple[bool, ...] | None:
    """The fusion shape a move from ``before`` to ``after`` goes to; None where the shape
    stays (fusion left open reads as the shape ``obs`` ran)."""
    ran = tuple(s.fused for s in obs.stages)
    was, to = before.fused or ran, after.fused or ran
    return None if was == to else to


def mask_predicted_drops(
    mask: torch.Tensor, actions: ActionSpace, obs: Observation, current: Allocation,
    planned: Plan | None, drop: float,
) -> torch.Tensor:  # fmt: skip
    """``mask`` with every worker move closed that the plan's model rates below the
    allocation in force by more than the share ``drop`` (the undo's): a move the undo would
    take back if the model is right, and whose trial costs an interval at that rate. Moves it
    rates within that stay open to the network (where the model errs, the network may know
    better); unchanged where the plan rates no worker counts or ``current`` runs another shape
    than ``obs``. Returns ``mask`` (changed in place)."""
    rate_of = planned.rate_of if planned is not None else None
    if rate_of is None or (current.fused or ()) not in ((), tuple(s.fused for s in obs.stages)):
        return mask
    now = rate_of(current.workers)
    if now <= 0:
        return mask
    for index in torch.nonzero(mask & actions.worker_moves()).flatten().tolist():
        if index == actions.plan_index:
            continue
        after = actions.apply(current, index, obs, planned)
        if after.workers != current.workers and rate_of(after.workers) < (1 - drop) * now:
            mask[index] = False
    return mask


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


def distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return float(sum(abs(x - y) for x, y in zip(a, b, strict=True)))


def clip(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x
