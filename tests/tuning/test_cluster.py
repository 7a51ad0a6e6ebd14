"""Two budgets: the guard keeps local workers within the host's cores and remote ones within
the cluster's CPUs, and each tuner that decides the split (planner, so InTune; Plumber's LP;
the oracle) moves a CPU-heavy stage with small items to the cluster when the host runs out of
cores and keeps a cheap stage with big items local."""

from __future__ import annotations

import pytest

from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload
from torchtune_pipe.tuning import make_tuner, run_episode
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats
from torchtune_pipe.tuning.capacity import (
    REMOTE_HEADROOM,
    Station,
    capacity,
    remote_headroom,
    served_share,
    station_capacity,
)
from torchtune_pipe.tuning.cluster import remote_cost, remote_of
from torchtune_pipe.tuning.intune.agent import InTuneTuner
from torchtune_pipe.tuning.oracle import best_static
from torchtune_pipe.tuning.placement import local_headroom
from torchtune_pipe.tuning.planner import plan
from torchtune_pipe.tuning.plumber import plan as plumber_plan
from torchtune_pipe.tuning.safety import (
    REMOTE_MIN_CHARGE,
    Guarded,
    fit_memory,
    oversubscribe_factor,
    placed,
    remote_charge,
    safe,
)
from torchtune_pipe.tuning.split_search import split_search

US = 1e-6
BUF = (16 * MiB,) * 3


def _workload() -> Workload:
    """A cheap source, a CPU-heavy UDF on small rows, and a cheap stage that makes 1 MiB
    items (moving it would cost the host more in copies than it frees)."""
    return Workload(
        "split",
        (
            StageModel("read", "source", 5 * US, bytes_per_item=300),
            StageModel("udf", "map", 200 * US, bytes_per_item=300, items_per_call=64),
            StageModel("big", "map", 20 * US, bytes_per_item=1 << 20, items_per_call=8),
        ),
    )


def _sim(cluster: float = 32, cpus: float = 4) -> SimPipeline:
    return SimPipeline(
        _workload(), cpus=cpus, memory_limit_bytes=64 << 30, cluster_cpus=cluster, noise=0
    )


def _measured(sim, alloc: Allocation, steps: int = 3) -> Observation:
    pipe = Guarded(sim)
    pipe.observe()
    pipe.apply(alloc)
    for _ in range(steps):
        obs = pipe.observe()
    return obs


# -- the guard ---------------------------------------------------------------------------


def test_remote_workers_stay_within_the_cluster_and_off_the_local_budget():
    obs = _measured(_sim(cluster=16), Allocation((1, 3, 1), BUF))
    pipe = Guarded(_sim(cluster=16))
    got = pipe.fit(Allocation((1, 60, 1), BUF, remote=(0, 50, 0)), obs)
    assert got.remote == (0, 16, 0)  # the cluster's CPUs; the rest dropped, not made local
    assert got.workers[1] - got.remote[1] <= 10
    # 36 remote workers on a 64-CPU cluster and 3 local ones: the local cap is not touched.
    obs = _measured(_sim(cluster=64), Allocation((1, 3, 1), BUF))
    wide = Guarded(_sim(cluster=64)).fit(Allocation((1, 39, 1), BUF, remote=(0, 36, 0)), obs)
    assert wide.workers == (1, 39, 1) and wide.remote == (0, 36, 0)
    # The same 39 all local are cut to the host's cores (with its oversubscription).
    assert safe(Allocation((1, 39, 1), BUF), obs).workers[1] < 39


def test_a_stage_that_cannot_move_keeps_its_placement():
    obs = _measured(_sim(), Allocation((1, 3, 1), BUF))
    got = placed(Allocation((2, 3, 1), BUF, remote=(1, 0, 0)), obs)
    assert got.remote == ()  # the source is not remotable: nothing runs remote
    # A live placement="ray" stage: every worker remote, and not movable.
    stages = tuple(
        StageStats(n, w, items_per_s=100.0, remote_workers=r, remotable=False)
        for n, w, r in (("read", 1, 0), ("udf", 4, 4), ("out", 1, 0))
    )
    live = Observation(stages, 100.0, 4, 1 << 30, 1 << 20, cluster_cpus=4)
    assert remote_of(Allocation((1, 6, 1), BUF), live) == (0, 6, 0)
    assert placed(Allocation((1, 6, 1), BUF, remote=(0, 2, 0)), live).remote == (0, 6, 0)
    assert placed(Allocation((1, 6, 1), BUF, remote=(0, 2, 0)), live).workers == (1, 6, 1)


def test_remote_hops_take_local_cores_and_no_memory():
    sim = _sim(cluster=64)
    obs = _measured(sim, Allocation((1, 40, 1), BUF, remote=(0, 38, 0)))
    udf = obs.stages[1]
    assert udf.remote_workers == 38 and udf.hop_cpu_s_per_item > 0
    hop = udf.hop_cpu_s_per_item * udf.remote_items_per_s / udf.remote_workers
    assert remote_charge(udf) == pytest.approx(max(REMOTE_MIN_CHARGE, hop))
    # Each remote worker's charge comes off the cores local workers may use.
    assert oversubscribe_factor(obs, Allocation((1, 40, 1), BUF, remote=(0, 38, 0))) < (
        oversubscribe_factor(obs, Allocation((1, 2, 1), BUF, remote=(0, 0, 0)))
    )
    # Memory: only the local workers count; growing remote workers is never refused.
    grown = Allocation((1, 60, 1), BUF, remote=(0, 58, 0))
    assert fit_memory(grown, obs) == grown


def test_fused_stages_run_on_the_host():
    sim = _sim()
    obs = _measured(sim, Allocation((1, 3, 1), BUF))
    assert obs.stages[2].fusable and obs.stages[1].remotable
    # Fusing "big" into "udf" keeps udf's workers on the host: the guard drops its remote ones.
    got = placed(Allocation((1, 8, 1), BUF, fused=(False, False, True), remote=(0, 6, 0)), obs)
    assert got.remote == ()
    with pytest.raises(ValueError, match="'udf' runs fused"):
        sim.apply(Allocation((1, 8, 1), BUF, fused=(False, False, True), remote=(0, 6, 0)))


# -- each tuner's split ------------------------------------------------------------------


def _remote(alloc: Allocation) -> tuple[int, ...]:
    return alloc.remote or (0,) * len(alloc.workers)


def test_the_planner_moves_the_heavy_stage_and_keeps_big_items_local():
    obs = _measured(_sim(), Allocation((1, 3, 1), BUF))
    p = plan(obs, obs.allocation(), fusion=False)
    assert p is not None
    remote = _remote(p.allocation)
    assert remote[1] > 0 and remote[2] == 0
    assert remote_cost(obs, 2).hop_cpu_s > obs.stages[2].cpu_s_per_item  # moving costs more
    # Without a cluster the same observation plans every worker local.
    alone = _measured(_sim(cluster=0), Allocation((1, 3, 1), BUF))
    assert not any(_remote(plan(alone, alone.allocation(), fusion=False).allocation))


TUNERS = {
    "intune": lambda: make_tuner("intune"),
    "planner": lambda: InTuneTuner(plan_only=True),
    "plumber": lambda: make_tuner("plumber"),
}


@pytest.mark.parametrize("name", sorted(TUNERS))
def test_tuners_split_the_stages_on_the_simulator(name):
    sim = _sim()
    trace = run_episode(sim, TUNERS[name](), 25)
    last = trace[-1]
    assert last.stages[1].remote_workers > 0 and last.stages[2].remote_workers == 0
    assert sum(last.remote_workers) <= 32
    local = _sim(cluster=0)
    assert last.throughput > 2 * run_episode(local, TUNERS[name](), 25)[-1].throughput


def test_plumbers_lp_moves_only_what_frees_cores():
    obs = _measured(_sim(), Allocation((1, 3, 1), BUF))
    got = plumber_plan(obs)
    assert got is not None and got.remote[1] > 0 and got.remote[2] == 0
    assert got.workers[1] >= got.remote[1]
    # No cluster: the LP of old.
    alone = _measured(_sim(cluster=0), Allocation((1, 3, 1), BUF))
    assert plumber_plan(alone).remote == ()


def test_the_oracle_searches_the_split():
    sim = _sim()
    hi = [s.max_workers for s in sim.workload.stages]
    alone, x_alone = best_static(sim.evaluate, 3, 4, hi)
    both, x_both = best_static(sim.evaluate, 3, 4, hi, cluster_cpus=32, remotable=sim.remotable())
    assert x_both > 2 * x_alone
    assert both.remote[1] > 0 and both.remote[2] == 0
    with pytest.raises(ValueError, match="remotable need 3"):
        split_search(sim.evaluate, 3, 4, 32, hi, (True,))
    with pytest.raises(ValueError, match="cluster_cpus must be >= 0"):
        best_static(sim.evaluate, 3, 4, hi, cluster_cpus=-1)
    with pytest.raises(ValueError, match="remotable needs 3 entries"):
        best_static(sim.evaluate, 3, 4, hi, cluster_cpus=8, remotable=(True,))


# -- the planner's split (tuning/placement.py) --------------------------------------------


def test_items_split_by_the_kinds_capacities():
    s = Station(0, g=1e-5, u=1e-5, floor=0.5, lo=1, hi=64, idle=False, h=1e-6, v=2e-5)
    # One local worker makes as much as two remote ones, whatever share it was planned for.
    assert served_share(s, 1, 2) == pytest.approx(0.5)
    assert served_share(s, 0, 2) == 1.0
    assert served_share(s, 3, 0) == 0.0


def test_remote_and_waiting_workers_are_planned_with_the_smaller_headroom():
    assert remote_headroom(1.2) == REMOTE_HEADROOM < 1.2
    assert local_headroom(1e-5, 1e-5, 1.2) == 1.2
    assert local_headroom(1e-6, 4e-5, 1.2) == REMOTE_HEADROOM  # waits on I/O: holds no core
    # The planner's rate model, each kind with its headroom: local workers the station's,
    # remote ones at most REMOTE_HEADROOM.
    cpu = Station(0, g=1e-5, u=1e-5, floor=0.5, lo=1, hi=64, idle=False, h=1e-6, v=2e-5,
                  headroom=1.2)  # fmt: skip
    assert station_capacity(cpu, 0, 10) == capacity(10, 2e-5, REMOTE_HEADROOM)
    assert station_capacity(cpu, 2, 0) == capacity(2, 1e-5, 1.2)
    assert station_capacity(cpu, 2, 10) == capacity(2, 1e-5, 1.2) + capacity(10, 2e-5, 1.05)


def test_the_planner_moves_a_stage_wholly_when_the_cluster_holds_it():
    # No local UDF worker kept for a sliver of its items: it would take a core's worth of
    # them (the kinds split items by capacity) from the host's own stages.
    obs = _measured(_sim(cluster=32), Allocation((1, 3, 1), BUF))
    p = plan(obs, obs.allocation(), fusion=False)
    assert p is not None
    assert p.allocation.remote[1] == p.allocation.workers[1] > 0
    # A cluster too small for the need: the rest stays on the host.
    small = _measured(_sim(cluster=8), Allocation((1, 3, 1), BUF))
    q = plan(small, small.allocation(), fusion=False)
    assert q is not None and q.allocation.remote[1] == 8 < q.allocation.workers[1]
