"""InTune with a cluster: the split between host and cluster is the plan's. The network's worker
moves on a stage that runs remote workers are masked, a decision that moves workers between
host and cluster is judged once its workers have started, and without a cluster neither rule
changes anything."""

from __future__ import annotations

import pytest

from torchtune_pipe.tuning.base import Allocation
from torchtune_pipe.tuning.intune.agent import InTuneTuner
from torchtune_pipe.tuning.intune.cluster import has_cluster, mask_split_moves, moves_split
from torchtune_pipe.tuning.intune.space import ACTIONS_PER_STAGE, WORKER_DELTAS, ActionSpace
from torchtune_pipe.tuning.safety import Guarded

from .test_cluster import BUF, _measured, _sim

SPLIT = Allocation((1, 13, 5), BUF, remote=(0, 13, 0))


def _moves(stage: int) -> slice:
    base = 1 + ACTIONS_PER_STAGE * stage
    return slice(base, base + len(WORKER_DELTAS))


def test_worker_moves_of_a_stage_running_remote_workers_are_masked():
    obs = _measured(_sim(cluster=32), SPLIT)
    assert has_cluster(obs) and obs.stages[1].remote_workers == 13
    space = ActionSpace(3)
    before = space.mask(obs, obs.allocation())
    after = mask_split_moves(before.clone(), obs, obs.allocation())
    assert not after[_moves(1)].any()  # the UDF runs remote: its workers are the plan's
    assert before[_moves(1)].any()  # (some were open)
    # Every other action keeps its mask: the host's stages, buffers, the no-op, the plan.
    keep = [k for k in range(space.n) if k not in range(*_moves(1).indices(space.n))]
    assert after[keep].tolist() == before[keep].tolist()


def test_without_a_cluster_nothing_is_masked_or_settled():
    obs = _measured(_sim(cluster=0), Allocation((1, 3, 1), BUF))
    assert not has_cluster(obs)
    mask = ActionSpace(3).mask(obs, obs.allocation())
    assert mask_split_moves(mask.clone(), obs, obs.allocation()).tolist() == mask.tolist()
    assert not moves_split(obs, obs.allocation(), Allocation((1, 4, 1), BUF))


def test_moves_split_reads_remote_counts_as_each_stage_keeps_them():
    obs = _measured(_sim(cluster=32), SPLIT)
    ran = obs.allocation()
    assert not moves_split(obs, ran, ran.replace(remote=()))  # empty: placements kept
    assert not moves_split(obs, ran, ran.replace(workers=(1, 13, 6)))  # a local stage grows
    assert moves_split(obs, ran, ran.replace(workers=(1, 14, 5), remote=(0, 14, 0)))
    assert moves_split(obs, ran, ran.replace(remote=(0, 0, 0)))  # brought back to the host


@pytest.mark.parametrize("plan_only", [True, False])
def test_a_move_of_the_split_is_judged_after_its_workers_started(plan_only):
    sim = _sim(cluster=32)
    pipe = Guarded(sim)
    tuner = InTuneTuner(plan_only=plan_only)
    pipe.apply(tuner.reset(pipe.observe()))
    for _ in range(10):
        obs = pipe.observe()
        decision = tuner.step(obs)
        pipe.apply(decision)
        if moves_split(obs, obs.allocation(), decision):
            break
    else:
        pytest.fail("the tuner never moved workers to the cluster")
    # The interval after the move saw its new workers start: the tuner waits it out.
    assert tuner.step(pipe.observe()) == decision
    assert tuner.steps >= 1
