"""InTune: a DQN agent that moves CPUs and buffer memory between pipeline stages.

Every tuning step the agent encodes the latest :class:`Observation` into a fixed-length state,
masks the actions that would break a hard limit, and takes the masked arg-max of its Q network
(:mod:`torchtune_pipe.tuning.dqn`). One action changes one stage by a little, so the pipeline
never jumps to an untested allocation.

**Actions** (``1 + 6 * n_stages``): no-op, then per stage ``+1, -1, +5, -5`` workers,
buffer up, buffer down. Buffers move in geometric steps of 50 % rounded to whole MiB (at
least 1 MiB): item sizes span kilobytes to hundreds of megabytes, so a fixed MiB step is
either too fine for one workload or too coarse for another.

**Masking.** An action is masked when it would take a stage below ``min_workers`` (>= 1) or
above ``max_workers``, past the CPU budget, or past the memory limit in the worst case (every
buffer full, every new worker costing the memory a worker costs now). The CPU budget follows
:mod:`torchtune_pipe.tuning.safety`: workers of a stage observed waiting on I/O are charged
only their busy share of a core, so such stages may hold more workers than there are cores
(up to ``safety.MAX_OVERSUBSCRIBE`` times the CPU count in total).

**Undo.** A worker move after which throughput falls by more than ``REVERT_DROP`` is undone
at the next step and masked for ``TABU_STEPS`` steps: the Q network proposes, the measurement
has the last word. The agent sees the undo as the move's outcome, so it learns from it too.

**Reward.** ``r = (throughput / reference) * m(u)`` with ``u = memory_used / memory_limit``
and ``m(u) = 1`` for ``u <= 0.8``, ``m(u) = 1 - s((u - 0.8) / 0.2)`` above, where
``s(x) = 3x^2 - 2x^3`` (smoothstep) so ``m`` falls smoothly to 0 at the limit; an OOM gives
``-1`` and ends the episode. Any action but the no-op costs ``CHANGE_COST`` (0.005), so the
agent settles instead of shuffling buffers that make no difference. ``reference`` is the best throughput reachable with the current
CPUs: offline the simulator's oracle, online the best throughput seen since the CPU count last
changed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .base import Allocation, MiB, Observation
from .baselines import HeuristicTuner
from .dqn import DQNAgent, DQNConfig
from .safety import is_io_bound, oversubscribe_factor, safe

logger = logging.getLogger(__name__)

WEIGHTS_DIR = Path(__file__).parent / "weights"
WORKER_DELTAS = (1, -1, 5, -5)
ACTIONS_PER_STAGE = len(WORKER_DELTAS) + 2
MEMORY_KNEE = 0.8
# Worst-case memory an action may reach, as a share of the limit (headroom for noise).
MEMORY_SAFE_SHARE = 0.95
# Reward charged for any action but the no-op: a change costs a worker start or a resize.
CHANGE_COST = 0.005
# A worker move after which throughput fell by more than this share is undone (measurement
# noise is a few percent per interval), and the action is masked for TABU_STEPS steps.
REVERT_DROP = 0.06
TABU_STEPS = 10
STAGE_FEATURES = 11
GLOBAL_FEATURES = 13


def weights_path(n_stages: int, directory: Path = WEIGHTS_DIR) -> Path:
    """Where the shipped weights for an ``n_stages`` pipeline live."""
    return Path(directory) / f"intune_{n_stages}stages.pt"


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


@dataclass(frozen=True)
class Action:
    """One decoded action: ``stage`` None is the no-op."""

    stage: int | None
    workers: int = 0
    buffer: int = 0


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
        self.n = 1 + ACTIONS_PER_STAGE * n_stages

    def decode(self, index: int) -> Action:
        """The action with number ``index`` (0 is the no-op)."""
        if not 0 <= index < self.n:
            raise ValueError(f"ActionSpace.decode: index must be in [0, {self.n}), got {index}")
        if index == 0:
            return Action(None)
        stage, k = divmod(index - 1, ACTIONS_PER_STAGE)
        if k < len(WORKER_DELTAS):
            return Action(stage, workers=WORKER_DELTAS[k])
        return Action(stage, buffer=1 if k == len(WORKER_DELTAS) else -1)

    def apply(self, alloc: Allocation, index: int, obs: Observation | None = None) -> Allocation:
        """The allocation after taking action ``index``.

        With ``obs``, a worker increase that does not fit in the CPU budget takes the missing
        workers from the other stages with the most idle workers (``workers * (1 - busy)``),
        one at a time: growing a stage on a full machine is a move, not an overdraft.
        """
        act = self.decode(index)
        if act.stage is None:
            return alloc
        workers, buffers = list(alloc.workers), list(alloc.buffer_bytes)
        workers[act.stage] += act.workers
        if act.buffer:
            buffers[act.stage] = _buffer_step(buffers[act.stage], act.buffer > 0)
        if obs is not None and act.workers > 0:
            need = sum(workers) - cpu_cap(obs, Allocation(tuple(workers), tuple(buffers)))
            for _ in range(max(0, need)):
                donors = [
                    j
                    for j in range(self.n_stages)
                    if j != act.stage and workers[j] > max(1, obs.stages[j].min_workers)
                ]
                if not donors:
                    break
                j = max(donors, key=lambda j: workers[j] * (1.0 - obs.stages[j].busy))
                workers[j] -= 1
        return Allocation(tuple(workers), tuple(buffers))

    def mask(
        self, obs: Observation, alloc: Allocation, memory: MemoryModel | None = None
    ) -> torch.Tensor:
        """Bool mask of the actions that keep ``alloc`` within every hard limit."""
        mask = torch.zeros(self.n, dtype=torch.bool)
        mask[0] = True
        total_w = sum(alloc.workers)
        limit = obs.memory_limit_bytes * MEMORY_SAFE_SHARE
        per_worker, fixed = (memory or MemoryModel()).split(obs)
        worst = sum(alloc.buffer_bytes) + fixed + per_worker * total_w
        over_memory = worst > limit
        for i, st in enumerate(obs.stages):
            base = 1 + ACTIONS_PER_STAGE * i
            w, b = alloc.workers[i], alloc.buffer_bytes[i]
            for k, dw in enumerate(WORKER_DELTAS):
                if dw < 0:
                    mask[base + k] = w + dw >= max(1, st.min_workers)
                elif not over_memory and w + dw <= st.max_workers:
                    new = self.apply(alloc, base + k, obs)
                    grown = sum(new.workers) - total_w
                    fits_mem = worst + per_worker * grown <= limit
                    fits_cpu = grown <= 0 or sum(new.workers) <= cpu_cap(obs, new)
                    mask[base + k] = fits_mem and fits_cpu and new.workers[i] == w + dw
            up = _buffer_step(b, True)
            # More room only helps a buffer that fills: growing an idle one reserves memory
            # (the budget other stages and the model could use) for nothing.
            mask[base + 4] = (
                not over_memory
                and worst + (up - b) <= limit
                and st.buffer_fill >= BUFFER_GROW_MIN_FILL
            )
            mask[base + 5] = b > MiB
        return mask


# A buffer may grow only when at least this share of it is in use.
BUFFER_GROW_MIN_FILL = 0.5


def cpu_cap(obs: Observation, alloc: Allocation) -> int:
    """Workers ``alloc`` may run in total: cores times the I/O oversubscription factor."""
    return max(len(alloc.workers), int(obs.cpus * oversubscribe_factor(obs, alloc) + 1e-9))


def rescale(alloc: Allocation, obs: Observation, old_cpus: float) -> Allocation:
    """Carry an allocation over to a new CPU count: scale every stage, then trim to the cap.

    Keeping the learned proportions means a resized machine starts near its new optimum; the
    agent then corrects the rest one action at a time. Trimming removes workers from the
    stages with the most idle workers first.
    """
    f = obs.cpus / max(old_cpus, 1e-9)
    workers = [
        min(st.max_workers, max(max(1, st.min_workers), round(w * f)))
        for w, st in zip(alloc.workers, obs.stages, strict=True)
    ]
    while sum(workers) > cpu_cap(obs, Allocation(tuple(workers), alloc.buffer_bytes)):
        donors = [j for j, st in enumerate(obs.stages) if workers[j] > max(1, st.min_workers)]
        if not donors:
            break
        j = max(donors, key=lambda j: workers[j] * (1.0 - obs.stages[j].busy))
        workers[j] -= 1
    return Allocation(tuple(workers), alloc.buffer_bytes)


class MemoryModel:
    """Memory outside the buffers, split into a per-worker cost and a fixed part.

    Fitted from two observations with different worker counts (a worker's RSS is the slope).
    Until then everything outside the buffers is charged to the workers, which overestimates
    what a new worker costs when a stage holds resident state: the safe side for OOM checks.
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
        w, other = sum(obs.workers), self._other(obs)
        if self._last is not None and self._last[0] != w:
            slope = (other - self._last[1]) / (w - self._last[0])
            self.slope = _clip(slope, 0.0, other / max(1, w))
        self._last = (w, other)

    def split(self, obs: Observation) -> tuple[float, float]:
        """(bytes per worker, fixed bytes) for ``obs``."""
        w, other = max(1, sum(obs.workers)), self._other(obs)
        per_worker = other / w if self.slope is None else self.slope
        return per_worker, max(0.0, other - per_worker * w)


def _clip(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


class StateEncoder:
    """Turns observations into scale-free state vectors for one pipeline length.

    Per stage: workers and CPU actually used as fractions of ``cpus``, busy, blocked-in and
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

    def encode(self, obs: Observation, alloc: Allocation, last: Action | None) -> torch.Tensor:
        """The state vector for ``obs`` with ``alloc`` in force (call after references)."""
        cpus = max(obs.cpus, 1.0)
        mem = max(1, obs.memory_limit_bytes)
        x = obs.throughput
        feats: list[float] = []
        for i, st in enumerate(obs.stages):
            w = alloc.workers[i]
            moved = last is not None and last.stage == i
            feats += [
                w / cpus,
                w * st.busy / cpus,
                st.busy,
                st.blocked_in,
                st.blocked_out,
                alloc.buffer_bytes[i] / mem,
                st.buffer_fill,
                1.0 if is_io_bound(st) else 0.0,
                1.0 if w >= st.max_workers else 0.0,
                (last.workers / 5.0) if moved else 0.0,
                float(last.buffer) if moved else 0.0,
            ]
        best = max(self.best, 1e-12)
        cap = cpus * oversubscribe_factor(obs, alloc)
        lat = obs.latency_s / self.first_latency if self.first_latency > 0 else 1.0
        feats += [
            x / best,
            _clip(math.log(max(x, 1e-12) / self.first), -3, 3) / 3 if self.first > 0 else 0.0,
            _clip((x - self.prev) / best, -1, 1),
            _clip((cap - sum(alloc.workers)) / cpus, -1, 1),
            _clip(1.0 - obs.memory_used_bytes / mem, 0, 1),
            _clip(sum(alloc.buffer_bytes) / mem, 0, 1),
            _clip(obs.consumer_step_s * x, 0, 2),
            _clip(lat, 0, 5) / 5,
            math.log2(cpus) / 7,
            min(self.since_rescale, 30) / 30,
            _clip(obs.dram_gbps / 100, 0, 2),
            _clip(obs.cpu_ghz / 4, 0, 2),
            1.0 if last is None or last.stage is None else 0.0,
        ]
        self.prev = x
        return torch.tensor(feats, dtype=torch.float32)


class InTuneTuner:
    """The InTune tuner: a pre-trained DQN agent, optionally fine-tuned online.

    Args:
        weights: a weight file, a directory holding ``intune_{n}stages.pt`` files, a state
            dict from :meth:`state_dict`, or None for the weights shipped with the package
            (chosen by pipeline length on :meth:`reset`).
        finetune: keep learning from live transitions (small replay, low epsilon).
        epsilon: exploration rate while fine-tuning (ignored otherwise); None follows the
            agent's epsilon schedule (pre-training).
        config: DQN hyper-parameters for learning; defaults suit fine-tuning.
        reference: throughput that normalises the reward; None uses the best throughput
            seen since the CPU count last changed.
        learn_every: steps per gradient update while learning. Fine-tuning updates every 5th
            step: with torch's default intra-op threads a tiny update can cost tens of ms of
            CPU on a busy machine, and the tuning loop must stay under 2 % of a core.
        seed: seeds exploration and replay sampling.

    Example:
        >>> tuner = InTuneTuner()
        >>> alloc = tuner.reset(pipeline.observe())
        >>> pipeline.apply(alloc); alloc = tuner.step(pipeline.observe())
    """

    name = "intune"

    def __init__(
        self,
        weights: str | Path | Mapping[str, Any] | None = None,
        *,
        finetune: bool = False,
        epsilon: float | None = 0.02,
        config: DQNConfig | None = None,
        reference: Callable[[Observation], float] | None = None,
        learn_every: int = 5,
        seed: int = 0,
    ) -> None:
        if learn_every < 1:
            raise ValueError(f"InTuneTuner: learn_every must be >= 1, got {learn_every}")
        self.learn_every = learn_every
        self.weights = weights
        self.finetune = finetune
        self.epsilon = epsilon
        self.config = config or DQNConfig(
            lr=1e-4, batch_size=32, replay_size=2000, warmup=64, eps_start=0.02, eps_end=0.02
        )
        self.reference = reference
        self.seed = seed
        self.agent: DQNAgent | None = None
        self.actions: ActionSpace | None = None
        self.encoder: StateEncoder | None = None
        self.memory = MemoryModel()
        self._alloc: Allocation | None = None
        self._cpus = 0.0
        self._before: tuple[Allocation, float] | None = None
        self._tabu: dict[int, int] = {}
        self._last: Action | None = None
        self._prev: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.steps = 0
        self.last_reward = 0.0
        self.episode_reward = 0.0

    # -- Tuner ----------------------------------------------------------------------------
    def reset(self, obs: Observation, *, start: Allocation | None = None) -> Allocation:
        """Load the agent for this pipeline length; start from the even CPU split.

        Args:
            obs: the pipeline as it runs now.
            start: start from this allocation instead (pre-training uses random starts).
        """
        n = len(obs.stages)
        if self.actions is None or self.actions.n_stages != n:
            self.actions = ActionSpace(n)
            self.encoder = StateEncoder(n)
            self.agent = self._load_agent(n)
        self.encoder.reset()
        self.memory = MemoryModel()
        self.memory.update(obs)
        self._last, self._prev = None, None
        self._before, self._tabu = None, {}
        self._cpus = obs.cpus
        self.episode_reward = 0.0
        if start is None:
            start = HeuristicTuner().reset(obs)
        self._alloc = safe(_fit_memory(start, obs, self.memory, 0.9), obs)
        return self._alloc

    def step(self, obs: Observation) -> Allocation:
        """Observe, learn from the last transition (fine-tuning), pick and apply one action."""
        if self.agent is None or self._alloc is None:
            return self.reset(obs)
        if len(obs.stages) != self.actions.n_stages:
            raise ValueError(
                f"InTuneTuner.step: pipeline has {len(obs.stages)} stages, the agent was reset "
                f"for {self.actions.n_stages}; call reset() for a new pipeline"
            )
        self.encoder.update_references(obs)
        self.memory.update(obs)
        current = self._alloc
        if abs(obs.cpus - self._cpus) > 1e-6:
            current, self._cpus = rescale(current, obs, self._cpus), obs.cpus
            current = _fit_memory(current, obs, self.memory)
        elif self._before is not None and obs.throughput < (1 - REVERT_DROP) * self._before[1]:
            # The last worker move cost throughput: undo it and keep it off for a while.
            current = self._before[0]
            self._tabu[self._prev[2]] = TABU_STEPS
        self._before = None
        current = safe(current, obs)
        state = self.encoder.encode(obs, current, self._last)
        mask = self.actions.mask(obs, current, self.memory)
        for index, left in list(self._tabu.items()):
            mask[index] = False
            if left <= 1:
                del self._tabu[index]
            else:
                self._tabu[index] = left - 1
        if self.agent.training_enabled and self._prev is not None:
            ref = self.encoder.best
            if self.reference is not None:
                ref = max(ref, self.reference(obs))
            self.last_reward = reward(obs, ref)
            if self._last is not None and self._last.stage is not None:
                self.last_reward -= CHANGE_COST
            self.episode_reward += self.last_reward
            s0, m0, a0 = self._prev
            self.agent.remember(s0, m0, a0, self.last_reward, state, mask, obs.oom)
            if self.steps % self.learn_every == 0:
                self.agent.learn()
        eps = self.epsilon if self.epsilon is not None else self.agent.epsilon(self.steps)
        index = self.agent.act(state, mask, eps if self.agent.training_enabled else 0.0)
        self.steps += 1
        self._prev = (state, mask, index)
        self._last = self.actions.decode(index)
        self._alloc = safe(self.actions.apply(current, index, obs), obs)
        if self._alloc.workers != current.workers:
            self._before = (current, obs.throughput)
        return self._alloc

    # -- weights --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The agent's weights (for checkpoints); empty before the first :meth:`reset`."""
        if self.agent is None:
            return {}
        return {"n_stages": self.actions.n_stages, "agent": self.agent.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore weights saved by :meth:`state_dict` (builds the agent if needed)."""
        if not state:
            return
        n = int(state["n_stages"])
        self.actions, self.encoder = ActionSpace(n), StateEncoder(n)
        self.agent = DQNAgent.from_state_dict(state["agent"])
        if self.finetune:
            self.agent.enable_training(seed=self.seed, config=self.config)

    def _load_agent(self, n: int) -> DQNAgent:
        src = self.weights
        if isinstance(src, Mapping):
            state = src
        else:
            path = Path(src) if src is not None else WEIGHTS_DIR
            if path.is_dir():
                path = weights_path(n, path)
            if not path.is_file():
                raise FileNotFoundError(
                    f"InTuneTuner: no pre-trained weights for {n} stages at {path}; train them "
                    f"with `python -m torchtune_pipe.sim.pretrain --stages {n} --out DIR` and "
                    "pass weights=DIR"
                )
            state = torch.load(path, map_location="cpu", weights_only=True)
        if "agent" in state:
            if int(state["n_stages"]) != n:
                raise ValueError(
                    f"InTuneTuner: weights are for {state['n_stages']} stages, the pipeline has {n}"
                )
            state = state["agent"]
        agent = DQNAgent.from_state_dict(state)
        if self.finetune:
            agent.enable_training(seed=self.seed, config=self.config)
        return agent


def _fit_memory(
    alloc: Allocation, obs: Observation, memory: MemoryModel | None = None, share: float = 1.0
) -> Allocation:
    """Shrink buffers, then the largest stages, until the worst case fits in memory."""
    per_worker, fixed = (memory or MemoryModel()).split(obs)
    limit = obs.memory_limit_bytes * MEMORY_SAFE_SHARE * share
    workers, buffers = list(alloc.workers), list(alloc.buffer_bytes)
    while sum(buffers) + fixed + per_worker * sum(workers) > limit:
        if sum(buffers) > len(buffers) * MiB:
            buffers = [max(MiB, b // 2) for b in buffers]
        elif sum(workers) > len(workers):
            i = max(range(len(workers)), key=workers.__getitem__)
            workers[i] -= 1
        else:
            break
    return Allocation(tuple(workers), tuple(buffers))
