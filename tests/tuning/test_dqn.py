"""The DQN learner: network shape, masking, epsilon schedule, learning and persistence."""

from __future__ import annotations

import pytest
import torch

from torchtune_pipe.tuning.intune.dqn import DQNAgent, DQNConfig, EpsilonSchedule, q_network


def test_q_network_is_three_relu_layers():
    net = q_network(7, 5, 16)
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(7, 16), (16, 16), (16, 5)]
    assert sum(isinstance(m, torch.nn.ReLU) for m in net) == 2
    assert net(torch.zeros(3, 7)).shape == (3, 5)


def test_epsilon_schedule_decays_linearly_then_holds():
    eps = EpsilonSchedule(1.0, 0.1, 10)
    assert eps(0) == 1.0
    assert eps(5) == pytest.approx(0.55)
    assert eps(10) == eps(1000) == 0.1
    with pytest.raises(ValueError, match="decay_steps"):
        EpsilonSchedule(1.0, 0.1, -1)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="gamma"):
        DQNConfig(gamma=1.0)
    with pytest.raises(ValueError, match="replay_size"):
        DQNConfig(batch_size=64, replay_size=10)


def test_act_never_picks_a_masked_action():
    agent = DQNAgent(4, 6, DQNConfig(hidden=8), seed=3)
    mask = torch.tensor([False, True, False, False, True, False])
    state = torch.randn(4)
    for eps in (0.0, 1.0):
        picks = {agent.act(state, mask, epsilon=eps) for _ in range(50)}
        assert picks <= {1, 4}
    with pytest.raises(ValueError, match="allows no action"):
        agent.act(state, torch.zeros(6, dtype=torch.bool))


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        DQNAgent(3, 2, backend="jax")


def test_learn_requires_training_enabled():
    agent = DQNAgent(3, 2, DQNConfig(hidden=8))
    with pytest.raises(RuntimeError, match="training is not enabled"):
        agent.learn()


@pytest.mark.parametrize("backend", ["torch", "torchrl"])
def test_learns_a_contextual_bandit(backend, one_thread):
    """Reward 1 for the action named by the state's arg-max: greedy accuracy must be high."""
    if backend == "torchrl":
        pytest.importorskip("torchrl")
    cfg = DQNConfig(hidden=32, lr=3e-3, batch_size=32, warmup=32, replay_size=2000)
    agent = DQNAgent(4, 4, cfg, seed=0, train=True, backend=backend)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, dtype=torch.bool)
    losses = []
    for _ in range(400):
        s = torch.rand(4, generator=g)
        a = agent.act(s, mask, epsilon=1.0)
        r = 1.0 if a == int(torch.argmax(s)) else 0.0
        agent.remember(s, mask, a, r, torch.rand(4, generator=g), mask, True)
        loss = agent.learn()
        if loss is not None:
            losses.append(loss)
    assert agent.updates == len(losses) > 300
    states = torch.rand(200, 4, generator=g)
    hits = sum(agent.act(s, mask) == int(torch.argmax(s)) for s in states)
    assert hits / 200 > 0.8


def test_state_dict_round_trip_gives_identical_q_values():
    agent = DQNAgent(5, 3, DQNConfig(hidden=8), seed=1)
    clone = DQNAgent.from_state_dict(agent.state_dict())
    x = torch.randn(10, 5)
    assert torch.equal(agent.q_values(x), clone.q_values(x))
    other = DQNAgent(5, 4, DQNConfig(hidden=8))
    with pytest.raises(ValueError, match="saved net is 5->3"):
        other.load_state_dict(agent.state_dict())


def test_seed_makes_initial_weights_reproducible_without_touching_global_rng():
    before = torch.random.get_rng_state()
    a = DQNAgent(5, 3, DQNConfig(hidden=8), seed=7)
    b = DQNAgent(5, 3, DQNConfig(hidden=8), seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(a.q[0].weight, b.q[0].weight)
