"""What the run queue says about the CPU a plan may spend.

Workers that are runnable but wait for a CPU (``StageStats.runqueue``, live only: the simulator
measures none) run on a machine whose cores are taken, by the pipeline's own threads in their
bursts, the consumer or other processes. Another process then takes its CPU from them: the
planner's budget (:func:`cpu_budget`) allows no CPU beyond what the pipeline uses once they wait
a ``1 - SATURATED`` share of their runnable time, and no InTune action adds a worker then
(:func:`cpu_saturated`).
"""

from __future__ import annotations

from torchtune_pipe.tuning.base import Observation
from torchtune_pipe.tuning.item_costs import cpu_and_idle, per_delivered, worker_seconds

# Workers that got a CPU for less than this share of their runnable time run on a machine
# whose cores are taken: the plan spends no CPU beyond what the pipeline uses (cpu_budget).
SATURATED = 0.8


def cpu_saturated(obs: Observation) -> bool:
    """Whether the busy stages' workers waited for a CPU ``1 - SATURATED`` of their runnable
    time or more (live only: the simulator measures no run queue): :func:`cpu_budget` then
    allows no CPU beyond what they use now, and no tuner adds a worker (a dip in rows/s on
    cores that are taken, by the pipeline or by others, is not a stage short of processes)."""
    stages = obs.stages
    if not stages or any(s.runqueue is None for s in stages):
        return False
    if any(s.items_per_s <= 0 and not s.idle for s in stages):
        return False
    r = per_delivered(obs)
    g, idle = cpu_and_idle(obs, r)
    q = worker_seconds(obs, r)([s.runqueue or 0.0 for s in stages])
    return _free_share(g, q, idle) == 0.0


def cpu_budget(x: float, g: list[float], q: list[float], idle: list[bool], cpus: float) -> float:
    """The CPUs the plan may spend at most: ``cpus`` while the busy stages' workers get a CPU
    whenever they can run; only what they use now (``x * sum g``) once they wait for one a
    ``1 - SATURATED`` share of their runnable time or more, in between in proportion. Workers
    that queue for a CPU show a machine whose cores are taken (by the pipeline's own threads
    in their bursts, the consumer, other processes): another process then takes its CPU from
    them, and the fluid model, which sees only the stages' CPU, would promise it a share of
    cores nobody has to give."""
    used = x * sum(g)
    return min(cpus, used + max(0.0, cpus - used) * _free_share(g, q, idle))


def _free_share(g: list[float], q: list[float], idle: list[bool]) -> float:
    """How much of the CPU it does not use the plan may spend (:func:`cpu_budget`): 1 while
    the busy stages' workers ran a ``SATURATED`` share of their runnable time or more (or
    nothing ran), 0 at or below it, in between in proportion."""
    run = sum(g[i] + q[i] for i in range(len(g)) if not idle[i])
    if run <= 0.0:
        return 1.0
    share = sum(g[i] for i in range(len(g)) if not idle[i]) / run
    return min(1.0, max(0.0, (share - SATURATED) / (1.0 - SATURATED)))
