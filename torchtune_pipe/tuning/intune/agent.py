"""InTune: a DQN agent that moves CPUs and buffer memory between pipeline stages.

One step (:meth:`InTuneTuner.step`) is :meth:`~InTuneTuner.prepare`, a choice, and
:meth:`~InTuneTuner.take`:

1. ``prepare`` starts from the allocation that ran (the observation's: the hard limits may have
   changed the last decision), then: after a CPU-count change carries it over
   (:func:`~.intune_space.rescale`); else undoes a worker move after which throughput fell by
   more than ``REVERT_DROP`` (the move is masked for ``TABU_STEPS`` steps, and the undo is the
   step's only worker move); else returns to the
   best allocation of the last ``GUARD_WINDOW`` steps when the current one is worse by more
   than ``GUARD_DROP``. It computes the planner's allocation (:func:`~.planner.plan`, each
   stage's workers charged what the guard's memory model says they hold), encodes the state
   (:class:`~.intune_state.StateEncoder`) and masks the actions
   (:meth:`~.intune_space.ActionSpace.mask`).
2. The Q network (:mod:`~torchtune_pipe.tuning.intune.dqn`) takes the masked arg-max; the plan action
   is taken without asking it when the plan promises more than ``PLAN_MIN_GAIN``, and shut
   when it starts more worker processes for less than ``GROW_MIN_GAIN``.
3. ``take`` applies the action (:meth:`~.intune_space.ActionSpace.apply`).

**Actions** (``2 + 6 * n_stages``): the no-op; per stage ``+1, -1, +5, -5`` workers, buffer
up, buffer down (geometric steps of 50 % in whole MiB, at least 1 MiB); last, "plan": every
stage's workers from the planner, and which stages run fused. **Fusion** is the plan's: the
network was trained before the knob existed and keeps deciding workers and buffers on the
shape the plan chose (its moves on a fused stage, which has no workers or buffer of its own,
are masked); re-training it for the knob would cost every weight file for what the plan's
model already decides (BENCHMARKS.md, "Fusion in the simulator"). **Reward**
(:func:`~.intune_state.transition_reward`): throughput over a reference, times a factor that
is 1 up to ``MEMORY_KNEE`` of the memory limit and falls by a smoothstep to 0 at the limit,
less ``CHANGE_COST`` for a move; ``-1`` on an OOM, which ends the episode. The reference is the
simulator's oracle offline and the best throughput seen since the CPU count last changed
online.

With a cluster the split between host and cluster is the plan's (:mod:`~.intune_cluster`):
the network's worker moves on a stage that runs remote workers are masked, and an action that
moves workers between host and cluster is judged once they have started.

The tuner proposes; :class:`~.safety.Guarded` applies the hard limits to what it proposes. Why
the plan, the undo, the guard and the buffer floor: CONTRIBUTING.md, "The InTune learner";
the measurements: BENCHMARKS.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtune_pipe.tuning.base import Allocation, Observation, fuse_fusable, fusion_host
from torchtune_pipe.tuning.baselines import HeuristicTuner
from torchtune_pipe.tuning.intune.cluster import mask_split_moves, moves_split
from torchtune_pipe.tuning.intune.dqn import DQNAgent, DQNConfig
from torchtune_pipe.tuning.intune.space import (
    ACTIONS_PER_STAGE,
    BUFFER_GROW_MIN_FILL,
    MEMORY_SAFE_SHARE,
    WORKER_DELTAS,
    Action,
    ActionSpace,
    changes_processes,
    cpu_cap,
    mask_predicted_drops,
    rescale,
    reshape_to,
)
from torchtune_pipe.tuning.intune.state import (
    CHANGE_COST,
    GLOBAL_FEATURES,
    MEMORY_KNEE,
    STAGE_FEATURES,
    StateEncoder,
    memory_factor,
    reward,
    transition_reward,
)
from torchtune_pipe.tuning.intune.weights import (
    WEIGHTS_DIR,
    PlannerOnly,
    load_agent,
    shipped_lengths,
    weights_path,
)
from torchtune_pipe.tuning.item_costs import crossed_hops
from torchtune_pipe.tuning.planner import Plan, plan
from torchtune_pipe.tuning.safety import memory_parts

__all__ = [
    "ACTIONS_PER_STAGE",
    "BUFFER_GROW_MIN_FILL",
    "CHANGE_COST",
    "GLOBAL_FEATURES",
    "MEMORY_KNEE",
    "MEMORY_SAFE_SHARE",
    "STAGE_FEATURES",
    "WORKER_DELTAS",
    "Action",
    "ActionSpace",
    "InTuneTuner",
    "StateEncoder",
    "cpu_cap",
    "memory_factor",
    "rescale",
    "reward",
    "shipped_lengths",
    "weights_path",
    "WEIGHTS_DIR",
]

logger = logging.getLogger(__name__)


# A worker move after which throughput fell by more than this share is undone (measurement
# noise is a few percent per interval), and the action is masked for TABU_STEPS steps.
REVERT_DROP = 0.06
# Intervals a change of fusion shape may take to come into effect before it is judged anyway.
SETTLE_MAX = 3
TABU_STEPS = 10
# Back to the best allocation measured in the last GUARD_WINDOW steps when the current one is
# worse by more than GUARD_DROP (means of at least two intervals each).
GUARD_WINDOW = 20
GUARD_DROP = 0.05
# The plan is taken without asking the network when it promises this much more throughput.
PLAN_MIN_GAIN = 0.05
# A plan that starts more worker processes is open only when it promises this much more
# throughput: each process holds its memory (a Criteo reader ~60 MiB of parse buffers), and
# a plan that adds one for a fraction of a percent, by a model that is itself that noisy, only
# raises the run's peak.
GROW_MIN_GAIN = 0.02
# Fine-tuning online: exploration rate, and one gradient update per this many steps (with
# torch's default intra-op threads a tiny update can cost tens of ms of CPU on a busy machine,
# and the tuning loop must stay under 2 % of a core).
FINETUNE_EPSILON = 0.02
FINETUNE_LEARN_EVERY = 5
# Fine-tuning's learner: a small replay and a low learning rate, so live transitions correct
# the pre-trained weights without forgetting them.
FINETUNE_CONFIG = DQNConfig(
    lr=1e-4,
    batch_size=32,
    replay_size=2000,
    warmup=64,
    eps_start=FINETUNE_EPSILON,
    eps_end=FINETUNE_EPSILON,
)


@dataclass(frozen=True)
class Pending:
    """What :meth:`InTuneTuner.prepare` left for the action: the observation, the allocation
    the action changes, the plan (None: nothing measured to plan from) and the action mask."""

    obs: Observation
    current: Allocation
    planned: Plan | None
    mask: torch.Tensor


class InTuneTuner:
    """The InTune tuner: a pre-trained DQN agent, optionally fine-tuned online.

    Args:
        weights: a weight file, a directory holding ``intune_{n}stages.pt`` files, a state
            dict from :meth:`state_dict`, or None for the weights shipped with the package
            (chosen by pipeline length on :meth:`reset`; for a length without shipped
            weights, 1 stage or more than 8, the planner tunes alone, logged once).
        finetune: keep learning from live transitions (small replay, low epsilon).
        epsilon: exploration rate while fine-tuning (ignored otherwise); None follows the
            agent's epsilon schedule (pre-training).
        config: DQN hyper-parameters for learning; defaults suit fine-tuning.
        reference: throughput that normalises the reward; None uses the best throughput
            seen since the CPU count last changed.
        learn_every: steps per gradient update while learning (``FINETUNE_LEARN_EVERY``).
        plan_gain: take the planner's allocation without asking the network when it promises
            this share more throughput than measured (None: the network alone decides).
        fusion: the plan also decides which stages run fused (``planner.plan``); the network
            keeps deciding workers and buffers on the shape the plan chose. False: stages run
            as they are.
        seed: seeds exploration and replay sampling.
        plan_only: the planner tunes alone (the network's place is taken by a no-op, as for a
            pipeline length without weights): the agent's ablation, and the split between
            host and cluster as the planner alone makes it (``benchmarks/cluster_sim.py``).
            Registered as the ``"planner"`` tuner.
        plan_action: False shuts the plan action: the network alone moves workers and
            buffers, on the stages as they run (no fusion, no split between host and
            cluster), the agent's other ablation (``benchmarks/generalize.py``).

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
        epsilon: float | None = FINETUNE_EPSILON,
        config: DQNConfig | None = None,
        reference: Callable[[Observation], float] | None = None,
        learn_every: int = FINETUNE_LEARN_EVERY,
        plan_gain: float | None = PLAN_MIN_GAIN,
        fusion: bool = True,
        seed: int = 0,
        plan_only: bool = False,
        plan_action: bool = True,
    ) -> None:
        if learn_every < 1:
            raise ValueError(f"InTuneTuner: learn_every must be >= 1, got {learn_every}")
        if plan_only and not plan_action:
            raise ValueError("InTuneTuner: plan_only needs the plan action (plan_action=True)")
        self.learn_every = learn_every
        self.plan_only = plan_only
        self.plan_action = plan_action
        self.plan_gain = plan_gain if plan_action else None
        # Without the plan action nothing decides the shape: the stages run as they are.
        self.fusion = fusion and plan_action
        if plan_only:
            self.name = "planner"
        elif not plan_action:
            self.name = "network-only"
        self.weights = weights
        self.finetune = finetune
        self.epsilon = epsilon
        self.config = config or FINETUNE_CONFIG
        self.reference = reference
        self.seed = seed
        self.agent: DQNAgent | PlannerOnly | None = None
        self.actions: ActionSpace | None = None
        self.encoder: StateEncoder | None = None
        self._alloc: Allocation | None = None
        self._taken: int | None = None
        self.pending: Pending | None = None
        self._cpus = 0.0
        self._before: tuple[Allocation, float] | None = None
        self._tabu: dict[int, int] = {}
        # Per fusion shape a reshape to it was undone at this CPU count: times, and the step
        # until which the plan may not reshape to it again (TABU_STEPS, doubling each time).
        self._reshapes: dict[tuple[bool, ...], tuple[int, int]] = {}
        self._settling = False  # the last action changed the fusion shape (see step)
        self._in_effect = False  # while settling: the last interval ended in the new shape
        self._settled_for = 0  # intervals waited since the change of shape
        self._hops: list[float] = []
        self._held: list[float] = []
        self._last: Action | None = None
        self._prev: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.steps = 0
        self.last_reward = 0.0
        self.episode_reward = 0.0

    # -- Tuner ----------------------------------------------------------------------------
    @property
    def starts_fused(self) -> bool:
        """Whether the first allocation fuses every stage that may be fused (:meth:`begin`):
        the loader then starts the workers in that shape (:class:`~.base.Tuner`)."""
        return self.fusion

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        """Load the agent for this pipeline length; start from the even CPU split.

        Args:
            obs: the pipeline as it runs now.
            start: start from this allocation instead (pre-training uses random starts).
        """
        n = len(obs.stages)
        if self.agent is None or self.actions is None or self.actions.n_stages != n:
            self.agent = self._load_agent(n)
        return self.begin(obs, start)

    def begin(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        """Start an episode without choosing actions: :meth:`reset` less the agent, for a
        caller that picks the actions itself (the Gymnasium environment,
        :class:`torchtune_pipe.tuning.intune.gym.PipeEnv`). Returns the first allocation."""
        n = len(obs.stages)
        if self.actions is None or self.actions.n_stages != n:
            self.actions = ActionSpace(n)
            self.encoder = StateEncoder(n)
        self.encoder.reset()
        self._last, self._prev, self._taken = None, None, None
        self._before, self._tabu, self._reshapes = None, {}, {}
        self._settling = False
        self._in_effect, self._settled_for = False, 0
        self._hops: list[float] = []  # per channel, its hop when last crossed (prepare)
        self._held: list[float] = []  # per stage, a worker's memory when last split (prepare)
        self._seen: dict[tuple[tuple[int, ...], tuple[bool, ...]], list[tuple[int, float]]] = {}
        self._cpus = obs.cpus
        self.episode_reward = 0.0
        if start is None:
            start = HeuristicTuner().reset(obs)
            if self.fusion:
                # Start in the fewest processes, as torch's DataLoader runs a dataset and its
                # collate in one worker: splitting a stage costs nothing queued, fusing one
                # first drains what its own workers hold (seconds with full buffers).
                start = fused_start(start, obs)
        self._alloc = start
        return self._alloc

    def step(self, obs: Observation) -> Allocation:
        """Observe, learn from the last transition (fine-tuning), pick and apply one action."""
        if self.agent is None or self._alloc is None:
            return self.reset(obs)
        if self._settling and not self._settled(obs):
            # The last action changed which stages run fused: the interval since saw workers
            # retire and start and queued frames finish where they were, not the new shape's
            # rate. The first interval that starts in the new shape judges it (and may undo
            # it).
            return self._alloc
        state, mask = self.prepare(obs)
        if self.agent.training_enabled and self._prev is not None:
            ref = self.encoder.best
            if self.reference is not None:
                ref = max(ref, self.reference(obs))
            self.last_reward = transition_reward(obs, ref, self._last)
            self.episode_reward += self.last_reward
            s0, m0, a0 = self._prev
            self.agent.remember(s0, m0, a0, self.last_reward, state, mask, obs.oom)
            if self.steps % self.learn_every == 0:
                self.agent.learn()
        eps = self.epsilon if self.epsilon is not None else self.agent.epsilon(self.steps)
        index = self.agent.act(state, mask, eps if self.agent.training_enabled else 0.0)
        if self.plan_gain is not None and (self.plan_promises(self.plan_gain) or self.plan_trims()):
            index = self.actions.plan_index
        self._prev = (state, mask, index)
        return self.take(index)

    def prepare(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the choice of an action: the allocation it will change (undo,
        guard and rescale applied), the plan, the state and the action mask.

        Returns:
            (state vector, bool mask of the allowed actions).

        Raises:
            ValueError: when ``obs`` has another length than the pipeline :meth:`begin` saw.
        """
        if self.actions is None or self.encoder is None or self._alloc is None:
            raise RuntimeError("InTuneTuner.prepare() called before reset() or begin()")
        if len(obs.stages) != self.actions.n_stages:
            raise ValueError(
                f"InTuneTuner.step: pipeline has {len(obs.stages)} stages, the agent was reset "
                f"for {self.actions.n_stages}; call reset() for a new pipeline"
            )
        self.encoder.update_references(obs)
        current = self._ran(obs)
        undone = False
        if abs(obs.cpus - self._cpus) > 1e-6:
            current, self._cpus = rescale(current, obs, self._cpus), obs.cpus
            # What allocations delivered on the old CPU count says nothing now, nor which
            # moves cost throughput there.
            self._seen, self._tabu, self._reshapes = {}, {}, {}
        elif self._before is not None and obs.throughput < (1 - REVERT_DROP) * self._before[1]:
            # The last worker move cost throughput: undo it and keep it off for a while.
            current = self._before[0]
            if self._taken is not None:
                self._tabu[self._taken] = TABU_STEPS
            self._bar_reshape(obs, current)
            undone = True
        else:
            current = self._guard(obs, current)
        self._before = None
        # What each channel cost to cross when it last was: inside a fused group nothing
        # measures it (a group that ends in a collate sends batches, its rows cost far more).
        self._hops = [
            h if h > 0 else (self._hops[i] if i < len(self._hops) else 0.0)
            for i, h in enumerate(crossed_hops(obs))
        ]
        # What each stage's workers hold, as measured when it last ran split (a fused stage
        # measures none: its host's workers hold it).
        parts = memory_parts(obs)
        held, fixed = parts.per_worker_bytes, parts.fixed_bytes
        self._held = [
            held[i] if not s.fused else (self._held[i] if i < len(self._held) else 0.0)
            for i, s in enumerate(obs.stages)
        ]
        planned = plan(
            obs, current, per_worker_bytes=self._held, fixed_bytes=fixed,
            fusion=self.fusion, known_hops=self._hops,
        )  # fmt: skip
        state = self.encoder.encode(obs, current, self._last, planned)
        mask = mask_split_moves(self.actions.mask(obs, current, planned), obs, current)
        if not self.plan_action or (planned is not None and _grows_for_little(planned, current)):
            mask[self.actions.plan_index] = False
        mask_predicted_drops(mask, self.actions, obs, current, planned, REVERT_DROP)
        if undone:
            # The undo is this step's worker move: another one on top of it (the network's
            # next choice, with the move just undone barred) would be judged against the
            # interval that ran the undone move, and is not what that interval measured.
            mask &= ~self.actions.worker_moves()
        if planned is not None and self._reshape_barred(planned.allocation, current, obs):
            mask[self.actions.plan_index] = False
        for index, left in list(self._tabu.items()):
            mask[index] = False
            if left <= 1:
                del self._tabu[index]
            else:
                self._tabu[index] = left - 1
        self.pending = Pending(obs, current, planned, mask)
        return state, mask

    def _bar_reshape(self, obs: Observation, back: Allocation) -> None:
        """The move being undone (back to ``back``) changed which stages run fused: the plan
        may not make that reshape again at this CPU count for ``TABU_STEPS``, twice as long
        each time it is undone again (its model rated it above what ran, and was wrong: a
        reshape that frees or splits a stage's cache is where it errs)."""
        assert self._alloc is not None
        key = reshape_to(back, self._alloc, obs)
        if key is not None:
            times = self._reshapes.get(key, (0, 0))[0] + 1
            self._reshapes[key] = (times, self.steps + TABU_STEPS * 2 ** (times - 1))

    def _reshape_barred(self, a: Allocation, current: Allocation, obs: Observation) -> bool:
        """Whether going from ``current`` to ``a`` is a reshape :meth:`_bar_reshape` bars."""
        key = reshape_to(current, a, obs)
        bar = self._reshapes.get(key) if key is not None else None
        return bar is not None and self.steps < bar[1]

    def _open_plan(self) -> Plan | None:
        """The prepared plan when its action is open, else None."""
        p = self.pending
        assert p is not None and self.actions is not None
        return p.planned if p.planned is not None and p.mask[self.actions.plan_index] else None

    def plan_promises(self, gain: float) -> bool:
        """Whether the prepared plan promises more than ``gain`` over the measured throughput
        (and its action is open): then :meth:`step` takes it without asking the network."""
        planned = self._open_plan()
        return planned is not None and planned.throughput > (1 + gain) * planned.current

    def plan_trims(self) -> bool:
        """Whether the prepared plan runs fewer processes than the allocation in force for no
        less throughput by the same model (and its action is open): then :meth:`step` takes
        it too, since each process costs its memory (the undo judges it like any worker
        move). Not while workers run on a cluster (the split is judged apart)."""
        planned = self._open_plan()
        if planned is None:
            return False
        assert self.pending is not None
        a, now = planned.allocation, self.pending.current
        if any(a.remote) or any(now.remote):
            return False
        return _processes(a) < _processes(now) and planned.throughput >= planned.current

    def take(self, index: int) -> Allocation:
        """Take action ``index`` on the prepared allocation (:meth:`prepare`); returns the
        allocation to apply."""
        p = self.pending
        if p is None or self.actions is None:
            raise RuntimeError("InTuneTuner.take() called before prepare()")
        self.steps += 1
        self._taken = index
        self._last = self.actions.decode(index)
        self._alloc = self.actions.apply(p.current, index, p.obs, p.planned)
        if changes_processes(p.current, self._alloc):
            self._before = (p.current, p.obs.throughput)
        ran = tuple(s.fused for s in p.obs.stages)
        self._settling = (self._alloc.fused or ran) != ran or moves_split(
            p.obs, p.current, self._alloc
        )
        self._in_effect, self._settled_for = False, 0
        return self._alloc

    def _settled(self, obs: Observation) -> bool:
        """Whether ``obs`` measured the shape the last action chose, from the start of its
        interval: the interval before it ended with every stage fused as chosen, fused stages
        running no workers of their own (their queued frames done) and split ones some.
        A live pipeline may take more than an interval to drain a fused stage's queue; the
        simulator switches at once. After ``SETTLE_MAX`` intervals it judges anyway."""
        assert self._alloc is not None
        if self._in_effect or self._settled_for >= SETTLE_MAX:
            self._settling = False
            return True
        self._settled_for += 1
        want = self._alloc.fused or tuple(s.fused for s in obs.stages)
        self._in_effect = all(
            s.fused == f and (s.workers == 0 if f else s.workers > 0)
            for s, f in zip(obs.stages, want, strict=True)
        )
        return False

    def _ran(self, obs: Observation) -> Allocation:
        """The allocation ``obs`` ran under: the last decision as the hard limits let it
        through (:class:`~.safety.Guarded` clamps it; the tuner does not)."""
        assert self._alloc is not None
        # Its shape explicit ("as now" would not bring back a shape an undo returns to).
        ran = obs.allocation().replace(fused=tuple(s.fused for s in obs.stages))
        return ran.replace(concurrency=self._alloc.concurrency) if self._alloc.concurrency else ran

    def _guard(self, obs: Observation, current: Allocation) -> Allocation:
        """Go back to the best recently measured allocation when this one is clearly worse.

        Every interval is booked against the workers that ran it; means over the last
        ``GUARD_WINDOW`` steps since the CPU count last changed are compared. Small moves can
        drift a pipeline down by less than ``REVERT_DROP`` each; this catches the sum.
        """
        now = self.steps
        # Workers are booked with the shape they ran in: a fused stage runs none of its own.
        ran = obs.allocation()
        shape = (ran.workers, ran.fused)
        seen = self._seen.setdefault(shape, [])
        seen.append((now, obs.throughput))
        for key in list(self._seen):
            self._seen[key] = [(k, x) for k, x in self._seen[key] if now - k < GUARD_WINDOW]
            if not self._seen[key]:
                del self._seen[key]
        means = {k: sum(x for _, x in v) / len(v) for k, v in self._seen.items() if len(v) >= 2}
        if not means or shape not in means:
            return current
        best = max(means, key=means.__getitem__)
        if means[shape] < (1 - GUARD_DROP) * means[best] and best != (
            current.workers,
            current.fused,
        ):
            return current.replace(workers=best[0], fused=best[1] or (False,) * len(best[0]))
        return current

    # -- weights --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The agent's weights (for checkpoints); empty before the first :meth:`reset`."""
        if self.agent is None or isinstance(self.agent, PlannerOnly):
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

    def _load_agent(self, n: int) -> DQNAgent | PlannerOnly:
        agent = PlannerOnly() if self.plan_only else load_agent(self.weights, n)
        if isinstance(agent, PlannerOnly):
            if not self.plan_only:
                logger.info(
                    "InTuneTuner: no shipped weights for %d-stage pipelines (shipped: %s); the "
                    "planner tunes this one alone", n,
                    ", ".join(map(str, shipped_lengths())) or "none",
                )  # fmt: skip
            if self.plan_gain is None:
                self.plan_gain = PLAN_MIN_GAIN
        elif self.finetune:
            agent.enable_training(seed=self.seed, config=self.config)
        return agent


def _grows_for_little(planned: Plan, now: Allocation) -> bool:
    """Whether ``planned`` runs more worker processes than ``now`` for less than
    ``GROW_MIN_GAIN`` more throughput by its model (host and cluster splits are judged
    apart)."""
    a = planned.allocation
    if any(a.remote) or any(now.remote):
        return False
    grows = _processes(a) > _processes(now)
    return grows and planned.throughput < (1 + GROW_MIN_GAIN) * planned.current


def _processes(a: Allocation) -> int:
    """Worker processes ``a`` runs: a fused stage runs in its host's."""
    return sum(w for i, w in enumerate(a.workers) if not (a.fused and a.fused[i]))


def fused_start(start: Allocation, obs: Observation) -> Allocation:
    """``start`` with every fusable stage fused (:func:`~.base.fuse_fusable`): each host runs
    the workers its group's stages had between them, up to one per CPU (and its bound); a
    fused stage keeps its workers as the target for when it is split."""
    fused = fuse_fusable(obs)
    workers = list(start.workers)
    for h in range(len(workers)):
        if fused[h]:
            continue
        group = [j for j in range(h, len(workers)) if fusion_host(fused, j) == h]
        if len(group) > 1:
            cap = min(obs.stages[h].max_workers, max(1, round(obs.cpus)))
            workers[h] = max(workers[h], min(cap, sum(start.workers[j] for j in group)))
    return start.replace(workers=tuple(workers), fused=fused)
