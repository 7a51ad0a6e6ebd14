"""A small Double-DQN learner: Q network, epsilon schedule, replay and target network.

The network is a three-layer ReLU MLP that maps a state vector to one Q value per discrete
action; invalid actions are masked to ``-inf`` before the arg-max. Acting uses the plain
``torch.nn`` module (tens of microseconds per call).

Two learners implement the same update (replay, Double-DQN target with the next state's
action mask, Huber loss, gradient clipping, soft target update):

- ``backend="torch"`` (default): a preallocated ring buffer and the update written out in
  plain torch. One update of a 64-transition batch costs ~2.0 ms on one thread.
- ``backend="torchrl"``: torchrl's ``ReplayBuffer`` + ``LazyTensorStorage``, ``DQNLoss`` and
  ``SoftUpdate``. The same update costs ~6.6 ms (TensorDict bookkeeping around a tiny net),
  3.3x more, which is most of the pre-training budget; and torchrl is an optional extra,
  while fine-tuning must work wherever the tuner runs. It is kept as the reference the plain
  learner is tested against.

Nothing here knows about pipelines: :mod:`torchtune_pipe.tuning.intune.agent` turns observations
into states, masks and rewards.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DQNConfig:
    """Hyper-parameters of :class:`DQNAgent`.

    Attributes:
        hidden: width of the two hidden layers.
        lr: Adam learning rate.
        gamma: discount factor.
        batch_size: transitions per gradient step.
        replay_size: capacity of the replay buffer (transitions).
        tau: soft target update rate (target <- (1 - tau) * target + tau * online).
        double_dqn: use the online network to pick the next action (van Hasselt et al.).
        eps_start: exploration rate at step 0.
        eps_end: exploration rate after ``eps_decay_steps``.
        eps_decay_steps: steps of linear decay from ``eps_start`` to ``eps_end``.
        grad_clip: max gradient norm per update.
        warmup: transitions stored before the first gradient step.
    """

    hidden: int = 128
    lr: float = 1e-3
    gamma: float = 0.9
    batch_size: int = 64
    replay_size: int = 50_000
    tau: float = 0.01
    double_dqn: bool = True
    eps_start: float = 1.0
    eps_end: float = 0.05
    eps_decay_steps: int = 10_000
    grad_clip: float = 10.0
    warmup: int = 256

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.batch_size < 1 or self.replay_size < self.batch_size:
            raise ValueError(
                f"DQNConfig: need hidden >= 1 and replay_size >= batch_size >= 1, got "
                f"hidden={self.hidden}, batch_size={self.batch_size}, "
                f"replay_size={self.replay_size}"
            )
        if not 0.0 <= self.gamma < 1.0:
            raise ValueError(f"DQNConfig: gamma must be in [0, 1), got {self.gamma}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"DQNConfig: tau must be in (0, 1], got {self.tau}")


class EpsilonSchedule:
    """Linear epsilon decay from ``start`` to ``end`` over ``decay_steps`` steps."""

    def __init__(self, start: float, end: float, decay_steps: int) -> None:
        if decay_steps < 0 or not (0.0 <= end <= 1.0 and 0.0 <= start <= 1.0):
            raise ValueError(
                f"EpsilonSchedule: need 0 <= end, start <= 1 and decay_steps >= 0, got "
                f"start={start}, end={end}, decay_steps={decay_steps}"
            )
        self.start, self.end, self.decay_steps = start, end, decay_steps

    def __call__(self, step: int) -> float:
        if self.decay_steps == 0 or step >= self.decay_steps:
            return self.end
        return self.start + (self.end - self.start) * step / self.decay_steps


def q_network(n_obs: int, n_actions: int, hidden: int) -> nn.Sequential:
    """The three-layer ReLU MLP: ``n_obs -> hidden -> hidden -> n_actions``."""
    return nn.Sequential(
        nn.Linear(n_obs, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, n_actions),
    )


class DQNAgent:
    """Q network plus (optionally) the machinery to learn it.

    Args:
        n_obs: length of the state vector.
        n_actions: number of discrete actions.
        config: hyper-parameters.
        seed: seeds weight initialisation, exploration and replay sampling (private
            generators; the global torch RNG is left alone).
        train: build the replay buffer, target network and optimizer.
        backend: ``"torch"`` or ``"torchrl"`` (see the module docstring).

    Example:
        >>> agent = DQNAgent(4, 3, DQNConfig(hidden=16, warmup=8, batch_size=8))
        >>> a = agent.act(torch.zeros(4), torch.ones(3, dtype=torch.bool), epsilon=0.0)
    """

    def __init__(
        self,
        n_obs: int,
        n_actions: int,
        config: DQNConfig | None = None,
        *,
        seed: int = 0,
        train: bool = False,
        backend: str = "torch",
    ) -> None:
        if backend not in _LEARNERS:
            raise ValueError(
                f"DQNAgent: backend must be one of {sorted(_LEARNERS)}, got {backend!r}"
            )
        self.backend = backend
        if n_obs < 1 or n_actions < 1:
            raise ValueError(
                f"DQNAgent: n_obs and n_actions must be >= 1, got {n_obs}, {n_actions}"
            )
        self.n_obs, self.n_actions = n_obs, n_actions
        self.config = config or DQNConfig()
        self.epsilon = EpsilonSchedule(
            self.config.eps_start, self.config.eps_end, self.config.eps_decay_steps
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.q = q_network(n_obs, n_actions, self.config.hidden)
        self._rng = torch.Generator().manual_seed(seed + 1)
        self.updates = 0
        self._learner: _TorchLearner | _TorchRLLearner | None = None
        if train:
            self.enable_training(seed=seed)

    # -- acting ---------------------------------------------------------------------------
    @torch.no_grad()
    def q_values(self, state: torch.Tensor) -> torch.Tensor:
        """Q values of every action for one state (1-D) or a batch (2-D)."""
        return self.q(state)

    @torch.no_grad()
    def act(self, state: torch.Tensor, mask: torch.Tensor, epsilon: float = 0.0) -> int:
        """Epsilon-greedy action among those allowed by ``mask`` (bool, one per action).

        Raises:
            ValueError: when ``mask`` allows no action.
        """
        allowed = torch.nonzero(mask, as_tuple=False).flatten()
        if allowed.numel() == 0:
            raise ValueError("DQNAgent.act: the action mask allows no action")
        if epsilon > 0.0 and torch.rand((), generator=self._rng).item() < epsilon:
            pick = torch.randint(allowed.numel(), (), generator=self._rng).item()
            return int(allowed[pick])
        q = self.q(state)
        q = torch.where(mask, q, torch.full_like(q, float("-inf")))
        return int(torch.argmax(q))

    # -- learning -------------------------------------------------------------------------
    def enable_training(self, *, seed: int = 0, config: DQNConfig | None = None) -> None:
        """Build replay buffer, target network and optimizer (``config`` replaces the old)."""
        if config is not None:
            self.config = config
            self.epsilon = EpsilonSchedule(config.eps_start, config.eps_end, config.eps_decay_steps)
        self._learner = _LEARNERS[self.backend](self.q, self.config, seed)

    @property
    def training_enabled(self) -> bool:
        return self._learner is not None

    def remember(
        self,
        state: torch.Tensor,
        mask: torch.Tensor,
        action: int,
        reward: float,
        next_state: torch.Tensor,
        next_mask: torch.Tensor,
        done: bool,
    ) -> None:
        """Store one transition in the replay buffer."""
        self._require_learner("remember").add(
            state, mask, action, reward, next_state, next_mask, done
        )

    def learn(self) -> float | None:
        """One gradient step on a replay batch plus a soft target update.

        Returns:
            The loss, or None while the buffer holds fewer than ``config.warmup`` transitions.
        """
        loss = self._require_learner("learn").update()
        if loss is not None:
            self.updates += 1
        return loss

    def _require_learner(self, what: str) -> _TorchLearner | _TorchRLLearner:
        if self._learner is None:
            raise RuntimeError(
                f"DQNAgent.{what}: training is not enabled; build with train=True or call "
                "enable_training()"
            )
        return self._learner

    # -- persistence ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Weights and shape; enough to rebuild the acting network."""
        return {
            "n_obs": self.n_obs,
            "n_actions": self.n_actions,
            "config": asdict(self.config),
            "q": {k: v.detach().clone() for k, v in self.q.state_dict().items()},
            "updates": self.updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load weights saved by :meth:`state_dict` (shapes must match).

        Raises:
            ValueError: when the saved network has another shape.
        """
        if (state["n_obs"], state["n_actions"]) != (self.n_obs, self.n_actions):
            raise ValueError(
                f"DQNAgent.load_state_dict: saved net is {state['n_obs']}->{state['n_actions']}, "
                f"this agent is {self.n_obs}->{self.n_actions}"
            )
        self.q.load_state_dict(state["q"])
        self.updates = int(state.get("updates", 0))
        if self._learner is not None:
            self._learner.sync_target()

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, train: bool = False) -> DQNAgent:
        """Rebuild an agent from :meth:`state_dict` output."""
        agent = cls(
            int(state["n_obs"]),
            int(state["n_actions"]),
            DQNConfig(**state["config"]),
            train=train,
        )
        agent.load_state_dict(state)
        return agent


class _TorchLearner:
    """Ring-buffer replay and the Double-DQN update in plain torch."""

    def __init__(self, q: nn.Module, config: DQNConfig, seed: int) -> None:
        self.q, self.config = q, config
        self.target = copy.deepcopy(q).requires_grad_(False)
        self.optim = torch.optim.Adam(q.parameters(), lr=config.lr)
        self._rng = torch.Generator().manual_seed(seed + 2)
        n_obs = q[0].in_features
        n_act = q[-1].out_features
        size = config.replay_size
        self.s = torch.zeros(size, n_obs)
        self.a = torch.zeros(size, dtype=torch.long)
        self.r = torch.zeros(size)
        self.s2 = torch.zeros(size, n_obs)
        self.m2 = torch.zeros(size, n_act, dtype=torch.bool)
        self.done = torch.zeros(size)
        self.size = self.pos = 0

    def add(self, state, mask, action, reward, next_state, next_mask, done) -> None:
        i = self.pos
        self.s[i], self.a[i], self.r[i] = state, int(action), float(reward)
        self.s2[i], self.m2[i], self.done[i] = next_state, next_mask, float(bool(done))
        self.pos = (i + 1) % self.config.replay_size
        self.size = min(self.size + 1, self.config.replay_size)

    def update(self) -> float | None:
        cfg = self.config
        if self.size < max(cfg.warmup, cfg.batch_size):
            return None
        idx = torch.randint(self.size, (cfg.batch_size,), generator=self._rng)
        s, a, r, s2, m2, done = (
            self.s[idx], self.a[idx], self.r[idx], self.s2[idx], self.m2[idx], self.done[idx]
        )  # fmt: skip
        with torch.no_grad():
            online = self.q(s2).masked_fill(~m2, float("-inf"))
            if cfg.double_dqn:
                nxt = self.target(s2).gather(1, online.argmax(1, keepdim=True)).squeeze(1)
            else:
                nxt = self.target(s2).masked_fill(~m2, float("-inf")).amax(1)
            target = r + cfg.gamma * (1.0 - done) * nxt
        pred = self.q(s).gather(1, a[:, None]).squeeze(1)
        loss = nn.functional.smooth_l1_loss(pred, target)
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.q.parameters(), cfg.grad_clip)
        self.optim.step()
        with torch.no_grad():
            for p, tp in zip(self.q.parameters(), self.target.parameters(), strict=True):
                tp.lerp_(p, cfg.tau)
        return float(loss.detach())

    def sync_target(self) -> None:
        self.target.load_state_dict(self.q.state_dict())


class _TorchRLLearner:
    """torchrl plumbing: replay buffer, Double-DQN loss with action masks, soft target."""

    def __init__(self, q: nn.Module, config: DQNConfig, seed: int) -> None:
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        from torchrl.modules import QValueActor
        from torchrl.objectives import DQNLoss, SoftUpdate

        self._td = TensorDict
        self.config = config
        self.actor = QValueActor(
            q, in_keys=["observation"], action_space="categorical", action_mask_key="action_mask"
        )
        self.loss = DQNLoss(
            self.actor,
            loss_function="smooth_l1",
            delay_value=True,
            double_dqn=config.double_dqn,
            action_space="categorical",
        )
        self.loss.make_value_estimator(gamma=config.gamma)
        self.target = SoftUpdate(self.loss, tau=config.tau)
        self.params = [p for p in self.loss.parameters() if p.requires_grad]
        self.optim = torch.optim.Adam(self.params, lr=config.lr)
        self.replay = ReplayBuffer(
            storage=LazyTensorStorage(config.replay_size),
            batch_size=config.batch_size,
            generator=torch.Generator().manual_seed(seed + 2),
        )

    def add(self, state, mask, action, reward, next_state, next_mask, done) -> None:
        done_t = torch.tensor([bool(done)])
        td = self._td(
            {
                "observation": state.float(),
                "action_mask": mask.bool(),
                "action": torch.tensor(int(action)),
                "next": {
                    "observation": next_state.float(),
                    "action_mask": next_mask.bool(),
                    "reward": torch.tensor([float(reward)]),
                    "done": done_t,
                    "terminated": done_t.clone(),
                },
            },
            batch_size=[],
        )
        self.replay.add(td)

    def update(self) -> float | None:
        if len(self.replay) < max(self.config.warmup, self.config.batch_size):
            return None
        batch = self.replay.sample()
        loss = self.loss(batch)["loss"]
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        self.optim.step()
        self.target.step()
        return float(loss.detach())

    def sync_target(self) -> None:
        self.target.init_()


_LEARNERS = {"torch": _TorchLearner, "torchrl": _TorchRLLearner}
