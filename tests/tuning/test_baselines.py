import dataclasses

import pytest

from torchtune_pipe.tuning import (
    TUNERS,
    Allocation,
    HeuristicTuner,
    MiB,
    Observation,
    StageStats,
    StaticTuner,
    Tuner,
    UnoptimizedTuner,
    even_split,
    is_io_bound,
    make_tuner,
    oversubscribe_factor,
)
from torchtune_pipe.tuning.base import waits_on_io
from torchtune_pipe.tuning.safety import SPARE_CORES, safe, within_limits


def obs_of(workers=(1, 1, 1), cpus=10.0, memory=1 << 30, **stage_kw):
    stages = tuple(
        StageStats(name=f"s{i}", workers=w, items_per_s=100.0, busy=1.0, **stage_kw)
        for i, w in enumerate(workers)
    )
    return Observation(
        stages, throughput=100.0, cpus=cpus, memory_limit_bytes=memory, memory_used_bytes=0
    )


def test_even_split_gives_remainder_to_first_stages():
    assert even_split(10, 3) == (4, 3, 3)
    assert even_split(11, 3) == (4, 4, 3)
    assert even_split(9, 3) == (3, 3, 3)
    assert even_split(2, 3) == (1, 1, 1)  # never fewer than one each
    with pytest.raises(ValueError, match="n must be"):
        even_split(4, 0)


def test_heuristic_splits_cpus_evenly():
    tuner = HeuristicTuner()
    alloc = tuner.reset(obs_of(cpus=10))
    assert alloc.workers == (4, 3, 3)
    assert alloc.buffer_bytes == (64 * MiB,) * 3
    assert tuner.step(obs_of(cpus=10)) == alloc
    assert HeuristicTuner().reset(obs_of(cpus=7.5)).workers == (3, 2, 2)


def test_heuristic_memory_fraction_split():
    alloc = HeuristicTuner(buffer_bytes=None, memory_fraction=0.5).reset(
        obs_of(cpus=3, memory=300 * MiB)
    )
    assert alloc.buffer_bytes == (50 * MiB,) * 3
    with pytest.raises(ValueError, match="memory_fraction"):
        HeuristicTuner(memory_fraction=0.0)


def test_unoptimized_one_worker_min_buffers():
    alloc = UnoptimizedTuner().reset(obs_of(cpus=16))
    assert alloc == Allocation((1, 1, 1), (MiB, MiB, MiB))
    stages = tuple(StageStats(name=f"s{i}", workers=1, min_workers=m) for i, m in enumerate((2, 1)))
    obs = Observation(stages, 0.0, cpus=8, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    assert UnoptimizedTuner().reset(obs).workers == (2, 1)


def test_static_returns_given_allocation_and_checks_length():
    tuner = StaticTuner(workers=(2, 3, 1), buffer_bytes=8 * MiB)
    assert tuner.reset(obs_of(cpus=10)) == Allocation((2, 3, 1), (8 * MiB,) * 3)
    with pytest.raises(ValueError, match="2 entries but the pipeline has 3 stages"):
        StaticTuner(workers=(1, 1)).reset(obs_of())
    with pytest.raises(ValueError, match="positive"):
        StaticTuner(workers=(0, 1))


def test_fixed_tuners_are_clamped_to_cpu_and_memory():
    tuner = StaticTuner(workers=(8, 8, 8), buffer_bytes=(400 * MiB, 400 * MiB, 200 * MiB))
    # Busy CPU-bound stages: 6 CPUs plus the measured pipeline's spare core.
    obs = obs_of(cpus=6, memory=500 * MiB)
    alloc = within_limits(tuner.reset(obs), obs)
    assert sum(alloc.workers) == 7 and min(alloc.workers) >= 1
    assert sum(alloc.buffer_bytes) <= 500 * MiB
    # The machine shrinks: the same tuner's decision obeys the new budget at the next step.
    obs = obs_of(cpus=3, memory=500 * MiB)
    assert sum(within_limits(tuner.step(obs), obs).workers) == 4
    # Never fewer than one worker per stage, even with fewer CPUs than stages.
    obs = obs_of(cpus=1)
    assert within_limits(tuner.step(obs), obs).workers == (1, 1, 1)


def test_io_bound_is_the_measured_flag_of_one_rule():
    # The rule: less than IO_CPU_SHARE of the busy (in-function) time on a CPU.
    assert waits_on_io(0.1, 1.0) and not waits_on_io(0.6, 1.0)
    assert not waits_on_io(0.0, 0.0)  # nothing ran
    # Tuners read its verdict, as both sides of the seam set it.
    assert is_io_bound(StageStats("a", 1, io_bound=True))
    # Stats without it (built by hand, an old log) are not I/O-bound, whatever their shares.
    assert not is_io_bound(StageStats("a", 1, items_per_s=5.0, busy=0.1, blocked_in=0.05))
    assert not is_io_bound(StageStats("a", 1))  # nothing measured yet


def test_io_bound_stages_may_oversubscribe():
    stages = (
        StageStats("read", 4, items_per_s=10.0, busy=0.25, io_bound=True),
        StageStats("udf", 2, items_per_s=10.0, busy=1.0),
    )
    obs = Observation(stages, 10.0, cpus=4, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    want = Allocation((4, 2), (MiB, MiB))
    # Four reader workers at 25% busy free 3 cores, plus the spare core:
    # cap = 4 * (1 + (3 + 1) / 4) = 8 workers.
    assert oversubscribe_factor(obs, want) == pytest.approx(2.0)
    assert safe(want, obs) == want
    # Without the I/O stage the same request is cut to the 4 CPUs and the spare core.
    cpu_only = Observation((stages[1], stages[1]), 10.0, 4, 1 << 30, 0)
    assert sum(safe(want, cpu_only).workers) == 5
    # The factor is capped at 4x.
    many = Allocation((40, 2), (MiB, MiB))
    assert oversubscribe_factor(obs, many) == 4.0
    assert sum(safe(many, obs).workers) == 16


def test_a_worker_sleeping_on_io_is_charged_its_cpu_not_its_wall_time():
    # A remote read: workers are busy (inside the stage function) all the time, but each
    # uses 5 ms of CPU per item at 10 items/s per worker = 5% of a core (floored at 10%).
    reader = StageStats("read", 2, items_per_s=20.0, busy=1.0, cpu_s_per_item=0.005, io_bound=True)
    udf = StageStats("udf", 1, items_per_s=20.0, busy=1.0, cpu_s_per_item=0.04)
    obs = Observation((reader, udf), 20.0, cpus=2, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    want = Allocation((3, 1), (MiB, MiB))
    # Three readers free 3 x 0.9 cores and the UDF worker, at 0.04 s x 20 items/s = 0.8 of a
    # core, frees 0.2; with the spare core: cap = 2 x (1 + (2.9 + 1) / 2) = 5.9 workers.
    assert oversubscribe_factor(obs, want) == pytest.approx(2.95)
    assert safe(want, obs) == want


def test_cpu_bound_workers_are_charged_their_share_down_to_half_a_core():
    # Two UDF workers blocked on the consumer half the time use half a core each: four of
    # them fit on two cores (with the spare core, six). Busier ones, or ones never measured,
    # are charged a full core.
    half = StageStats("udf", 2, items_per_s=10.0, busy=0.5, blocked_out=0.5)
    obs = Observation((half,), 10.0, cpus=2, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    assert oversubscribe_factor(obs, Allocation((4,), (MiB,))) == pytest.approx(2.5)
    # Workers held back by a full output buffer 90% of the time compute 10% of it: charged
    # that (waiting uses no core); 4 of them free 3.6 cores -> factor 1 + (3.6 + 1) / 2.
    held = dataclasses.replace(half, busy=0.1, blocked_out=0.9)
    obs = Observation((held,), 10.0, cpus=2, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    assert oversubscribe_factor(obs, Allocation((4,), (MiB,))) == pytest.approx(3.3)
    # Busy 40% and blocked 30%: not mostly waiting, so the half-core floor holds.
    mixed = dataclasses.replace(half, busy=0.4, blocked_out=0.3)
    obs = Observation((mixed,), 10.0, cpus=2, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    assert oversubscribe_factor(obs, Allocation((4,), (MiB,))) == pytest.approx(2.5)
    busy = dataclasses.replace(half, busy=1.0, blocked_out=0.0)
    obs = Observation((busy,), 10.0, cpus=2, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    assert sum(safe(Allocation((4,), (MiB,)), obs).workers) == 3
    # Nothing measured yet: a full core each and no spare core.
    unmeasured = StageStats("udf", 2)
    obs = Observation((unmeasured,), 0.0, cpus=2, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    assert oversubscribe_factor(obs, Allocation((4,), (MiB,))) == pytest.approx(1.0)
    assert sum(safe(Allocation((4,), (MiB,)), obs).workers) == 2


def test_the_spare_core_is_one_worker_whatever_the_machine():
    # Busy CPU-bound workers measured at one per core: one more worker to try, not a share.
    for cpus in (1, 2, 16, 128):
        busy = StageStats("udf", cpus, items_per_s=10.0 * cpus, busy=1.0)
        obs = Observation((busy,), 10.0, cpus, memory_limit_bytes=1 << 30, memory_used_bytes=0)
        want = Allocation((4 * cpus,), (MiB,))
        assert oversubscribe_factor(obs, want) == pytest.approx(1.0 + SPARE_CORES / cpus)
        assert safe(want, obs).workers == (cpus + 1,)


def test_safe_rejects_wrong_stage_count():
    with pytest.raises(ValueError, match="allocation has 2 stages but the pipeline has 3"):
        safe(Allocation((1, 1), (MiB, MiB)), obs_of())


def test_registry_makes_every_baseline():
    assert set(TUNERS) >= {
        "static",
        "unoptimized",
        "heuristic",
        "autotune",
        "autotune-adaptive",
        "plumber",
        "plumber-adaptive",
        "oracle",
        "intune",
    }
    obs = obs_of(cpus=6)
    for name in TUNERS:
        if name == "intune":
            continue
        kw = {"workers": (1, 2, 3)} if name == "static" else {}
        tuner = make_tuner(name, **kw)
        assert isinstance(tuner, Tuner)
        alloc = within_limits(tuner.reset(obs), obs)
        assert len(alloc.workers) == 3 and sum(alloc.workers) <= 7  # 6 CPUs + the spare core
        assert len(tuner.step(obs).workers) == 3
    assert make_tuner("autotune-adaptive").config.adaptive
    assert make_tuner("plumber-adaptive").adaptive
    with pytest.raises(ValueError, match="unknown tuner 'nope'"):
        make_tuner("nope")
