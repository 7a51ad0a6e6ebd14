import pytest

from torchtune_pipe.tuning import MiB, Observation, StageStats
from torchtune_pipe.tuning.base import Allocation
from torchtune_pipe.tuning.intune import ActionSpace
from torchtune_pipe.tuning.planner import plan


def _read_udf(cpus=4.0, consumer_step_s=0.0, limit=1 << 40):
    # A remote read (2 workers, 10 ms CPU per item, waiting the rest) feeding one UDF worker
    # that spends 100 ms of CPU per item; both deliver 10 items/s.
    read = StageStats("read", 2, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.01, io_bound=True)
    udf = StageStats("udf", 1, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.1)
    return Observation(
        (read, udf), 10.0, cpus, limit, 0, consumer_step_s=consumer_step_s
    ), Allocation((2, 1), (MiB, MiB))


def test_plan_balances_measured_rates_within_the_charged_cpu_budget():
    obs, alloc = _read_udf()
    p = plan(obs, alloc)
    # Per item: read 0.2 worker-s (0.01 CPU), udf 0.1 worker-s (0.1 CPU). At rate T with 1.2x
    # headroom: ceil(0.24 T) readers, each charged max(0.1, its CPU at T) = 0.1 core, and
    # ceil(0.12 T) UDF workers burning 0.1 T cores in all. 0.1 ceil(0.24 T) + 0.1 T <= 4
    # holds up to T = 32: (8, 4) uses exactly the 4 cores.
    assert p.allocation.workers == (8, 4)
    assert p.throughput == pytest.approx(32.0, rel=1e-6)
    assert p.allocation.buffer_bytes == alloc.buffer_bytes


def test_plan_stops_at_the_consumer_rate():
    obs, alloc = _read_udf(consumer_step_s=0.1)  # the model takes 10 items/s
    p = plan(obs, alloc)
    assert p.throughput == pytest.approx(10.0)
    assert p.allocation.workers == (3, 2)


def test_plan_keeps_worst_case_memory_within_the_limit():
    obs, alloc = _read_udf(limit=1024 * MiB)
    p = plan(obs, alloc, per_worker_bytes=200 * MiB)
    assert sum(p.allocation.workers) * 200 * MiB + 2 * MiB <= 0.9 * 1024 * MiB
    assert p.allocation.workers == (2, 1)


def test_contention_is_not_mistaken_for_waiting():
    # Two CPU-bound stages of 4 workers on 4 cores: each worker got half a core (0.2 CPU-s per
    # item took 0.4 s of wall time). The plan must see 0.2 s of work per item, not 0.4.
    stages = tuple(
        StageStats(f"s{i}", 4, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.2) for i in range(2)
    )
    obs = Observation(stages, 10.0, 4.0, 1 << 40, 0)
    p = plan(obs, Allocation((4, 4), (MiB, MiB)))
    # 0.4 CPU-s per item in all on 4 cores: T = 10, with ceil(1.2 x 0.2 x 10) = 3 workers per
    # stage (not the 5 that 0.4 s of wall time per item would ask for).
    assert p.allocation.workers == (3, 3)
    assert p.throughput == pytest.approx(10.0, rel=1e-6)


def test_nothing_measured_gives_no_plan():
    obs = Observation((StageStats("a", 1), StageStats("b", 1)), 0.0, 4.0, 1 << 30, 0)
    assert plan(obs, Allocation((1, 1), (MiB, MiB))) is None
    with pytest.raises(ValueError, match="headroom must be >= 1"):
        plan(obs, Allocation((1, 1), (MiB, MiB)), headroom=0.5)


def test_plan_action_is_open_only_when_the_plan_moves_workers():
    obs, alloc = _read_udf()
    space = ActionSpace(2)
    p = plan(obs, alloc)
    assert space.mask(obs, alloc, planned=p)[space.plan_index]
    assert space.apply(alloc, space.plan_index, obs, p) == Allocation((8, 4), alloc.buffer_bytes)
    assert not space.mask(obs, alloc)[space.plan_index]  # no plan
    # Already at the plan: nothing to jump to.
    assert not space.mask(obs, p.allocation, planned=p)[space.plan_index]


def test_more_stages_than_cores_still_get_a_plan():
    # Five CPU-bound stages on 2 cores, each worker got 0.4 of a core: one worker per stage is
    # charged 5 x 0.5 = 2.5 cores, which the plan must accept as its floor, not give up on.
    stages = tuple(
        StageStats(f"s{i}", 1, items_per_s=400.0, busy=1.0, cpu_s_per_item=1e-3) for i in range(5)
    )
    obs = Observation(stages, 400.0, 2.0, 1 << 40, 0)
    p = plan(obs, Allocation((1,) * 5, (MiB,) * 5))
    assert p is not None and p.allocation.workers == (1,) * 5
    assert p.throughput == pytest.approx(400.0)
