import dataclasses

import pytest

from torchtune_pipe.tuning import AutotuneTuner, Guarded, MiB, Observation, StageStats, run_episode
from torchtune_pipe.tuning.autotune import AutotuneConfig, LegacyPrefetch
from torchtune_pipe.tuning.safety import CPU_MIN_CHARGE
from torchtune_pipe.tuning.testing import LinearTunable
from torchtune_pipe.tuning.tfdata_model import ChainModel, hill_climb, stage_based, wait_time

BIG = float("inf")


def test_wait_time_cases_by_hand():
    assert wait_time(0.0, 5.0, 3) == 0.0  # producer infinitely fast
    assert wait_time(2.0, 0.0, 3) == 2.0  # consumer infinitely fast: always wait
    assert wait_time(3.0, 3.0, 2) == pytest.approx(1.0)  # y / (n + 1)
    # x > y: p = (1 - x/y) / (1 - (x/y)^(n+1)) = (1 - 2) / (1 - 4) = 1/3, times y = 1.
    assert wait_time(1.0, 2.0, 1) == pytest.approx(1 / 3)
    # x < y: p = (1 - 1/2) / (1 - 1/4) = 2/3, times y = 2.
    assert wait_time(2.0, 1.0, 1) == pytest.approx(4 / 3)


def test_output_time_two_stage_chain_by_hand():
    # source: self 10 ms, p=1; map: self 20 ms, p=2; legacy prefetch of 1 element.
    m = ChainModel(self_times=(0.01, 0.02), ratios=(0.0, 1.0), element_bytes=(1.0, 1.0))
    # input times: map 0.02/2 = 0.01; source 0.01 + 0.01 = 0.02.
    # map: consumer 0.01 == producer out(source) 0.01, n=2 -> wait 0.01/3.
    # prefetch: consumer 0 -> waits the whole producer time.
    assert m.output_time((1, 2), 1) == pytest.approx(0.01 + 0.01 / 3)
    # map self 40 ms: consumer 0.02 > producer 0.01, r = 1/2, p = (1/4)(1/2)/(1 - 1/8) = 1/7.
    m2 = ChainModel((0.01, 0.04), (0.0, 1.0), (1.0, 1.0))
    assert m2.output_time((1, 2), 1) == pytest.approx(0.02 + 0.01 / 7)


def test_total_processing_time_and_memory_with_batch_ratio():
    m = ChainModel((0.001, 0.05), (0.0, 32.0), (100.0, 3200.0))
    assert m.total_processing_time() == pytest.approx(0.05 + 32 * 0.001)
    # parallelism x element size / memory ratio (= ratio for AsyncKnownRatio).
    assert m.max_buffered_bytes((2, 4)) == pytest.approx(2 * 100 + 4 * 3200 / 32)
    assert m.max_buffered_bytes((2, 4), prefetch_buffer=3) == pytest.approx(600 + 3 * 3200)


def test_greedy_climb_first_step_goes_to_the_bottleneck():
    m = ChainModel((0.01, 0.04), (0.0, 1.0), (1.0, 1.0))
    # Budget for exactly one +1 (3 elements of 1 byte): the second +1 is undone.
    values, _, mem = hill_climb(m, lo=(1, 1), hi=(8, 8), ram_budget=3.0)
    assert values == [1, 2] and mem == 3.0
    values, _, _ = hill_climb(m, lo=(1, 1), hi=(8, 8), ram_budget=5.0)
    assert values[1] > values[0]


def test_max_parallelism_climbs_to_the_cap_on_ties_hill_climb_stops_on_cpu():
    m = ChainModel((0.01, 0.04), (0.0, 1.0), (1.0, 1.0))
    values, _, _ = hill_climb(m, lo=(1, 1), hi=(6, 6), ram_budget=BIG)
    assert values == [6, 6]  # the default never consults the CPU budget
    values, _, _ = hill_climb(m, lo=(1, 1), hi=(6, 6), ram_budget=BIG, cpu_budget=4)
    assert sum(values) < 12 and values[1] >= values[0]
    assert m.output_time(values, 1) < m.total_processing_time() / 4


def test_hill_climb_tunes_prefetch_when_not_legacy():
    m = ChainModel((0.01, 0.01), (0.0, 1.0), (1.0, 1.0))
    values, buf, _ = hill_climb(m, (1, 1), (1, 1), ram_budget=6.0, tune_prefetch=True)
    assert values == [1, 1] and buf >= 1


def test_stage_based_by_hand():
    m = ChainModel((0.01, 0.04), (0.0, 1.0), (1.0, 1.0))
    ema = (0.01, 0.04)
    # Target 0: climb the slowest stage; stop as soon as the slowest one is at its max
    # (map 40 -> 20 -> 13.3 -> 10 ms at p=4, then the source 10 -> 5 ms, then map is stuck).
    assert stage_based(m, ema, (1, 1), (4, 4), BIG, 0.0) == ([2, 4], 6.0)
    # Target 15 ms: map needs 3 workers (40/3 = 13.3 ms), the source already meets it.
    assert stage_based(m, ema, (1, 1), (8, 8), BIG, 0.015)[0] == [1, 3]
    # Passing the RAM budget abandons the round.
    assert stage_based(m, ema, (1, 1), (8, 8), 2.5, 0.0) is None


def test_legacy_prefetch_doubles_on_drain_and_never_shrinks():
    pf = LegacyPrefetch()
    ok = lambda new: True  # noqa: E731
    assert pf.limit == 1
    assert not pf.record(0.0, 0.9, 0.05, ok)  # empty in upswing: no growth
    pf.record(1.0, 0.9, 0.05, ok)  # full -> downswing
    assert pf.record(0.0, 0.9, 0.05, ok) and pf.limit == 2
    pf.record(1.0, 0.9, 0.05, ok)
    pf.record(0.0, 0.9, 0.05, ok)
    assert pf.limit == 4
    seen = [pf.limit]
    for fill in (0.5, 1.0, 0.3, 0.0, 1.0, 1.0, 0.0, 0.2, 0.0, 1.0):
        pf.record(fill, 0.9, 0.05, ok)
        seen.append(pf.limit)
    assert seen == sorted(seen) and seen[-1] > 4
    big = LegacyPrefetch(2048)
    big.record(1.0, 0.9, 0.05, ok)
    big.record(0.0, 0.9, 0.05, ok)
    assert big.limit == 4096  # linear steps of 2048 past the threshold


def test_legacy_prefetch_waits_for_ram():
    pf = LegacyPrefetch()
    pf.record(1.0, 0.9, 0.05, lambda new: True)
    assert not pf.record(0.0, 0.9, 0.05, lambda new: False) and pf.limit == 1
    assert pf.record(0.0, 0.9, 0.05, lambda new: True) and pf.limit == 2


def test_optimisation_schedule_doubles_to_60s():
    pipe = LinearTunable((0.01, 0.02), cpus=4)
    tuner = AutotuneTuner()
    pipe.apply(tuner.reset(pipe.observe()))
    rounds_at = []
    for _ in range(199):
        obs = pipe.observe()
        before = tuner.rounds
        pipe.apply(tuner.step(obs))
        if tuner.rounds > before:
            rounds_at.append(obs.t)
    # Reset at t=1; periods 10 ms, 20 ms, ... 640 ms, 1.28 s, ... 40.96 s, then 60 s.
    assert rounds_at == [2, 3, 4, 5, 6, 7, 8, 10, 13, 19, 30, 51, 92, 152]


def test_parallelism_capped_at_start_cpus_adaptive_relaunches():
    final = {}
    for adaptive in (False, True):
        tuner = AutotuneTuner(adaptive=adaptive)
        inner = LinearTunable((0.01, 0.01), cpus=4)
        pipe = Guarded(inner)  # the hard limits, as every driver applies them
        pipe.apply(tuner.reset(pipe.observe()))
        for _ in range(10):
            pipe.apply(tuner.step(pipe.observe()))
        assert sum(inner.allocation.workers) == 5  # 4 busy CPUs and the spare core
        inner.cpus = 16
        for _ in range(10):
            pipe.apply(tuner.step(pipe.observe()))
        final[adaptive] = inner.allocation.workers
    assert final[False] == (4, 4)  # thread pool sized at start: added CPUs stay unused
    assert min(final[True]) >= 8  # re-launched with the new CPU count


def test_ram_budget_counts_modelled_bytes_only():
    stages = (
        StageStats("src", 1, items_per_s=100.0, busy=1.0, cpu_s_per_item=0.01),
        StageStats("map", 1, items_per_s=100.0, busy=1.0, cpu_s_per_item=0.01),
    )
    obs = Observation(
        stages, 100.0, cpus=16, memory_limit_bytes=100 * MiB, memory_used_bytes=30 * MiB, t=1.0
    )
    tuner = AutotuneTuner(element_bytes=10 * MiB)
    tuner.reset(obs)
    assert tuner.ram_budget(obs) == pytest.approx(50 * MiB)  # 0.5 x (70 free + 30 buffered)
    alloc = tuner.step(dataclasses.replace(obs, t=2.0))  # the first round is due
    # 50 MiB less one legacy prefetch element leaves 40 MiB: four 10 MiB elements in total.
    assert sum(alloc.workers) == 4
    assert AutotuneTuner(ram_budget_bytes=7).ram_budget(obs) == 7


def test_config_validation():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        AutotuneConfig(algorithm="gradient")
    with pytest.raises(ValueError, match="element_bytes has 1 entries"):
        AutotuneTuner(element_bytes=(MiB,)).reset(LinearTunable((1, 1), cpus=2).observe())


@pytest.mark.parametrize("algorithm", ["hill_climb", "stage_based"])
def test_other_algorithms_run_end_to_end(algorithm):
    pipe = LinearTunable((0.01, 0.03), cpus=8)
    trace = run_episode(pipe, AutotuneTuner(algorithm=algorithm), steps=20)
    # tf.data caps each op at the CPU count; the safety policy caps the total at one core per
    # CPU_MIN_CHARGE of a CPU-bound worker.
    assert max(trace[-1].workers) <= 8
    assert sum(trace[-1].workers) <= 8 / CPU_MIN_CHARGE
    assert trace[-1].workers[1] >= trace[-1].workers[0]


def _chain_of_maps(n: int) -> Observation:
    stages = tuple(
        StageStats(f"s{i}", 1, items_per_s=100.0, busy=0.5, cpu_s_per_item=0.005, fusable=i > 0)
        for i in range(n)
    )
    return Observation(stages, 100.0, 8.0, 1 << 34, 0)


def test_map_fusion_is_a_static_rewrite_off_by_default_as_in_tf_data():
    from multiproc.stats import MAX_FUSED

    obs = _chain_of_maps(MAX_FUSED + 3)
    assert AutotuneTuner().reset(obs).fused == ()
    tuner = AutotuneTuner(map_fusion=True)
    # At most MAX_FUSED stages in one host; the next stage hosts the rest.
    fused = (False,) + (True,) * MAX_FUSED + (False, True)
    assert tuner.reset(obs).fused == fused
    assert tuner.step(obs).fused == fused
