import pytest

from torchtune_pipe.tuning import MiB, Observation, PlumberTuner, StageStats, run_episode
from torchtune_pipe.tuning.plumber import plan, solve_lp, stage_rates, workers_from_theta
from torchtune_pipe.tuning.safety import oversubscribe_factor
from torchtune_pipe.tuning.testing import LinearTunable


def test_lp_three_stages_by_hand():
    # theta_i = t / r_i and sum theta = 7: t (1/10 + 1/5 + 1/20) = 7 -> t = 20, theta = 2, 4, 1.
    theta, t = solve_lp((10.0, 5.0, 20.0), 7)
    assert t == pytest.approx(20.0)
    assert theta == pytest.approx((2.0, 4.0, 1.0), abs=1e-6)
    assert workers_from_theta(theta) == (2, 4, 1)  # solver round-off does not add a worker


def test_lp_fractional_theta_is_rounded_up():
    theta, t = solve_lp((10.0, 5.0, 20.0), 8)
    assert t == pytest.approx(8 / 0.35)
    assert theta == pytest.approx((t / 10, t / 5, t / 20), rel=1e-6)
    assert workers_from_theta(theta) == (3, 5, 2)  # ceil(2.29, 4.57, 1.14)


def test_lp_sequential_stage_cap_and_free_stage():
    theta, t = solve_lp((10.0, 5.0, 20.0), 7, caps=(7, 1, 7))
    assert t == pytest.approx(5.0) and theta[1] == pytest.approx(1.0)
    theta, t = solve_lp((10.0, float("inf")), 4)
    assert t == pytest.approx(40.0) and theta[1] == 0.0
    assert workers_from_theta(theta) == (4, 1)
    with pytest.raises(ValueError, match="rates must be positive"):
        solve_lp((1.0, 0.0), 4)
    with pytest.raises(ValueError, match="cores must be positive"):
        solve_lp((1.0,), 0)


def _profile(workers=(1, 1, 1), busy=(1.0, 1.0, 1.0)):
    # Costs per root item 0.1, 0.2, 0.05 s: rates per core 10, 5, 20 root items/s.
    cost = (0.1, 0.2, 0.05)
    stages = tuple(
        StageStats(f"s{i}", w, items_per_s=5.0, busy=b, cpu_s_per_item=c)
        for i, (w, b, c) in enumerate(zip(workers, busy, cost, strict=True))
    )
    return Observation(stages, 5.0, cpus=7, memory_limit_bytes=1 << 30, memory_used_bytes=0)


def test_rates_from_one_interval_with_batching():
    stages = (
        StageStats("read", 2, items_per_s=3200.0, busy=0.5, cpu_s_per_item=0.0005),
        StageStats("batch", 1, items_per_s=100.0, busy=0.5, cpu_s_per_item=0.005),
    )
    obs = Observation(stages, 100.0, cpus=4, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    # read: 32 items per batch x 0.5 ms = 16 ms per batch -> 62.5 batches/s per core.
    assert stage_rates(obs) == pytest.approx((62.5, 200.0))
    unmeasured = Observation((StageStats("a", 1),), 0.0, 4, 1 << 30, 0)
    assert stage_rates(unmeasured) is None


def test_plan_prefetch_by_littles_law():
    p = plan(_profile(busy=(1.0, 1.0, 1.0)))
    assert p.rates == pytest.approx((10.0, 5.0, 20.0))
    assert p.workers == (2, 4, 1) and p.throughput == pytest.approx(20.0)
    # N* = (0.1 + 0.2 + 0.05) s x 20/s = 7 in flight; 3 busy workers already: prefetch 4.
    assert p.prefetch_items == 4


def test_tuner_profiles_once_then_holds_the_plan():
    pipe = LinearTunable((0.1, 0.2, 0.05), cpus=7)
    tuner = PlumberTuner(element_bytes=2 * MiB)
    trace = run_episode(pipe, tuner, steps=5)
    assert tuner.solves == 1
    assert trace[-1].workers == (2, 4, 1)
    assert trace[-1].throughput == pytest.approx(20.0)
    assert trace[-1].buffer_bytes[-1] == tuner.plan.prefetch_items * 2 * MiB
    # More CPUs arrive: plain Plumber keeps its plan.
    pipe.cpus = 14
    for _ in range(3):
        pipe.apply(tuner.step(pipe.observe()))
    assert tuner.solves == 1 and pipe.allocation.workers == (2, 4, 1)


def test_adaptive_resolves_on_cpu_change():
    pipe = LinearTunable((0.1, 0.2, 0.05), cpus=7)
    tuner = PlumberTuner(adaptive=True)
    run_episode(pipe, tuner, steps=3)
    pipe.cpus = 14
    for _ in range(3):
        pipe.apply(tuner.step(pipe.observe()))
    assert tuner.solves == 2
    assert pipe.allocation.workers == (4, 8, 2)
    # Fewer CPUs: the held plan is clamped by the safety rules, then re-solved.
    pipe.cpus = 3.5
    obs = pipe.observe()
    pipe.apply(tuner.step(obs))
    assert tuner.solves == 3
    assert sum(pipe.allocation.workers) <= int(3.5 * oversubscribe_factor(obs) + 0.5) < 14


def test_io_bound_stage_gets_the_workers_its_wall_rate_needs():
    stages = (
        StageStats("read", 1, items_per_s=10.0, busy=0.1, cpu_s_per_item=0.01, io_bound=True),
        StageStats("map", 1, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.1),
    )
    obs = Observation(stages, 10.0, cpus=4, memory_limit_bytes=1 << 30, memory_used_bytes=0)
    p = plan(obs)
    # LP: t (1/100 + 1/10) = 4 -> t = 36.4, theta = (0.36, 3.64) -> CPU share (1, 4).
    assert p.throughput == pytest.approx(4 / 0.11)
    # One read worker delivers 10/s of wall time: 36.4/s needs ceil(3.64) = 4 of them.
    assert p.workers == (4, 4)


def test_a_fused_group_is_one_node_of_the_lp():
    # The map runs in the source's 2 workers: its CPU is the source node's, and Plumber keeps
    # the shape (it never fuses or splits).
    src = StageStats("src", 2, items_per_s=100.0, busy=0.5, cpu_s_per_item=0.004)
    udf = StageStats("udf", 0, items_per_s=100.0, busy=0.5, cpu_s_per_item=0.006, fused=True,
                     fusable=True)  # fmt: skip
    obs = Observation((src, udf), 100.0, 4.0, 1 << 30, 0)
    rates = stage_rates(obs)
    assert rates[0] == pytest.approx(1 / 0.010) and rates[1] == float("inf")
    p = plan(obs)
    assert p.workers[0] == 4 and p.throughput == pytest.approx(400.0)
    tuner = PlumberTuner()
    tuner.reset(obs)
    assert tuner.step(obs).fused == ()  # as it runs
