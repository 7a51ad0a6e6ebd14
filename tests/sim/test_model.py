"""Sanity of the simulator's fluid model: scaling, I/O, buffers, memory, schedules."""

from __future__ import annotations

import math

import pytest

from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload
from torchtune_pipe.sim.workloads import netflix_like
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, Tunable

US = 1e-6
GiB = 1024 * MiB


def chain(*stages: StageModel, **kw) -> Workload:
    kw.setdefault("worker_start_s", 0.0)
    return Workload("test", stages, **kw)


def cpu_chain(cv: float = 0.0) -> Workload:
    """Source 10 us, map 40 us (the bottleneck), sink 5 us; all CPU."""
    return chain(
        StageModel("src", "source", 10 * US, cpu_cv=cv),
        StageModel("udf", "map", 40 * US, cpu_cv=cv),
        StageModel("out", "map", 5 * US, cpu_cv=cv),
    )


def alloc(workers, buf=64 * MiB) -> Allocation:
    return Allocation(tuple(workers), (buf,) * len(workers))


def test_implements_tunable_and_fills_observation():
    sim = SimPipeline(netflix_like(0), 32, 48 * GiB, seed=1)
    assert isinstance(sim, Tunable)
    obs = sim.observe()
    assert isinstance(obs, Observation)
    assert obs.t == pytest.approx(1.0)
    assert obs.cpus == 32 and obs.memory_limit_bytes == 48 * GiB
    assert obs.throughput > 0 and obs.latency_s > 0 and obs.dram_gbps > 0 and obs.cpu_ghz > 0
    assert [s.name for s in obs.stages] == ["load", "shuffle", "udf", "batch", "prefetch"]
    for s in obs.stages:
        assert 0 <= s.busy <= 1 and 0 <= s.blocked_in <= 1 and 0 <= s.blocked_out <= 1
        assert s.busy + s.blocked_in + s.blocked_out == pytest.approx(1.0)
        assert s.items_per_s > 0 and s.cpu_s_per_item > 0
    # One worker each: the source is the bottleneck, always busy; the others wait for input.
    assert obs.stages[0].busy == pytest.approx(1.0, abs=0.01)
    assert obs.stages[2].blocked_in > obs.stages[2].blocked_out
    assert obs.memory_used_bytes >= 5 * 150 * MiB


def test_more_workers_on_bottleneck_helps_until_cpus_run_out():
    sim = SimPipeline(cpu_chain(), cpus=8, memory_limit_bytes=48 * GiB, noise=0)
    values = [sim.evaluate(alloc((2, k, 1))) for k in range(1, 12)]
    # Linear while the map stage is the bottleneck and cores are free.
    assert values[1] == pytest.approx(2 * values[0])
    assert all(b >= a for a, b in zip(values[:5], values[1:6], strict=True))
    # Capped by CPU work: 8 cores / 55 us per item (plus channel copies).
    bound = sim.upper_bound()
    assert bound == pytest.approx(8 / 55e-6, rel=0.01)
    assert max(values) <= bound + 1e-6
    # Far past the cores, context switching makes it worse, not better.
    assert sim.evaluate(alloc((40, 80, 40))) < sim.evaluate(alloc((2, 5, 1)))


def test_io_stage_scales_past_core_count():
    wl = chain(
        StageModel("read", "source", 2 * US, io_s_per_item=100 * US),
        StageModel("parse", "map", 5 * US),
    )
    sim = SimPipeline(wl, cpus=4, memory_limit_bytes=48 * GiB, noise=0)
    at_cores = sim.evaluate(alloc((3, 1)))
    past = sim.evaluate(alloc((30, 1)))
    assert past > 5 * at_cores
    obs_stage = (sim.apply(alloc((30, 1))), sim.observe())[1].stages[0]
    assert obs_stage.io_bound


def test_cpu_bound_stage_does_not_scale_past_cores():
    sim = SimPipeline(cpu_chain(), cpus=4, memory_limit_bytes=48 * GiB, noise=0)
    assert sim.evaluate(alloc((4, 40, 4))) <= sim.upper_bound()


def test_batching_ratio():
    wl = chain(
        StageModel("src", "source", 10 * US, bytes_per_item=100),
        StageModel("batch", "batch", 1 * US, ratio=64, bytes_per_item=6400),
    )
    sim = SimPipeline(wl, cpus=4, memory_limit_bytes=48 * GiB, noise=0)
    sim.apply(alloc((1, 1)))
    obs = sim.observe()
    # 1 source worker at ~10 us/item -> ~1e5 items/s -> ~1e5/64 batches/s.
    assert obs.stages[0].items_per_s == pytest.approx(64 * obs.throughput, rel=1e-6)
    assert obs.throughput == pytest.approx(1 / (64 * 10.005e-6), rel=0.01)


def test_small_buffers_lose_throughput_with_variable_costs():
    steady = SimPipeline(cpu_chain(cv=0.0), 16, 48 * GiB, noise=0)
    heavy = SimPipeline(cpu_chain(cv=2.0), 16, 48 * GiB, noise=0)
    w = (2, 8, 1)  # balanced-ish: src 2/10us = 0.2, udf 8/40us = 0.2 items/us
    tiny, big = 2 * 1024, 64 * MiB
    assert steady.evaluate(alloc(w, tiny)) == pytest.approx(
        steady.evaluate(alloc(w, big)), rel=0.01
    )
    assert heavy.evaluate(alloc(w, tiny)) < 0.8 * heavy.evaluate(alloc(w, big))
    assert heavy.evaluate(alloc(w, big)) == pytest.approx(steady.evaluate(alloc(w, big)), rel=0.02)


def test_oom_when_buffers_and_workers_exceed_limit():
    wl = cpu_chain()
    limit = 4 * 150 * MiB + 600 * MiB
    sim = SimPipeline(wl, cpus=8, memory_limit_bytes=limit, noise=0)
    # Fast source, slow map: the source's outbound buffer fills up to its budget.
    greedy = Allocation((2, 1, 1), (2048 * MiB, 1 * MiB, 1 * MiB))
    assert sim.evaluate(greedy) == 0.0  # the oracle sees it would not fit
    sim.apply(greedy)
    seen = [sim.observe() for _ in range(30)]
    first = next(i for i, o in enumerate(seen) if o.oom)
    assert first > 0  # filling takes time
    assert all(o.oom and o.throughput == 0 for o in seen[first:])
    assert sim.oom
    sim.reset()
    assert not sim.oom and sim.observe().throughput > 0
    # Too many workers is an OOM at once, whatever the buffers.
    sim.apply(alloc((4, 4, 4), 1 * MiB))
    assert sim.observe().oom


def test_big_buffer_downstream_of_bottleneck_stays_empty():
    sim = SimPipeline(cpu_chain(), 8, 48 * GiB, noise=0)
    a = Allocation((1, 1, 4), (1 * MiB, 1 * MiB, 1024 * MiB))
    sim.apply(a)
    for _ in range(20):
        obs = sim.observe()
    assert obs.stages[2].buffer_fill < 0.01
    assert obs.stages[0].buffer_fill > 0.9  # upstream of the slow map: full


def test_cpu_schedule_changes_the_cap():
    sim = SimPipeline(cpu_chain(), [(0, 4), (3, 16), (6, 4)], 48 * GiB, noise=0)
    sim.apply(alloc((4, 16, 2)))
    obs = [sim.observe() for _ in range(9)]
    assert [o.cpus for o in obs] == [4, 4, 4, 16, 16, 16, 4, 4, 4]
    assert obs[4].throughput > 2 * obs[1].throughput
    assert obs[7].throughput == pytest.approx(obs[1].throughput, rel=1e-6)
    assert sim.cpus_at(4.5) == 16


def test_evaluate_is_deterministic_and_stateless():
    sim = SimPipeline(netflix_like(3), 32, 48 * GiB, seed=5)
    a = alloc((10, 1, 12, 4, 1))
    v = sim.evaluate(a)
    t, before = sim.t, sim.allocation
    assert [sim.evaluate(a) for _ in range(3)] == [v] * 3
    assert sim.t == t and sim.allocation == before
    assert sim.evaluate(a, cpus=8) < v


def test_evaluate_at_a_time_uses_that_times_costs():
    drifting = chain(
        StageModel("src", "source", 10 * US),
        StageModel("udf", "map", 40 * US, drift=(100.0, 0.5)),
    )
    sim = SimPipeline(drifting, 64, 48 * GiB, noise=0)
    a = alloc((2, 4))
    assert sim.evaluate(a, t=0.0) == sim.evaluate(a)
    # A quarter period in, the map costs 1.5x: the same workers deliver 2/3 as much.
    assert sim.evaluate(a, t=25.0) == pytest.approx(sim.evaluate(a) / 1.5, rel=1e-6)
    assert sim.upper_bound(t=25.0) < sim.upper_bound()
    assert sim.t == 0.0


def test_noise_is_seeded_and_copy_is_independent():
    a = SimPipeline(netflix_like(0), 32, 48 * GiB, seed=7)
    b = SimPipeline(netflix_like(0), 32, 48 * GiB, seed=7)
    xs = [a.observe().throughput for _ in range(5)]
    assert xs == [b.observe().throughput for _ in range(5)]
    assert len(set(xs)) > 1  # noisy
    c = a.copy()
    assert c.observe().throughput == a.observe().throughput
    a.apply(alloc((8, 1, 8, 2, 1)))
    assert c.allocation != a.allocation
    a.reset(seed=7)
    assert a.t == 0 and a.observe().throughput == xs[0]


def test_drift_moves_costs_over_time():
    wl = chain(StageModel("src", "source", 10 * US, drift=(100.0, 0.5)))
    sim = SimPipeline(wl, 4, 48 * GiB, noise=0, interval_s=25.0)
    rates = [sim.observe().throughput for _ in range(4)]  # midpoints at t=12.5, 37.5, ...
    assert rates[0] == pytest.approx(rates[1]) and rates[2] == pytest.approx(rates[3])
    assert rates[2] > 1.5 * rates[0]
    assert min(rates) == pytest.approx(1 / (10e-6 * (1 + 0.5 * math.sin(math.pi / 4))), rel=0.01)


def test_new_workers_take_time_to_start():
    wl = chain(StageModel("src", "source", 10 * US), worker_start_s=0.5)
    sim = SimPipeline(wl, 8, 48 * GiB, noise=0)
    sim.observe()
    sim.apply(alloc((3,)))
    first, second = sim.observe().throughput, sim.observe().throughput
    assert first == pytest.approx(2 / 10.00005e-6, rel=0.01)  # 1 old + half of 2 new
    assert second == pytest.approx(3 / 10.00005e-6, rel=0.01)


def test_validation_names_the_problem():
    with pytest.raises(ValueError, match="kind"):
        StageModel("x", "reduce", 1e-6)
    with pytest.raises(ValueError, match="unique"):
        chain(StageModel("a", "map", 1e-6), StageModel("a", "map", 1e-6))
    sim = SimPipeline(cpu_chain(), 4, GiB)
    with pytest.raises(ValueError, match="3"):
        sim.apply(alloc((1, 1)))
    sim.apply(alloc((0, 10**6, 1)))  # clamped to each stage's bounds
    assert sim.allocation.workers == (1, 256, 1)
