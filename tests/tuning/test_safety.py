"""The safety layer's memory rule: worst cases from measured per-worker memory."""

from __future__ import annotations

import dataclasses

import pytest

from multiproc.stats import MAX_FUSED
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats
from torchtune_pipe.tuning.safety import (
    MEMORY_SAFE_SHARE,
    SHED_BUFFER_FLOOR_BYTES,
    Guarded,
    charges,
    fit_memory,
    fusable_only,
    memory_parts,
    safe,
    within_limits,
)
from torchtune_pipe.tuning.testing import LinearTunable


def _obs(workers=(1, 4), buffers=(16 * MiB, 16 * MiB), per_worker=(50 * MiB, 200 * MiB),
         limit=2000 * MiB, fixed=40 * MiB, fill=0.5) -> Observation:  # fmt: skip
    stages = tuple(
        StageStats(
            f"s{i}", w, items_per_s=10.0, buffer_bytes=b, buffer_fill=fill, memory_bytes=int(w * p)
        )  # fmt: skip
        for i, (w, b, p) in enumerate(zip(workers, buffers, per_worker, strict=True))
    )
    used = int(sum(b * fill for b in buffers) + sum(s.memory_bytes for s in stages) + fixed)
    return Observation(stages, 10.0, cpus=8, memory_limit_bytes=limit, memory_used_bytes=used)


def test_memory_parts_split_measured_memory():
    parts = memory_parts(_obs())
    assert parts.buffered_bytes == 16 * MiB
    assert parts.per_worker_bytes == (50 * MiB, 200 * MiB)
    assert parts.fixed_bytes == pytest.approx(40 * MiB, abs=1)
    assert parts.worst_case_bytes(Allocation((1, 4), (16 * MiB, 16 * MiB))) == pytest.approx(
        40 * MiB + 50 * MiB + 800 * MiB + 32 * MiB, abs=1
    )


def test_an_allocation_that_fits_is_unchanged():
    obs = _obs()
    grow = Allocation((2, 5), (32 * MiB, 16 * MiB))
    assert fit_memory(grow, obs) == grow


def test_growth_whose_worst_case_passes_the_limit_is_refused():
    obs = _obs(limit=1200 * MiB)  # now: 40 + 50 + 800 + 32 = 922 MiB worst case
    # Two more 200 MiB workers would reach 1322 MiB > 0.95 * 1200.
    assert fit_memory(Allocation((1, 6), (16 * MiB, 16 * MiB)), obs).workers == (1, 4)
    # A bigger buffer alone is refused, the workers that fit are kept.
    out = fit_memory(Allocation((2, 4), (16 * MiB, 400 * MiB)), obs)
    assert out == Allocation((2, 4), (16 * MiB, 16 * MiB))


def test_near_the_limit_buffers_go_first_then_the_costliest_workers():
    # The workers' caches grew: 4 x 300 MiB + buffers now pass 0.95 x 1300 MiB.
    obs = _obs(per_worker=(50 * MiB, 300 * MiB), buffers=(64 * MiB, 64 * MiB), limit=1300 * MiB)
    now = obs.allocation()
    shed = fit_memory(now, obs)
    assert shed.buffer_bytes == (SHED_BUFFER_FLOOR_BYTES, SHED_BUFFER_FLOOR_BYTES)
    assert shed.workers == (1, 3)  # the UDF stage's 300 MiB workers, not the source's
    assert memory_parts(obs).worst_case_bytes(shed) <= MEMORY_SAFE_SHARE * 1300 * MiB
    # Buffers alone suffice when the overshoot is small: no worker goes.
    small = _obs(per_worker=(50 * MiB, 200 * MiB), buffers=(256 * MiB, 256 * MiB), limit=1300 * MiB)
    out = fit_memory(small.allocation(), small)
    assert out.workers == (1, 4) and max(out.buffer_bytes) < 256 * MiB


def test_workers_never_go_below_the_minimum():
    obs = _obs(limit=100 * MiB)
    out = fit_memory(obs.allocation(), obs, min_buffer_bytes=MiB)
    assert out.workers == (1, 1) and out.buffer_bytes == (MiB, MiB)
    with pytest.raises(ValueError, match="3 stages but the pipeline has 2"):
        fit_memory(Allocation((1, 1, 1), (MiB,) * 3), obs)


def test_safe_is_idempotent():
    # The cap depends on the allocation checked: what was clamped to one cap fits its own.
    stages = (
        StageStats("read", 8, items_per_s=100.0, busy=0.9, cpu_s_per_item=0.002),
        StageStats("udf", 30, items_per_s=100.0, busy=1.0, cpu_s_per_item=0.3),
    )
    obs = Observation(stages, 100.0, cpus=8, memory_limit_bytes=64 << 30, memory_used_bytes=0)
    once = safe(Allocation((40, 30), (MiB, MiB)), obs)
    assert sum(once.workers) < 70 and safe(once, obs) == once


def test_guarded_applies_the_limits_once_and_keeps_concurrency():
    pipe = LinearTunable((0.01, 0.02), cpus=2, memory_limit_bytes=1 << 30)
    guard = Guarded(pipe)
    obs = guard.observe()
    guard.apply(Allocation((50, 50), (4 << 30, 1), concurrency=(2, 1)))
    assert guard.applied == pipe.allocation == within_limits(pipe.applied[-1], obs)
    assert sum(pipe.allocation.workers) <= 2 * 4 and min(pipe.allocation.buffer_bytes) >= MiB
    assert pipe.allocation.concurrency == (2, 1)
    # A guard of a guard is the same guard: limits are never applied twice.
    assert Guarded(guard).tunable is pipe
    with pytest.raises(ValueError, match="stages"):
        guard.apply(Allocation((1,), (MiB,)))


def test_fit_memory_refuses_the_costliest_growth_first():
    # Worst case now: 40 + 50 + 800 + 32 MiB. Growing both stages passes the limit; refusing
    # the 200 MiB workers' growth is enough, so the 50 MiB workers' growth stays.
    obs = _obs(limit=1100 * MiB)
    out = fit_memory(Allocation((3, 6), (16 * MiB, 16 * MiB)), obs)
    assert out.workers == (3, 4)


def _fusion_obs(fusable, fused=None, cpus=2.0) -> Observation:
    fused = fused or (False,) * len(fusable)
    stages = tuple(
        StageStats(
            f"s{i}",
            0 if f else 1,
            items_per_s=10.0,
            busy=0.9,
            cpu_s_per_item=0.09,
            buffer_bytes=MiB,
            fusable=ok,
            fused=f,
        )  # fmt: skip
        for i, (ok, f) in enumerate(zip(fusable, fused, strict=True))
    )
    return Observation(stages, 10.0, cpus, 1 << 40, 0)


def test_the_guard_drops_fusion_the_pipeline_would_refuse():
    obs = _fusion_obs((False, True, False, True))
    want = Allocation((1,) * 4, (MiB,) * 4, fused=(False, True, True, True))
    # Stage 2 may not fuse (stateful, another worker type...): it stays split, the rest fuse.
    assert fusable_only(want, obs).fused == (False, True, False, True)
    # A host runs at most MAX_FUSED stages after it, checked in the order a pipeline applies
    # them: the next stage stays split and hosts the rest.
    n = MAX_FUSED + 3
    long = _fusion_obs((False,) + (True,) * (n - 1))
    got = fusable_only(Allocation((1,) * n, (MiB,) * n, fused=(False,) + (True,) * (n - 1)), long)
    assert got.fused == (False,) + (True,) * MAX_FUSED + (False, True)
    # Splitting is always allowed; leaving fusion open stays open.
    fused = _fusion_obs((False, True), fused=(False, True))
    assert fusable_only(Allocation((1, 1), (MiB, MiB), fused=(False, False)), fused).fused == (
        False,
        False,
    )
    assert fusable_only(Allocation((1, 1), (MiB, MiB)), fused).fused == ()
    # Guarded applies it with the other limits: the simulator, like a live pipeline, would raise.
    assert within_limits(want, obs).fused == (False, True, False, True)


def test_a_fused_stages_worker_target_costs_no_cpu_and_no_memory():
    obs = _fusion_obs((False, True, True), fused=(False, True, True), cpus=2.0)
    alloc = Allocation((2, 9, 9), (MiB,) * 3, fused=(False, True, True))
    # Nine workers each are targets for when the stages are split again: nothing to clamp.
    assert safe(alloc, obs) == alloc
    parts = memory_parts(obs)
    assert parts.worst_case_bytes(alloc) == parts.worst_case_bytes(alloc.replace(workers=(2, 1, 1)))


def test_a_fused_stage_split_or_a_stage_fused_is_charged_the_cache_it_may_bring():
    # A reader whose 4 workers hold 150 MiB each, hosting a fused stage; a UDF of 2 workers
    # whose each hold a 400 MiB cache beside their own 150.
    stages = (
        StageStats("read", 4, items_per_s=10.0, memory_bytes=4 * 550 * MiB),
        StageStats("cache", 0, items_per_s=10.0, fused=True),
        StageStats("udf", 2, items_per_s=10.0, memory_bytes=2 * 550 * MiB),
        StageStats("batch", 1, items_per_s=1.0, memory_bytes=150 * MiB),
    )
    obs = Observation(stages, 1.0, 8.0, 1 << 40, (6 * 550 + 150) * MiB)
    parts = memory_parts(obs)
    # Split, the fused stage's workers may hold all that its host's hold (its cache or not).
    assert parts.per_worker_bytes == (550 * MiB, 550 * MiB, 550 * MiB, 150 * MiB)
    assert parts.lightest_bytes == 150 * MiB
    buffers = (0, 0, 0, 0)
    split = Allocation((4, 3, 2, 1), buffers, fused=(False, False, False, False))
    assert parts.worst_case_bytes(split) == pytest.approx((9 * 550 + 150) * MiB, abs=1)
    # Fused into the reader, the UDF's cache moves into each of the reader's workers.
    fused = Allocation((4, 3, 2, 1), buffers, fused=(False, True, True, False))
    assert parts.worst_case_bytes(fused) == pytest.approx((4 * 950 + 150) * MiB, abs=1)


def test_a_worker_hosting_fused_stages_is_charged_what_the_group_does():
    # A reader of 7.5 us of CPU per row hosting two lookups that wait ~240 us per row on a
    # store and a 50 us feature map: each worker computes 70 of its 550 us per row. Charged
    # the reader's own half core, 16 CPUs held the group to 34 workers while the best
    # static allocation runs 62.
    def stage(name, cpu, busy, **kw):
        return StageStats(name, 0, items_per_s=112_000.0, busy=busy, cpu_s_per_item=cpu, **kw)

    host = dataclasses.replace(stage("read", 7.5e-6, 7.5 / 550), workers=62)
    lookups = [stage(n, 6e-6, 244 / 550, io_bound=True, fused=True) for n in ("a", "b")]
    features = stage("features", 50e-6, 50 / 550, fused=True)
    obs = Observation((host, *lookups, features), 27.0, 16.0, 1 << 40, 0)
    charge = charges(obs)[0]
    assert charge == pytest.approx((0.5 * 57.5 + 0.1 * 488) / 545.5, rel=1e-6)  # the floors
    assert 0.12 < charge < 0.15
    alloc = Allocation((62, 1, 1, 1), (MiB,) * 4, fused=(False, True, True, True))
    assert safe(alloc, obs) == alloc
    # An I/O reader hosting a map that computes all its workers' time is charged its cores.
    reader = dataclasses.replace(host, workers=8, busy=0.1, cpu_s_per_item=1e-6, io_bound=True)
    heavy = stage("map", 8 / 112_000.0, 0.9, fused=True)
    obs = Observation((reader, heavy), 112_000.0, 16.0, 1 << 40, 0)
    assert charges(obs)[0] == pytest.approx(1.0)


def test_over_the_cpu_budget_growth_is_refused_before_what_runs_is_cut():
    # 62 readers waiting on I/O (0.1 of a core each) and 22 CPU workers on 32 cores: charged
    # 6.2 + 22 + 4, within the budget. The tuner asks for 4 more CPU workers: they are
    # refused, and the readers, the largest stage, keep all 62.
    stages = (
        StageStats("read", 62, items_per_s=1e5, busy=0.9, cpu_s_per_item=2e-5, io_bound=True),
        StageStats("udf", 22, items_per_s=1e5, busy=1.0, cpu_s_per_item=2.2e-4),
        StageStats("batch", 4, items_per_s=1e3, busy=1.0, cpu_s_per_item=4e-3),
    )
    obs = Observation(stages, 1e3, cpus=32, memory_limit_bytes=64 << 30, memory_used_bytes=0)
    assert safe(obs.allocation(), obs).workers == (62, 22, 4)
    got = safe(Allocation((62, 26, 4), (MiB,) * 3), obs)
    assert got.workers[0] == 62 and 22 <= got.workers[1] < 26


def test_a_stage_split_out_of_its_group_takes_the_groups_workers_not_growth():
    # A reader of 4 workers (100 MiB each) hosting a UDF, which a fused stage reports with 0
    # workers of its own, and a batcher; memory holds about 5 such workers.
    stages = (
        StageStats("read", 4, items_per_s=10.0, memory_bytes=4 * 100 * MiB),
        StageStats("udf", 0, items_per_s=10.0, fused=True),
        StageStats("batch", 1, items_per_s=1.0, memory_bytes=50 * MiB),
    )
    obs = Observation(stages, 1.0, 8.0, int(500 * MiB / MEMORY_SAFE_SHARE), 450 * MiB)
    # The UDF split out with 3 workers, the reader down to 2: one worker more than fits.
    split = Allocation((2, 3, 1), (0, 0, 0), fused=(False, False, False))
    got = fit_memory(split, obs)
    # Its 3 workers are its group's, not growth over 0: one worker is shed where they hold the
    # most, and no stage is left without a worker.
    assert got.workers == (2, 2, 1)
    assert memory_parts(obs).worst_case_bytes(got) <= MEMORY_SAFE_SHARE * obs.memory_limit_bytes
    # Over the CPU budget too, its workers are not the first refused as growth.
    cpu = safe(Allocation((2, 7, 1), (MiB,) * 3, fused=(False, False, False)), obs)
    assert cpu.workers[1] >= cpu.workers[0] >= 1
