"""A Gymnasium environment over :class:`~torchtune_pipe.sim.model.SimPipeline` that is the
InTune agent's own task.

State, actions, masks and reward are the shipped agent's, not a copy of them: the environment
drives an :class:`~torchtune_pipe.tuning.intune.agent.InTuneTuner` that chooses no actions itself
(:meth:`~torchtune_pipe.tuning.intune.agent.InTuneTuner.begin`, ``prepare``, ``take``), so a policy
trained here sees what the tuner computes live and its action indices mean what they mean to
the tuner:

* **State**: :class:`~torchtune_pipe.tuning.intune.state.StateEncoder`,
  ``STAGE_FEATURES * n + GLOBAL_FEATURES`` floats (11 per stage, 16 global).
* **Actions**: :class:`~torchtune_pipe.tuning.intune.space.ActionSpace`, ``2 + 6 * n``: the
  no-op, per stage ``+1, -1, +5, -5`` workers, buffer up, buffer down, and last "plan".
  ``info["action_mask"]`` (``int8``) is the agent's mask, undo's tabu included;
  ``action_space.sample(mask=info["action_mask"])`` draws an allowed action.
* **Reward**: :func:`~torchtune_pipe.tuning.intune.state.transition_reward`: throughput over
  the reference, times the smoothstep memory factor, less ``CHANGE_COST`` for a move; ``-1`` on
  an OOM, which ends the episode. The reference is the best of the throughput seen since the
  CPU count last changed and, as in pre-training, the simulator's oracle for the CPU count in
  force (``reference="upper_bound"``: the cheaper CPU-work bound).

The undo rule, the guard and rescaling act between steps as they do in the tuner; the plan is
taken only when the policy picks it. Every allocation reaches the simulator through
:class:`~torchtune_pipe.tuning.safety.Guarded`, as live.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gymnasium
import numpy as np

from torchtune_pipe.sim.model import SimPipeline, Workload
from torchtune_pipe.sim.workloads import generate
from torchtune_pipe.tuning.base import Allocation, MiB, Observation
from torchtune_pipe.tuning.intune.agent import InTuneTuner
from torchtune_pipe.tuning.intune.space import ActionSpace
from torchtune_pipe.tuning.intune.state import StateEncoder, transition_reward
from torchtune_pipe.tuning.safety import Guarded

__all__ = ["ENV_ID", "PipeEnv", "register"]

ENV_ID = "TorchtunePipe-v0"
# Workload seeds drawn for episodes stay below this: higher ones are kept for held-out tests.
_HELDOUT_SEED = 10_000
_REFERENCES = ("oracle", "upper_bound")


class PipeEnv(gymnasium.Env):
    """The InTune agent's tuning task on a simulated pipeline, as a Gymnasium environment.

    Args:
        n_stages: pipeline length (fixes the spaces); used with :func:`generate` when no
            ``workload`` is given, drawing a new pipeline per episode.
        workload: a fixed workload instead (its length must equal ``n_stages``).
        cpus: CPUs, a number or a schedule ``[(t_start_s, cpus), ...]``.
        memory_limit_bytes: memory limit; default: room for ``2 * cpus`` workers + 2 GiB.
        episode_steps: steps before truncation.
        initial: ``"even"`` (the agent's own start: CPUs split evenly), ``"min"`` or
            ``"random"``.
        noise: the simulator's measurement noise.
        workload_fn: ``seed -> Workload`` drawing episodes' workloads (overrides the default).
        reference: ``"oracle"`` or ``"upper_bound"`` (module docstring).

    Example:
        >>> env = PipeEnv(n_stages=5, cpus=[(0, 32), (100, 64)])
        >>> obs, info = env.reset(seed=0)
        >>> action = env.action_space.sample(mask=info["action_mask"])
        >>> obs, r, terminated, truncated, info = env.step(action)
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        n_stages: int = 5,
        workload: Workload | None = None,
        cpus: float | Sequence[tuple[float, float]] = 32,
        memory_limit_bytes: int | None = None,
        episode_steps: int = 200,
        initial: str = "even",
        noise: float = 0.02,
        workload_fn: Callable[[int], Workload] | None = None,
        reference: str = "oracle",
    ) -> None:
        if workload is not None and len(workload.stages) != n_stages:
            raise ValueError(
                f"PipeEnv: workload {workload.name!r} has {len(workload.stages)} stages, "
                f"n_stages is {n_stages}"
            )
        if initial not in ("even", "min", "random"):
            raise ValueError(f"PipeEnv: initial must be even, min or random, got {initial!r}")
        if reference not in _REFERENCES:
            raise ValueError(f"PipeEnv: reference must be oracle or upper_bound, got {reference!r}")
        self.n_stages = n_stages
        self._fixed = workload
        self._workload_fn = workload_fn or (lambda seed: generate(n_stages, seed))
        self._cpus = cpus
        self._memory = memory_limit_bytes
        self.episode_steps = episode_steps
        self.initial = initial
        self.noise = noise
        self.reference = reference
        self.actions = ActionSpace(n_stages)
        self.action_space = gymnasium.spaces.Discrete(self.actions.n)
        size = StateEncoder(n_stages).dim
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (size,), np.float32)
        self.tuner = InTuneTuner(plan_gain=None)
        self.sim: SimPipeline | None = None
        self.pipe: Guarded | None = None
        self._obs: Observation | None = None
        self._refs: dict[float, float] = {}
        self._steps = 0

    @property
    def observation(self) -> Observation | None:
        """The latest observation of the simulated pipeline."""
        return self._obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start an episode on a fresh (or the fixed) workload; returns ``(state, info)``."""
        super().reset(seed=seed)
        rng = self.np_random
        wl = self._fixed or self._workload_fn(int(rng.integers(0, _HELDOUT_SEED)))
        if len(wl.stages) != self.n_stages:
            raise ValueError(
                f"PipeEnv: workload_fn gave {len(wl.stages)} stages, expected {self.n_stages}"
            )
        schedule = [(0.0, float(self._cpus))] if np.isscalar(self._cpus) else list(self._cpus)
        memory = self._memory or int(
            2 * max(c for _, c in schedule) * wl.worker_rss_bytes
            + sum(s.resident_bytes for s in wl.stages)
            + 2048 * MiB
        )
        self.sim = SimPipeline(
            wl, schedule, memory, seed=int(rng.integers(0, 2**31)), noise=self.noise
        )
        self._refs = {}
        self.pipe = Guarded(self.sim)
        first = self.pipe.observe()
        self.pipe.apply(self.tuner.begin(first, self._initial_allocation(first, rng)))
        self._obs = self.pipe.observe()
        self._steps = 0
        state, mask = self.tuner.prepare(self._obs)
        return self._state(state), self._info(self._obs, mask)

    def step(self, action):
        """Take one of the agent's actions, advance one interval; the Gymnasium 5-tuple."""
        if self.pipe is None or self._obs is None:
            raise RuntimeError("PipeEnv.step() called before reset()")
        index = int(action)
        if not 0 <= index < self.actions.n:
            raise ValueError(f"PipeEnv.step: action must be in [0, {self.actions.n}), got {index}")
        self.pipe.apply(self.tuner.take(index))
        obs = self.pipe.observe()
        self._obs = obs
        self._steps += 1
        state, mask = self.tuner.prepare(obs)  # updates the best throughput seen, as the tuner
        ref = max(self.tuner.encoder.best, self._reference(obs.cpus))
        r = transition_reward(obs, ref, self.actions.decode(index))
        truncated = self._steps >= self.episode_steps and not obs.oom
        return self._state(state), r, bool(obs.oom), truncated, self._info(obs, mask)

    def _reference(self, cpus: float) -> float:
        if cpus not in self._refs:
            if self.reference == "oracle":
                from torchtune_pipe.tuning.intune.pretrain import oracle_value

                self._refs[cpus] = oracle_value(self.sim, cpus)
            else:
                self._refs[cpus] = self.sim.upper_bound(cpus)
        return self._refs[cpus]

    @staticmethod
    def _state(state) -> np.ndarray:
        return state.numpy().astype(np.float32, copy=False)

    def _info(self, obs: Observation, mask) -> dict:
        return {
            "action_mask": mask.numpy().astype(np.int8),
            "throughput": obs.throughput,
            "allocation": self.sim.allocation,
            "oom": obs.oom,
        }

    def _initial_allocation(self, obs: Observation, rng: np.random.Generator) -> Allocation | None:
        n = self.n_stages
        if self.initial == "even":
            return None  # the agent's own start
        if self.initial == "min":
            workers = [s.min_workers for s in obs.stages]
        else:
            workers = [int(rng.integers(1, max(2, int(obs.cpus) // 2))) for _ in range(n)]
        return Allocation(tuple(workers), (self.sim.workload.initial_buffer_bytes,) * n)


def register() -> None:
    """Register ``"TorchtunePipe-v0"`` with Gymnasium (idempotent)."""
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="torchtune_pipe.tuning.intune.gym:PipeEnv")
