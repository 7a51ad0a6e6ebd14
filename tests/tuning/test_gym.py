"""The Gymnasium environment is the InTune agent's own task: its state, actions, masks, reward."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from torchtune_pipe.sim.workloads import netflix_like
from torchtune_pipe.tuning.intune import gym as sim_gym
from torchtune_pipe.tuning.intune.gym import PipeEnv
from torchtune_pipe.tuning.intune.space import ActionSpace
from torchtune_pipe.tuning.intune.state import StateEncoder
from torchtune_pipe.tuning.safety import MAX_OVERSUBSCRIBE, within_limits


def test_env_passes_gymnasium_checker():
    env = PipeEnv(n_stages=4, episode_steps=20, reference="upper_bound")
    check_env(env, skip_render_check=True)


def test_spaces_are_the_agents():
    env = PipeEnv(n_stages=3, episode_steps=5)
    assert env.action_space.n == ActionSpace(3).n == 2 + 6 * 3
    assert env.observation_space.shape == (StateEncoder(3).dim,) == (11 * 3 + 16,)


def test_an_action_index_means_the_agents_allocation_change():
    env = PipeEnv(n_stages=5, workload=netflix_like(0), cpus=16, episode_steps=10)
    _, info = env.reset(seed=1)
    space = ActionSpace(5)
    for index in range(space.n):
        if not info["action_mask"][index]:
            continue
        pending = env.tuner.pending
        want = space.apply(pending.current, index, pending.obs, pending.planned)
        _, _, terminated, _, info = env.step(index)
        # What ran is the agent's change as the hard limits let it through, as live.
        assert env.sim.allocation.workers == within_limits(want, pending.obs).workers, index
        assert env.sim.allocation.buffer_bytes == within_limits(want, pending.obs).buffer_bytes
        assert env.actions.decode(index) == space.decode(index)
        if terminated:
            break


def test_episode_with_random_masked_actions_keeps_the_limits():
    env = PipeEnv(n_stages=5, workload=netflix_like(0), cpus=[(0, 8), (5, 32)], episode_steps=12)
    _, info = env.reset(seed=3)
    assert info["action_mask"][0] == 1
    env.action_space.seed(0)
    rewards, done = [], False
    while not done:
        decided_on = env.observation
        action = env.action_space.sample(mask=info["action_mask"])
        _, r, terminated, truncated, info = env.step(action)
        rewards.append(r)
        done = terminated or truncated
        ran = env.sim.allocation
        assert within_limits(ran, decided_on).workers == ran.workers
        assert sum(ran.workers) <= MAX_OVERSUBSCRIBE * decided_on.cpus
        assert min(ran.buffer_bytes) >= 1 << 20
        for w, st in zip(ran.workers, decided_on.stages, strict=True):
            assert st.min_workers <= w <= st.max_workers
    assert len(rewards) == 12 and truncated and not terminated
    assert all(-1.0 < r <= 1.0 for r in rewards)
    assert env.sim.cpus_at(env.sim.t) == 32


def test_env_rejects_wrong_length_workload_and_bad_arguments():
    with pytest.raises(ValueError, match="stages"):
        PipeEnv(n_stages=3, workload=netflix_like(0))
    with pytest.raises(ValueError, match="reference"):
        PipeEnv(n_stages=3, reference="best")
    env = PipeEnv(n_stages=3, episode_steps=2, reference="upper_bound")
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(0)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step(env.action_space.n)


def test_register_is_lazy_and_idempotent():
    sim_gym.register()
    sim_gym.register()
    env = gymnasium.make(sim_gym.ENV_ID, n_stages=3, episode_steps=5, reference="upper_bound")
    obs, _ = env.reset(seed=0)
    assert obs.shape == (StateEncoder(3).dim,) and obs.dtype == np.float32
    env.close()
