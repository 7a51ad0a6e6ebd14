"""A one-shot worker plan from measured stage rates: where the InTune agent can jump.

A DQN that moves one stage by one or five workers per step needs tens of steps to cross a
128-CPU machine after a rescale. The planner inverts the pipeline's fluid model from one
observation instead, so the agent can take the whole move in one action ("plan") and keep its
incremental actions for what the model gets wrong. The agent decides when to plan; the
measurement decides whether the plan stays (a plan that costs throughput is undone like any
other worker move).

From one interval with ``X`` items/s delivered, per stage ``i``:

* ``r_i``: items of stage ``i`` per delivered item, from the in/out ratios of the stages after
  it (a batch of 4 after ``i``: 4); not ``items_per_s_i / X``, which is inflated while stage
  ``i`` runs ahead of the others filling a buffer (the measured ratio stands in where the
  in/out counts are missing);
* ``g_i = cpu_s_per_item_i * r_i``: CPU seconds per delivered item;
* ``a_i = workers_i * busy_i / items_per_s_i * r_i``: worker (wall) seconds per delivered item;
* ``q_i = workers_i * runqueue_i / items_per_s_i * r_i``: seconds per delivered item its
  workers were runnable but waiting for a CPU; a contended machine stretches wall time by
  that much and the plan must not mistake it for work (or for I/O);
* ``u_i = g_i + max(0, a_i - g_i - q_i)``: worker seconds per item on an uncontended machine
  (CPU plus waiting on I/O).

Where the run-queue delay is not measured (the simulator), ``q_i = g_i / phi - g_i`` with
``phi`` the CPU rate a runnable worker got: the median of ``g_i / a_i`` over CPU-bound stages
(1 when there are none, at most 1).

For a target rate ``T`` stage ``i`` needs ``n_i = ceil(headroom * T * u_i)`` workers (the
headroom absorbs noise and heavy-tailed items), each charged the CPU it would use,
``max(floor_i, T * g_i / n_i)`` of a core (the safety policy's floors,
:mod:`~torchtune_pipe.tuning.safety`). The plan
is the largest ``T`` (bisection) with ``T * sum g <= cpus``, charged cores ``<= cpus``,
``sum n <= MAX_OVERSUBSCRIBE * cpus``, worst-case memory within the limit, and ``T`` no faster
than the consumer takes items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Allocation, Observation
from .safety import MAX_OVERSUBSCRIBE, charge_floor, is_io_bound

# Workers planned per unit of measured need: room for noise and heavy-tailed items.
HEADROOM = 1.2
# Share of the memory limit the planned workers and buffers may fill in the worst case.
MEMORY_SHARE = 0.9
_BISECT_STEPS = 40


@dataclass(frozen=True)
class Plan:
    """A planned allocation, the delivered rate the fluid model expects from it, and the rate
    the same model (same headroom) gives the allocation the plan was made under."""

    allocation: Allocation
    throughput: float
    current: float = 0.0


def plan(
    obs: Observation,
    alloc: Allocation,
    *,
    per_worker_bytes: float = 0.0,
    fixed_bytes: float = 0.0,
    headroom: float = HEADROOM,
) -> Plan | None:
    """The worker counts that balance the stages of ``obs`` at the highest feasible rate.

    Args:
        obs: one measured interval (every stage must have emitted items or be idle).
        alloc: the allocation in force; its buffers are kept.
        per_worker_bytes: memory one more worker costs (see ``intune.MemoryModel``).
        fixed_bytes: memory outside buffers and workers.
        headroom: workers per unit of measured need (>= 1).

    Returns:
        The plan, or None when the interval measured nothing to plan from.
    """
    if headroom < 1.0:
        raise ValueError(f"plan(): headroom must be >= 1, got {headroom}")
    x = obs.stages[-1].items_per_s if obs.stages else 0.0
    if x <= 0 or obs.cpus <= 0 or any(s.items_per_s <= 0 and not s.idle for s in obs.stages):
        return None
    n = len(obs.stages)
    # An idle stage (no work this interval, e.g. a source done with the epoch) keeps its
    # workers: the interval says nothing about what it needs.
    idle = [s.idle and s.items_per_s <= 0 for s in obs.stages]
    io = [is_io_bound(s) for s in obs.stages]
    r = per_delivered(obs)
    g = [max(0.0, s.cpu_s_per_item) * r[i] for i, s in enumerate(obs.stages)]

    def per_item(share: list[float]) -> list[float]:
        # Worker seconds per delivered item that each stage's workers spent in ``share``.
        return [
            w * share[i] / s.items_per_s * r[i] if s.items_per_s > 0 else 0.0
            for i, (w, s) in enumerate(zip(obs.workers, obs.stages, strict=True))
        ]

    a = per_item([s.busy for s in obs.stages])
    if all(s.runqueue is not None for s in obs.stages):
        q = per_item([s.runqueue for s in obs.stages])
    else:
        rates = sorted(g[i] / a[i] for i in range(n) if not io[i] and a[i] > 0 and g[i] > 0)
        phi = min(1.0, max(0.05, rates[len(rates) // 2])) if rates else 1.0
        q = [g[i] / phi - g[i] for i in range(n)]
    u = [max(1e-12, g[i] + max(0.0, a[i] - g[i] - q[i])) for i in range(n)]
    floor = [charge_floor(s) for s in obs.stages]
    lo = [obs.workers[i] if idle[i] else max(1, s.min_workers) for i, s in enumerate(obs.stages)]
    hi = [lo[i] if idle[i] else max(lo[i], s.max_workers) for i, s in enumerate(obs.stages)]
    busy = [i for i in range(n) if not idle[i]]

    def charged(t: float, w: list[int]) -> float:
        # Each worker is charged the CPU it would use at rate t, at least its stage's floor.
        return sum(w[i] * max(floor[i], min(1.0, t * g[i] / w[i])) for i in range(n))

    # The fewest workers every stage must run are always allowed: on a machine with fewer
    # cores than stages they alone may pass the budget.
    cpus = max(obs.cpus, charged(0.0, lo))
    memory_left = obs.memory_limit_bytes * MEMORY_SHARE - fixed_bytes - sum(alloc.buffer_bytes)

    def workers(t: float) -> list[int]:
        return [min(hi[i], max(lo[i], math.ceil(headroom * t * u[i] - 1e-9))) for i in range(n)]

    def feasible(t: float) -> bool:
        w = workers(t)
        return (
            t * sum(g) <= obs.cpus
            and charged(t, w) <= cpus + 1e-9
            and sum(w) <= max(sum(lo), MAX_OVERSUBSCRIBE * obs.cpus)
            and sum(w) * per_worker_bytes <= memory_left
        )

    top = obs.cpus / max(sum(g), 1e-12)
    top = min(top, min(hi[i] / (headroom * u[i]) for i in busy))
    if obs.consumer_step_s > 0:
        top = min(top, 1.0 / obs.consumer_step_s)
    low, high = 0.0, top
    if feasible(high):
        low = high
    else:
        for _ in range(_BISECT_STEPS):
            mid = (low + high) / 2
            low, high = (mid, high) if feasible(mid) else (low, mid)
    if low <= 0.0:
        return None
    # The rate the chosen workers support, and no worker beyond what that rate needs (rounding
    # at the bisection's edge can leave one stage a worker ahead of the others).
    w = workers(low)
    rate = min(low, min(w[i] / (headroom * u[i]) for i in busy))
    now = min(top, min(obs.workers[i] / (headroom * u[i]) for i in busy))
    return Plan(Allocation(tuple(workers(rate)), alloc.buffer_bytes), rate, now)


def per_delivered(obs: Observation) -> list[float]:
    """Items of each stage per item the last stage delivers (``r_i``, module docstring)."""
    stages = obs.stages
    x = stages[-1].items_per_s
    r = [1.0] * len(stages)
    for i in range(len(stages) - 2, -1, -1):
        nxt = stages[i + 1]
        if nxt.items_in_per_s > 0 and nxt.items_per_s > 0:
            r[i] = r[i + 1] * nxt.items_in_per_s / nxt.items_per_s
        else:
            r[i] = stages[i].items_per_s / x if x > 0 else 0.0
    return r
