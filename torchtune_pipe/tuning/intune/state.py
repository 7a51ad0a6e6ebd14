"""What the InTune agent sees and earns: the state encoding and the reward.

See :mod:`torchtune_pipe.tuning.intune.agent` for the reward formula.
"""

from __future__ import annotations

import math

import torch

from torchtune_pipe.tuning.base import Allocation, Observation
from torchtune_pipe.tuning.intune.space import WORKER_DELTAS, Action, clip, distance, group_busy
from torchtune_pipe.tuning.planner import Plan
from torchtune_pipe.tuning.safety import is_io_bound, oversubscribe_factor

MEMORY_KNEE = 0.8
STAGE_FEATURES = 11
GLOBAL_FEATURES = 16
# Reward charged for any action but the no-op: a change costs a worker start or a resize.
CHANGE_COST = 0.005

# Scales of the state features (changing one means re-training every weight file): each
# brings a feature to about [-1, 1] or [0, 1] on the machines pre-training draws from.
WORKER_MOVE_SCALE = float(max(abs(d) for d in WORKER_DELTAS))  # the largest move: +-1
LOG_GAIN_MAX = 3.0  # log(throughput / first since the rescale), clipped, then / this
CONSUMER_LOAD_MAX = 2.0  # consumer step time x throughput (1: the model is the bottleneck)
LATENCY_RATIO_MAX = 5.0  # latency / first latency, clipped, then / this
LOG2_CPUS_SCALE = 7.0  # log2(CPUs) / this: 128 CPUs is 1
RESCALE_HORIZON_STEPS = 30  # steps since the last rescale, counted up to this
DRAM_GBPS_SCALE = 100.0
CPU_GHZ_SCALE = 4.0
MACHINE_FEATURE_MAX = 2.0  # DRAM bandwidth and clock, scaled, clipped to this
PLAN_LOG_GAIN_MAX = 1.0  # log(planned / measured throughput), clipped to +- this
PLAN_DISTANCE_MAX = 2.0  # workers the plan moves / CPUs, clipped to this


def memory_factor(used_fraction: float, knee: float = MEMORY_KNEE) -> float:
    """1 up to ``knee`` of the memory limit, then a smoothstep down to 0 at the limit."""
    if used_fraction <= knee:
        return 1.0
    x = min(1.0, (used_fraction - knee) / (1.0 - knee))
    return 1.0 - (3 * x * x - 2 * x * x * x)


def reward(obs: Observation, reference_throughput: float, knee: float = MEMORY_KNEE) -> float:
    """Normalised throughput scaled down to 0 as memory use nears the limit (module docstring).

    >>> # half the reference throughput at 90 % memory: 0.5 * (1 - smoothstep(0.5)) = 0.25
    """
    if obs.oom:
        return -1.0
    used = obs.memory_used_bytes / max(1, obs.memory_limit_bytes)
    return obs.throughput / max(reference_throughput, 1e-12) * memory_factor(used, knee)


def transition_reward(
    obs: Observation, reference_throughput: float, action: Action | None
) -> float:
    """The reward of the transition that ``action`` led to ``obs``: :func:`reward`, less
    ``CHANGE_COST`` when the action changed a stage (the no-op and the plan are free)."""
    r = reward(obs, reference_throughput)
    return r - CHANGE_COST if action is not None and action.stage is not None else r


class StateEncoder:
    """Turns observations into scale-free state vectors for one pipeline length.

    Per stage: workers and CPU actually used as fractions of ``cpus``, busy (a stage that
    hosts fused stages: its group's, :func:`~.intune_space.group_busy`), blocked-in and
    blocked-out fractions, buffer bytes as a fraction of the memory limit, buffer fill, an
    I/O-bound flag, an at-max-workers flag and the last action's worker and buffer change
    on that stage. Global: throughput relative to the best and to the first throughput since
    the CPU count last changed, its change since the last step, free CPUs and free memory as
    fractions, buffer budget share, consumer step time times throughput (~1 when the model is
    the bottleneck), latency relative to the first latency, log2 of the CPU count, steps since
    the last rescale, DRAM bandwidth, CPU clock and a last-action-was-no-op flag.
    """

    def __init__(self, n_stages: int) -> None:
        self.n_stages = n_stages
        self.dim = STAGE_FEATURES * n_stages + GLOBAL_FEATURES
        self.reset()

    def reset(self) -> None:
        """Forget the running references (start of a new pipeline)."""
        self.cpus = 0.0
        self.best = 0.0
        self.first = 0.0
        self.first_latency = 0.0
        self.prev = 0.0
        self.since_rescale = 0

    def update_references(self, obs: Observation) -> bool:
        """Track the current CPU regime; returns True when the CPU count just changed."""
        rescaled = abs(obs.cpus - self.cpus) > 1e-6
        if rescaled:
            self.cpus, self.best, self.first, self.first_latency = obs.cpus, 0.0, 0.0, 0.0
            self.since_rescale = 0
        else:
            self.since_rescale += 1
        if self.first <= 0.0 and obs.throughput > 0:
            self.first = obs.throughput
            self.first_latency = obs.latency_s
        self.best = max(self.best, obs.throughput)
        return rescaled

    def encode(
        self,
        obs: Observation,
        alloc: Allocation,
        last: Action | None,
        planned: Plan | None = None,
    ) -> torch.Tensor:
        """The state vector for ``obs`` with ``alloc`` in force (call after references)."""
        cpus = max(obs.cpus, 1.0)
        mem = max(1, obs.memory_limit_bytes)
        x = obs.throughput
        busy = group_busy(obs)
        feats: list[float] = []
        for i, st in enumerate(obs.stages):
            w = alloc.workers[i]
            moved = last is not None and last.stage == i
            feats += [
                w / cpus,
                w * busy[i] / cpus,
                busy[i],
                st.blocked_in,
                st.blocked_out,
                alloc.buffer_bytes[i] / mem,
                st.buffer_fill,
                1.0 if is_io_bound(st) else 0.0,
                1.0 if w >= st.max_workers else 0.0,
                (last.workers / WORKER_MOVE_SCALE) if moved else 0.0,
                float(last.buffer) if moved else 0.0,
            ]
        best = max(self.best, 1e-12)
        cap = cpus * oversubscribe_factor(obs, alloc)
        lat = obs.latency_s / self.first_latency if self.first_latency > 0 else 1.0
        feats += [
            x / best,
            clip(math.log(max(x, 1e-12) / self.first), -LOG_GAIN_MAX, LOG_GAIN_MAX) / LOG_GAIN_MAX
            if self.first > 0
            else 0.0,
            clip((x - self.prev) / best, -1, 1),
            clip((cap - sum(alloc.workers)) / cpus, -1, 1),
            clip(1.0 - obs.memory_used_bytes / mem, 0, 1),
            clip(sum(alloc.buffer_bytes) / mem, 0, 1),
            clip(obs.consumer_step_s * x, 0, CONSUMER_LOAD_MAX),
            clip(lat, 0, LATENCY_RATIO_MAX) / LATENCY_RATIO_MAX,
            math.log2(cpus) / LOG2_CPUS_SCALE,
            min(self.since_rescale, RESCALE_HORIZON_STEPS) / RESCALE_HORIZON_STEPS,
            clip(obs.dram_gbps / DRAM_GBPS_SCALE, 0, MACHINE_FEATURE_MAX),
            clip(obs.cpu_ghz / CPU_GHZ_SCALE, 0, MACHINE_FEATURE_MAX),
            1.0 if last is None or (last.stage is None and not last.plan) else 0.0,
            1.0 if last is not None and last.plan else 0.0,
            clip(
                math.log(max(planned.throughput, 1e-12) / max(x, 1e-12)),
                -PLAN_LOG_GAIN_MAX,
                PLAN_LOG_GAIN_MAX,
            )
            if planned is not None
            else 0.0,
            clip(distance(planned.allocation.workers, alloc.workers) / cpus, 0, PLAN_DISTANCE_MAX)
            if planned is not None
            else 0.0,
        ]
        self.prev = x
        return torch.tensor(feats, dtype=torch.float32)
