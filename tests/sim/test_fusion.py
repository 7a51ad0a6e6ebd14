"""Fused groups in the simulator: costs add, the hop between the stages goes, the fused stage's
workers and buffer go, and which stages may fuse follows the live rule."""

from __future__ import annotations

import pytest

from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload
from torchtune_pipe.sim.workloads import fusion_like
from torchtune_pipe.tuning.base import Allocation, MiB

US = 1e-6
GiB = 1024 * MiB
HOP = 3 * US


def _chain(*stages: StageModel, hop: float = HOP) -> Workload:
    return Workload(
        "fusion", stages, worker_start_s=0.0, hop_s_per_item=hop, dram_gbps=1e9, switch_overhead=0
    )


def _three() -> Workload:
    """A source and two maps, all CPU, no variance: the fluid model is exact."""
    return _chain(
        StageModel("src", "source", 10 * US),
        StageModel("a", "map", 20 * US),
        StageModel("b", "map", 5 * US),
    )


def _alloc(workers, fused=()) -> Allocation:
    return Allocation(tuple(workers), (64 * MiB,) * len(workers), fused=fused)


def test_a_fused_group_costs_the_sum_of_its_stages_without_the_hop_between_them():
    sim = SimPipeline(_three(), cpus=1, memory_limit_bytes=64 * GiB, noise=0)
    # One core: throughput is the core over the CPU per item, hops included.
    split = sim.evaluate(_alloc((1, 1, 1)))
    assert split == pytest.approx(1 / (35 * US + 3 * HOP), rel=1e-3)
    # b runs in a's workers: the hop from a to b is gone, the costs still add.
    fused = sim.evaluate(_alloc((1, 1, 1), fused=(False, False, True)))
    assert fused == pytest.approx(1 / (35 * US + 2 * HOP), rel=1e-3)
    everything = sim.evaluate(_alloc((1, 1, 1), fused=(False, True, True)))
    assert everything == pytest.approx(1 / (35 * US + HOP), rel=1e-3)


def test_a_group_scales_with_its_hosts_workers_only():
    sim = SimPipeline(_three(), cpus=64, memory_limit_bytes=64 * GiB, noise=0)
    shape = (False, True, True)
    # Host of a group costing 10 + 20 + 5 us per item: 4 workers make 4 / 35 us.
    assert sim.evaluate(_alloc((4, 1, 1), shape)) == pytest.approx(4 / (35 * US + HOP), rel=1e-3)
    # A fused stage's worker entry is its target for when it is split again: it changes nothing.
    assert sim.evaluate(_alloc((4, 9, 9), shape)) == sim.evaluate(_alloc((4, 1, 1), shape))


def test_a_fused_stage_reports_no_workers_its_own_time_and_no_memory():
    sim = SimPipeline(_three(), cpus=64, memory_limit_bytes=64 * GiB, noise=0)
    sim.apply(_alloc((2, 2, 2)))
    split = sim.observe()
    sim.apply(_alloc((2, 2, 2), fused=(False, False, True)))
    fused = sim.observe()
    a, b = fused.stages[1], fused.stages[2]
    assert b.fused and b.workers == 0 and b.memory_bytes == 0 and b.buffer_fill == 0
    assert not a.fused and a.workers == 2
    assert fused.workers == (2, 2, 0)
    assert fused.allocation().fused == (False, False, True)
    # The group's workers spend their time in a or in b, or wait (shares of the same wall time).
    assert a.busy + b.busy + a.blocked_in + a.blocked_out == pytest.approx(1.0)
    assert b.blocked_in == b.blocked_out == 0
    # b's own time per item (its output still crosses a channel) over a's two workers.
    assert b.busy == pytest.approx(fused.throughput * (5 * US + HOP) / 2, rel=1e-3)
    # Per item, b costs what it did; a no longer pays the hop to b.
    assert b.cpu_s_per_item == pytest.approx(split.stages[2].cpu_s_per_item)
    assert a.cpu_s_per_item == pytest.approx(split.stages[1].cpu_s_per_item - HOP, rel=1e-3)
    # b's worker processes are gone.
    assert split.memory_used_bytes - fused.memory_used_bytes >= 2 * 150 * MiB * 0.99


def test_fused_stages_worker_bytes_are_held_by_every_host_worker():
    wl = _chain(
        StageModel("src", "source", 10 * US),
        StageModel("cache", "map", 5 * US, worker_bytes=100 * MiB),
    )
    sim = SimPipeline(wl, cpus=8, memory_limit_bytes=64 * GiB, noise=0)
    sim.apply(_alloc((3, 1), fused=(False, True)))
    src, cache = sim.observe().stages
    assert cache.memory_bytes == 0
    assert src.memory_bytes == 3 * (150 + 100) * MiB


def test_which_stages_may_fuse_follows_the_live_rule():
    wl = _chain(
        StageModel("src", "source", 10 * US),
        StageModel("m1", "map", 1 * US),
        StageModel("shuffle", "shuffle", 1 * US),
        StageModel("m2", "map", 1 * US),
        StageModel("m3", "map", 1 * US),
        StageModel("gpu", "map", 1 * US, fusable=False),
        StageModel("batch", "batch", 1 * US, ratio=4),
    )
    sim = SimPipeline(wl, cpus=8, memory_limit_bytes=64 * GiB)
    # Stateless maps after a source or a map; nothing into or after a stateful stage.
    assert sim.fusable() == (False, True, False, False, True, False, False)
    assert sim.widest_fusion() == (False, True, False, False, True, False, False)
    with pytest.raises(ValueError, match="cannot fuse stage 'shuffle'"):
        sim.apply(_alloc((1,) * 7, fused=(False, False, True) + (False,) * 4))


def test_a_host_runs_at_most_max_fused_stages_after_it():
    import dataclasses

    from multiproc.stats import MAX_FUSED

    base = fusion_like(0)
    maps = [st for st in base.stages if st.kind == "map"]
    chain = [base.stages[0]] + [
        dataclasses.replace(maps[k % len(maps)], name=f"map{k}") for k in range(MAX_FUSED + 2)
    ]
    sim = SimPipeline(
        dataclasses.replace(base, stages=tuple(chain)), cpus=8, memory_limit_bytes=64 * GiB
    )
    n = len(chain)
    widest = sim.widest_fusion()
    assert widest == (False,) + (True,) * MAX_FUSED + (False, True)
    too_long = (False,) + (True,) * (MAX_FUSED + 1) + (False,)
    assert sim.fusable(widest)[MAX_FUSED + 1] is False  # one more in the source's workers
    with pytest.raises(ValueError, match=f"at most {MAX_FUSED} stages"):
        sim.apply(_alloc((1,) * n, fused=too_long))


def test_fusion_raises_throughput_in_the_fusion_family_and_the_bound_holds():
    sim = SimPipeline(fusion_like(0), cpus=4, memory_limit_bytes=64 * GiB, noise=0)
    split = sim.evaluate(_alloc((2, 1, 1, 1, 1, 1, 1, 1)))
    fused = sim.evaluate(_alloc((4, 1, 1, 1, 1, 3, 1, 1), fused=sim.widest_fusion()))
    assert fused > 1.3 * split
    assert fused <= sim.upper_bound()
