"""The Gymnasium environment and its action/observation/reward encoding."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from torchtune_pipe.sim import gym as sim_gym
from torchtune_pipe.sim.gym import (
    PipeEnv,
    action_count,
    action_mask,
    apply_action,
    decode_action,
    encode_observation,
    reward,
)
from torchtune_pipe.sim.workloads import netflix_like
from torchtune_pipe.tuning.base import MiB, Observation, StageStats


def make_obs(workers=(2, 3), buffers=(4 * MiB, 4 * MiB), cpus=8, used=0, limit=1024 * MiB):
    stages = tuple(
        StageStats(f"s{i}", w, min_workers=1, max_workers=10, buffer_bytes=b, busy=0.5)
        for i, (w, b) in enumerate(zip(workers, buffers, strict=True))
    )
    return Observation(stages, 100.0, cpus, limit, used, latency_s=0.5, cpu_ghz=2.5)


def test_env_passes_gymnasium_checker():
    env = PipeEnv(n_stages=4, episode_steps=20)
    check_env(env, skip_render_check=True)


def test_env_with_fixed_workload_and_schedule_runs_an_episode():
    env = PipeEnv(n_stages=5, workload=netflix_like(0), cpus=[(0, 8), (5, 32)], episode_steps=10)
    obs, info = env.reset(seed=3)
    assert obs.shape == env.observation_space.shape and info["action_mask"][0] == 1
    rewards, done = [], False
    while not done:
        obs, r, terminated, truncated, info = env.step(env.action_space.sample())
        rewards.append(r)
        done = terminated or truncated
    assert len(rewards) == 10 and truncated and not terminated
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert env.sim.cpus_at(env.sim.t) == 32


def test_env_rejects_wrong_length_workload():
    with pytest.raises(ValueError, match="stages"):
        PipeEnv(n_stages=3, workload=netflix_like(0))


def test_decode_action_layout():
    n = 3
    assert action_count(n) == 19
    assert decode_action(0, n) is None
    assert decode_action(1, n) == (0, 1, 0)
    assert decode_action(4, n) == (0, -5, 0)
    assert decode_action(7, n) == (1, 1, 0)
    assert decode_action(18, n) == (2, 0, -1)
    with pytest.raises(ValueError, match="0..18"):
        decode_action(19, n)


def test_apply_action_respects_limits():
    obs = make_obs(workers=(2, 3), cpus=4)
    # +5 workers on stage 0: total capped at cpus * oversubscribe = 8 -> +3.
    assert apply_action(obs, 3).workers == (5, 3)
    assert apply_action(obs, 3, oversubscribe=1.0).workers == (2, 3)  # already at 5 > 4
    assert apply_action(obs, 4).workers == (1, 3)  # -5 stops at one worker
    assert apply_action(obs, 5).buffer_bytes == (20 * MiB, 4 * MiB)
    assert apply_action(obs, 6).buffer_bytes == (1 * MiB, 4 * MiB)
    mask = action_mask(obs, oversubscribe=1.0)
    assert mask[0] == 1 and mask[1] == 0 and mask[2] == 1


def test_reward_falls_to_zero_near_memory_limit():
    limit = 1000 * MiB
    assert reward(make_obs(used=0, limit=limit), 200.0) == pytest.approx(0.5)
    assert reward(make_obs(used=int(0.95 * limit), limit=limit), 200.0) == pytest.approx(0.25)
    assert reward(make_obs(used=limit, limit=limit), 200.0) == 0.0
    oom = Observation(make_obs().stages, 100.0, 8, limit, 0, oom=True)
    assert reward(oom, 200.0) == 0.0


def test_encode_observation_is_bounded_and_sized():
    v = encode_observation(make_obs(), 200.0)
    assert v.dtype == np.float32
    assert v.shape == (sim_gym.STAGE_FEATURES * 2 + sim_gym.GLOBAL_FEATURES,)
    assert v[0] == pytest.approx(2 / 8) and v[2] == pytest.approx(0.5)
    assert np.all(v >= 0) and np.all(v <= 4)


def test_register_is_lazy_and_idempotent():
    sim_gym.register()
    sim_gym.register()
    env = gymnasium.make(sim_gym.ENV_ID, n_stages=3, episode_steps=5)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (3 * sim_gym.STAGE_FEATURES + sim_gym.GLOBAL_FEATURES,)
    env.close()
