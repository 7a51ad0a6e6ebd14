"""The InTune agent with a cluster: the split between host and cluster is the plan's.

The network was trained without a cluster (:mod:`~torchtune_pipe.tuning.intune.pretrain` draws no
``cluster_cpus``): it sees a stage's workers, not where they run. Its small moves on a stage
that runs remote workers are out of its training: ``+1`` adds a *local* worker to a stage the
plan moved off the host (the kinds split items by their capacities, so that worker takes a
core's worth of the stage's items from the host's own stages), and ``-1`` on a stage whose
workers all run remote gives back a cluster CPU a small cluster needs. In
``benchmarks/cluster_sim.py`` such moves cost the agent 5-40% of the planner's throughput
at 8-32 cluster CPUs. So, with a cluster, the split is the plan's:

* :func:`mask_split_moves`: the worker moves of a stage that runs remote workers are masked
  (the network keeps the host's own stages, buffers and the decision to re-plan);
* :func:`moves_split`: an action that changes which workers run remote is judged on the
  interval after the one its workers start in (``SimPipeline``'s new workers work part of their
  first interval; a live actor takes seconds to start), as a change of fusion shape is: judged
  on its first interval, a plan that moved a stage from host to cluster looked like a drop and
  was undone.

Without a cluster (``Observation.cluster_cpus`` 0, no remote workers) neither rule applies, and
the agent is the one the held-out evaluation measures.
"""

from __future__ import annotations

import torch

from torchtune_pipe.tuning.base import Allocation, Observation
from torchtune_pipe.tuning.cluster import remote_of
from torchtune_pipe.tuning.intune.space import ACTIONS_PER_STAGE, WORKER_DELTAS


def has_cluster(obs: Observation) -> bool:
    """Whether ``obs`` has a cluster its stages may use, or runs remote workers now."""
    return obs.cluster_cpus >= 1 or any(obs.remote_workers)


def mask_split_moves(mask: torch.Tensor, obs: Observation, alloc: Allocation) -> torch.Tensor:
    """``mask`` with the worker moves of every stage ``alloc`` runs remote workers of closed
    (module docstring); unchanged without a cluster. Returns ``mask`` (changed in place)."""
    if not has_cluster(obs):
        return mask
    for i, r in enumerate(remote_of(alloc, obs)):
        if r > 0:
            base = 1 + ACTIONS_PER_STAGE * i
            mask[base : base + len(WORKER_DELTAS)] = False
    return mask


def moves_split(obs: Observation, before: Allocation, after: Allocation) -> bool:
    """Whether ``after`` runs other workers remote than ``before`` (both read against
    ``obs``): then it is judged once its workers have started (module docstring)."""
    if not has_cluster(obs):
        return False
    return remote_of(before, obs) != remote_of(after, obs)
