"""A Gymnasium environment over :class:`~torchtune_pipe.sim.model.SimPipeline`.

The encoding is InTune's, kept deliberately simple and exposed as pure functions so agents can
reuse it:

* **Actions** (:func:`decode_action`, :func:`apply_action`): ``0`` is a no-op; then, per stage
  ``i``, six actions ``1 + 6 i + k`` for ``k`` = +1, -1, +5, -5 workers, buffer + one step,
  buffer - one step. An action that would break a limit is clipped to it (a no-op at the limit);
  :func:`action_mask` marks those.
* **Observation** (:func:`encode_observation`): per stage ``[workers / cpus, buffer / memory
  limit, busy, blocked_in, blocked_out, buffer_fill, io_bound]``, then ``[throughput / ref,
  free CPU fraction, free memory fraction, latency_s / (1 + latency_s), cpus / 128,
  cpu_ghz / 5]``, clipped to ``[0, 4]``.
* **Reward** (:func:`reward`): ``throughput / ref * clip((1 - used / limit) / margin, 0, 1)``:
  normalised throughput, falling linearly to 0 over the last ``margin`` of the memory limit and
  0 on OOM. ``ref`` is the CPU-work upper bound :meth:`SimPipeline.upper_bound` at the current
  CPU count, so rewards lie in [0, 1] on any machine size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gymnasium
import numpy as np

from torchtune_pipe.sim.model import SimPipeline, Workload
from torchtune_pipe.sim.workloads import generate
from torchtune_pipe.tuning.base import Allocation, MiB, Observation

__all__ = [
    "ENV_ID",
    "ACTIONS_PER_STAGE",
    "STAGE_FEATURES",
    "GLOBAL_FEATURES",
    "PipeEnv",
    "action_count",
    "action_mask",
    "apply_action",
    "decode_action",
    "encode_observation",
    "register",
    "reward",
]

ENV_ID = "TorchtunePipe-v0"
ACTIONS_PER_STAGE = 6
STAGE_FEATURES = 7
GLOBAL_FEATURES = 6
_DELTAS = ((1, 0), (-1, 0), (5, 0), (-5, 0), (0, 1), (0, -1))  # (workers, buffer steps)
_FEATURE_MAX = 4.0
MIN_BUFFER_BYTES = 1 * MiB


def action_count(n_stages: int) -> int:
    """Number of discrete actions for a pipeline of ``n_stages`` stages."""
    return 1 + ACTIONS_PER_STAGE * n_stages


def decode_action(action: int, n_stages: int) -> tuple[int, int, int] | None:
    """``(stage, delta_workers, delta_buffer_steps)`` of an action, or None for the no-op.

    Raises:
        ValueError: when ``action`` is outside ``0..action_count(n_stages) - 1``.
    """
    if not 0 <= action < action_count(n_stages):
        raise ValueError(f"action must be in 0..{action_count(n_stages) - 1}, got {action}")
    if action == 0:
        return None
    stage, k = divmod(action - 1, ACTIONS_PER_STAGE)
    return (stage, *_DELTAS[k])


def apply_action(
    obs: Observation,
    action: int,
    buffer_step_bytes: int = 16 * MiB,
    oversubscribe: float = 2.0,
) -> Allocation:
    """The allocation after ``action``, clipped to the stage bounds and budgets.

    Workers stay within each stage's ``[min_workers, max_workers]`` and the total within
    ``cpus * oversubscribe`` (I/O-bound stages legitimately run more workers than cores);
    buffers stay at least ``MIN_BUFFER_BYTES`` and their total within the memory limit.
    """
    alloc = obs.allocation()
    d = decode_action(action, len(obs.stages))
    if d is None:
        return alloc
    i, dw, db = d
    workers, buffers = list(alloc.workers), list(alloc.buffer_bytes)
    st = obs.stages[i]
    if dw > 0:
        room = int(obs.cpus * oversubscribe) - sum(workers)
        dw = max(0, min(dw, room, st.max_workers - workers[i]))
    elif dw < 0:
        dw = -max(0, min(-dw, workers[i] - max(1, st.min_workers)))
    workers[i] += dw
    if db > 0:
        room = obs.memory_limit_bytes - sum(buffers)
        buffers[i] += max(0, min(buffer_step_bytes, room))
    elif db < 0:
        buffers[i] = max(MIN_BUFFER_BYTES, buffers[i] - buffer_step_bytes)
    return Allocation(tuple(workers), tuple(buffers))


def action_mask(
    obs: Observation, buffer_step_bytes: int = 16 * MiB, oversubscribe: float = 2.0
) -> np.ndarray:
    """``int8`` mask of actions that change the allocation (the no-op is always allowed)."""
    n = len(obs.stages)
    current = obs.allocation()
    mask = np.zeros(action_count(n), dtype=np.int8)
    mask[0] = 1
    for a in range(1, action_count(n)):
        mask[a] = apply_action(obs, a, buffer_step_bytes, oversubscribe) != current
    return mask


def encode_observation(obs: Observation, ref_throughput: float) -> np.ndarray:
    """Observation vector of length ``STAGE_FEATURES * n + GLOBAL_FEATURES`` (float32)."""
    cpus = max(obs.cpus, 1e-9)
    limit = max(obs.memory_limit_bytes, 1)
    feats: list[float] = []
    for s in obs.stages:
        feats += [
            s.workers / cpus,
            s.buffer_bytes / limit,
            s.busy,
            s.blocked_in,
            s.blocked_out,
            s.buffer_fill,
            float(s.io_bound),
        ]
    feats += [
        obs.throughput / ref_throughput if ref_throughput > 0 else 0.0,
        max(0.0, 1.0 - sum(obs.workers) / cpus),
        max(0.0, 1.0 - obs.memory_used_bytes / limit),
        obs.latency_s / (1.0 + obs.latency_s),
        obs.cpus / 128.0,
        obs.cpu_ghz / 5.0,
    ]
    return np.clip(np.asarray(feats, dtype=np.float32), 0.0, _FEATURE_MAX)


def reward(obs: Observation, ref_throughput: float, margin: float = 0.1) -> float:
    """Normalised throughput scaled down linearly to 0 over the last ``margin`` of memory."""
    if obs.oom or ref_throughput <= 0:
        return 0.0
    headroom = 1.0 - obs.memory_used_bytes / max(obs.memory_limit_bytes, 1)
    return float(obs.throughput / ref_throughput * min(1.0, max(0.0, headroom / margin)))


class PipeEnv(gymnasium.Env):
    """InTune-style tuning of a simulated pipeline as a Gymnasium environment.

    Args:
        n_stages: pipeline length (fixes the spaces); used with :func:`generate` when no
            ``workload`` is given, drawing a new pipeline per episode.
        workload: a fixed workload instead (its length must equal ``n_stages``).
        cpus: CPUs, a number or a schedule ``[(t_start_s, cpus), ...]``.
        memory_limit_bytes: memory limit; default: room for ``2 * cpus`` workers + 2 GiB.
        episode_steps: steps before truncation.
        buffer_step_bytes: size of one buffer action.
        initial: ``"even"`` (InTune's start: CPUs split evenly), ``"min"`` or ``"random"``.
        noise: the simulator's measurement noise.
        workload_fn: ``seed -> Workload`` drawing episodes' workloads (overrides the default).

    Example:
        >>> env = PipeEnv(n_stages=5, cpus=[(0, 32), (100, 64)])
        >>> obs, info = env.reset(seed=0)
        >>> obs, r, terminated, truncated, info = env.step(env.action_space.sample())
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        n_stages: int = 5,
        workload: Workload | None = None,
        cpus: float | Sequence[tuple[float, float]] = 32,
        memory_limit_bytes: int | None = None,
        episode_steps: int = 200,
        buffer_step_bytes: int = 16 * MiB,
        initial: str = "even",
        noise: float = 0.02,
        workload_fn: Callable[[int], Workload] | None = None,
    ) -> None:
        if workload is not None and len(workload.stages) != n_stages:
            raise ValueError(
                f"PipeEnv: workload {workload.name!r} has {len(workload.stages)} stages, "
                f"n_stages is {n_stages}"
            )
        if initial not in ("even", "min", "random"):
            raise ValueError(f"PipeEnv: initial must be even, min or random, got {initial!r}")
        self.n_stages = n_stages
        self._fixed = workload
        self._workload_fn = workload_fn or (lambda seed: generate(n_stages, seed))
        self._cpus = cpus
        self._memory = memory_limit_bytes
        self.episode_steps = episode_steps
        self.buffer_step_bytes = buffer_step_bytes
        self.initial = initial
        self.noise = noise
        self.action_space = gymnasium.spaces.Discrete(action_count(n_stages))
        size = STAGE_FEATURES * n_stages + GLOBAL_FEATURES
        self.observation_space = gymnasium.spaces.Box(0.0, _FEATURE_MAX, (size,), np.float32)
        self.sim: SimPipeline | None = None
        self._obs: Observation | None = None
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start an episode on a fresh (or the fixed) workload; returns ``(obs, info)``."""
        super().reset(seed=seed)
        rng = self.np_random
        wl_seed = int(rng.integers(0, 10_000))  # seeds >= 10_000 are kept for held-out tests
        wl = self._fixed or self._workload_fn(wl_seed)
        if len(wl.stages) != self.n_stages:
            raise ValueError(
                f"PipeEnv: workload_fn gave {len(wl.stages)} stages, expected {self.n_stages}"
            )
        cpus_max = (
            self._cpus if isinstance(self._cpus, int | float) else max(c for _, c in self._cpus)
        )
        memory = self._memory or int(
            2 * cpus_max * wl.worker_rss_bytes
            + sum(s.resident_bytes for s in wl.stages)
            + 2048 * MiB
        )
        self.sim = SimPipeline(
            wl, self._cpus, memory, seed=int(rng.integers(0, 2**31)), noise=self.noise
        )
        obs = self.sim.observe()
        self.sim.apply(self._initial_allocation(obs, rng))
        self._obs = self.sim.observe()
        self._steps = 0
        return self._encode(self._obs), self._info(self._obs)

    def step(self, action):
        """Apply one action, advance one interval; returns the Gymnasium 5-tuple."""
        if self.sim is None or self._obs is None:
            raise RuntimeError("PipeEnv.step() called before reset()")
        self.sim.apply(apply_action(self._obs, int(action), self.buffer_step_bytes))
        obs = self.sim.observe()
        self._obs = obs
        self._steps += 1
        r = reward(obs, self.sim.upper_bound(obs.cpus))
        truncated = self._steps >= self.episode_steps and not obs.oom
        return self._encode(obs), r, bool(obs.oom), truncated, self._info(obs)

    def _encode(self, obs: Observation) -> np.ndarray:
        return encode_observation(obs, self.sim.upper_bound(obs.cpus))

    def _info(self, obs: Observation) -> dict:
        return {
            "action_mask": action_mask(obs, self.buffer_step_bytes),
            "throughput": obs.throughput,
            "upper_bound": self.sim.upper_bound(obs.cpus),
            "oom": obs.oom,
        }

    def _initial_allocation(self, obs: Observation, rng: np.random.Generator) -> Allocation:
        n = self.n_stages
        lo = [s.min_workers for s in obs.stages]
        hi = [s.max_workers for s in obs.stages]
        if self.initial == "min":
            workers = lo
        elif self.initial == "even":
            workers = [max(1, int(obs.cpus) // n)] * n
        else:
            workers = [int(rng.integers(1, max(2, int(obs.cpus) // 2))) for _ in range(n)]
        workers = [min(h, max(lo_, w)) for w, lo_, h in zip(workers, lo, hi, strict=True)]
        return Allocation(tuple(workers), (self.sim.workload.initial_buffer_bytes,) * n)


def register() -> None:
    """Register ``"TorchtunePipe-v0"`` with Gymnasium (idempotent)."""
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="torchtune_pipe.sim.gym:PipeEnv")
