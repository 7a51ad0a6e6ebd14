import dataclasses

import pytest

from torchtune_pipe.tuning import MiB, Observation, StageStats
from torchtune_pipe.tuning.base import Allocation, fusion_host
from torchtune_pipe.tuning.calls_in_flight import settled_concurrency
from torchtune_pipe.tuning.intune.agent import ActionSpace
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
    # 2 reader-s and 1 UDF worker-s per second: the headroom's margin (0.4 and 0.2 of a
    # worker) rounds away, the need itself is covered.
    assert p.allocation.workers == (2, 1)


def test_the_headroom_margin_rounds_to_the_nearest_worker_over_the_need():
    from torchtune_pipe.tuning.capacity import capacity, workers_for

    assert workers_for(10.0, 0.2, 1.2) == 2  # need 2, 2.4 with headroom
    assert workers_for(10.0, 0.25, 1.2) == 3  # need 2.5, 3.0
    assert workers_for(10.0, 0.21, 1.2) == 3  # need 2.1: never below it
    # A need at most NEED_SLACK (2%) above a whole number: a third process would buy 1.5%
    # (a CPU-bound Criteo reader group measured at 2.03 workers' need, on 2 cores).
    assert workers_for(10.0, 0.203, 1.2) == 2
    assert workers_for(10.0, 0.29, 1.2) == 3  # need 2.9, 3.48 with headroom
    assert workers_for(10.0, 0.3, 1.2) == 4  # need 3, 3.6 with headroom
    for w in range(1, 40):  # capacity is the inverse: w workers cover it, not a rate above
        for u in (0.01, 0.2, 0.37, 1.0):
            c = capacity(w, u, 1.2)
            assert workers_for(c, u, 1.2) <= w < workers_for(c * (1 + 1e-6), u, 1.2)


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
    # 0.4 CPU-s per item in all on 4 cores: T = 10, with 2 workers per stage (a need of 2, 2.4
    # with the headroom), not the 4 (5 with headroom) that 0.4 s of wall time per item asks.
    assert p.allocation.workers == (2, 2)
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


def _read_ahead_udf(read_rate: float, read_busy: float = 1.0, idle: bool = False):
    # A read stage (1 ms CPU per item) ahead of a UDF (10 ms CPU per item, one worker at 100
    # items/s) and a batch of 4; 2 cores. Each stage counts the items it took in.
    read = StageStats(
        "read", 1, items_per_s=read_rate, items_in_per_s=read_rate, busy=read_busy,
        cpu_s_per_item=1e-3 if read_rate else 0.0, idle=idle,
    )  # fmt: skip
    udf = StageStats(
        "udf", 1, items_per_s=100.0, items_in_per_s=100.0, busy=1.0, cpu_s_per_item=0.01
    )
    batch = StageStats(
        "batch", 1, items_per_s=25.0, items_in_per_s=100.0, busy=0.05, blocked_in=0.9,
        cpu_s_per_item=2e-3,
    )  # fmt: skip
    return Observation((read, udf, batch), 25.0, 2.0, 1 << 40, 0), Allocation((1, 1, 1), (MiB,) * 3)


def test_a_stage_running_ahead_is_planned_at_the_rate_the_pipeline_needs():
    # The read stage fills its buffer at 900 items/s, 9x what flows on: charged at that rate
    # it would seem to need most of a core per delivered batch. Per batch the pipeline needs
    # 4 reads (4 ms), 4 UDF items (40 ms) and a collate (2 ms): 46 ms of CPU, 2 cores -> about
    # 43 batches/s with 2 UDF workers.
    obs, alloc = _read_ahead_udf(900.0)
    p = plan(obs, alloc)
    assert p.allocation.workers == (1, 2, 1)
    assert p.throughput > 1.3 * p.current


def test_an_idle_stage_keeps_its_workers_and_the_others_are_planned():
    # The read stage has read its whole epoch (no items, no busy time, items before): it is
    # idle, not unmeasured, and its one worker is charged as waiting.
    obs, alloc = _read_ahead_udf(0.0, read_busy=0.0, idle=True)
    p = plan(obs, alloc)
    assert p is not None and p.allocation.workers[0] == 1
    assert p.allocation.workers[1] >= 2
    unmeasured = Observation(
        (StageStats("read", 1),) + obs.stages[1:], 25.0, 2.0, 1 << 40, 0
    )  # not idle: never emitted anything
    assert plan(unmeasured, alloc) is None


def test_an_idle_stage_is_charged_as_waiting():
    from torchtune_pipe.tuning.safety import IO_MIN_CHARGE, charge

    assert charge(StageStats("read", 1, idle=True)) == IO_MIN_CHARGE
    assert charge(StageStats("read", 1)) == 1.0  # nothing measured yet: a full core


def test_measured_run_queue_delay_is_neither_work_nor_io():
    # Four workers per stage on 4 cores: each ran half the time it was busy and waited for a
    # CPU the other half (run queue 0.5). The stage needs 0.2 s of CPU per item, no I/O.
    stages = tuple(
        StageStats(f"s{i}", 4, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.2, runqueue=0.5)
        for i in range(2)
    )
    obs = Observation(stages, 10.0, 4.0, 1 << 40, 0)
    assert plan(obs, Allocation((4, 4), (MiB, MiB))).allocation.workers == (2, 2)
    # A stage that waits on I/O as well: of its 0.4 s of wall time per item (4 workers busy
    # at 10 items/s), 0.1 s is CPU and 0.008 s the run queue (4 x 0.02 / 10), so 0.292 s is
    # I/O: u = 0.392 worker-seconds per item. Each worker is charged at least half a core, so
    # 8 fit on 4 cores: up to T = 8.5 / (1.2 x 0.392) = 18.07 items/s, where the headroom's
    # margin reaches half a worker over 8 (17.71 if the run queue counted as I/O).
    mixed = StageStats("m", 4, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.1, runqueue=0.02)
    obs = Observation((mixed,), 10.0, 4.0, 1 << 40, 0)
    p = plan(obs, Allocation((4,), (MiB,)))
    assert p.allocation.workers == (8,)
    assert p.throughput == pytest.approx(8.5 / (1.2 * 0.392), rel=1e-6)
    # Waiting for a CPU a quarter of the time they are busy, the workers share cores that
    # are taken (by other processes: the stage uses one of four): no worker is added, and
    # none taken away (cpu_budget: the budget is what the 4 workers use at the model's rate).
    crowded = dataclasses.replace(mixed, runqueue=0.25)
    p = plan(dataclasses.replace(obs, stages=(crowded,)), Allocation((4,), (MiB,)))
    assert p.allocation.workers == (4,) and p.throughput == pytest.approx(p.current, rel=1e-6)
    # Five running then (one more than the rate needs) are kept: the budget only holds back.
    five = dataclasses.replace(crowded, workers=5)
    p = plan(dataclasses.replace(obs, stages=(five,)), Allocation((5,), (MiB,)))
    assert p.allocation.workers == (5,) and p.throughput >= p.current * (1 - 1e-9)


def _chain_obs(fused: tuple[bool, ...]) -> Observation:
    # A source of 1 ms per item, a 1 us map and a 1 ms map, all CPU, 1000 items/s on 8 cores;
    # stages fused into the source run in its 4 workers, split ones in 2 each.
    cost = (1e-3, 1e-6, 1e-3)
    host_workers = 4 if any(fused) else 2
    stages = []
    for i, (name, c) in enumerate(zip(("src", "cheap", "dear"), cost, strict=True)):
        w = 0 if fused[i] else (host_workers if i == 0 else 2)
        busy = 1000 * c / (host_workers if fused[i] or i == 0 else w)
        stages.append(
            StageStats(
                name,
                w,
                items_per_s=1000.0,
                busy=busy,
                cpu_s_per_item=c,
                blocked_in=1 - busy if i else 0.0,
                fused=fused[i],
                fusable=i > 0,
            )  # fmt: skip
        )
    return Observation(tuple(stages), 1000.0, 8.0, 1 << 40, 0)


def test_the_plan_fuses_cheap_stages_and_keeps_expensive_ones_split():
    obs = _chain_obs((False, False, False))
    p = plan(obs, obs.allocation())
    assert p.allocation.fused == (False, True, False)
    # The expensive stage keeps workers of its own; the cheap one's entry is its split target.
    assert p.allocation.workers[2] >= 2 and p.allocation.workers[1] == 1


def test_the_plan_keeps_a_fused_stage_fused_unless_splitting_gains():
    # Fused, the expensive stage costs what it would split (no hop is measured inside a group)
    # and the consumer bounds the rate: splitting gains nothing, it stays.
    obs = _chain_obs((False, True, True))
    fused = Allocation((4, 1, 2), (MiB,) * 3, fused=(False, True, True))
    assert plan(obs, fused).allocation.fused == (False, True, True)
    # The source may not grow past its 4 workers: the group's two 1 ms stages need 8 for
    # 4000 items/s, so the expensive stage leaves the source's workers.
    src = dataclasses.replace(obs.stages[0], max_workers=4)
    bound = dataclasses.replace(obs, stages=(src, *obs.stages[1:]))
    p = plan(bound, fused)
    assert fusion_host(p.allocation.fused, 2) != 0
    assert p.throughput > 1.5 * p.current


def test_the_plan_leaves_fusion_alone_when_asked():
    obs = _chain_obs((False, False, False))
    assert plan(obs, obs.allocation(), fusion=False).allocation.fused == ()


def test_cheap_stages_are_fused_when_cores_are_scarce():
    # Six 2 us maps after a 4 us source on 2 cores, one worker each: fused, the hops go and
    # no stage keeps a worker that mostly waits.
    n = 6
    stages = [StageStats("src", 1, items_per_s=1e5, busy=0.9, cpu_s_per_item=4e-6)]
    stages += [
        StageStats(
            f"m{k}",
            1,
            items_per_s=1e5,
            busy=0.2,
            blocked_in=0.8,
            cpu_s_per_item=2e-6,
            fusable=True,
        )  # fmt: skip
        for k in range(n)
    ]
    obs = Observation(tuple(stages), 1e5, 2.0, 1 << 40, 0)
    p = plan(obs, obs.allocation())
    assert p.allocation.fused == (False,) + (True,) * n  # all six in the source's workers
    assert p.throughput > 1.2 * p.current


def test_hops_come_from_what_the_stages_measure_and_fall_back_to_the_prior_as_a_floor():
    from torchtune_pipe.tuning.item_costs import HOP_S_PER_ITEM, channel_hops

    def obs_of(hops, fused=(False, False, False)):
        stages = tuple(
            StageStats(f"s{i}", 1, items_per_s=100.0, busy=0.5, cpu_s_per_item=1e-4,
                       hop_s_per_item=h, fused=f)
            for i, (h, f) in enumerate(zip(hops, fused, strict=True))
        )  # fmt: skip
        return Observation(stages, 100.0, 2.0, 1 << 40, 0)

    r = [1.0, 1.0, 1.0]
    # Both ends measured: their mean; the last stage's output, its own.
    assert channel_hops(obs_of((4e-6, 8e-6, 6e-6)), r) == pytest.approx([6e-6, 7e-6, 6e-6])
    # A fused stage measures nothing: its channel takes the median of what is measured.
    hops = channel_hops(obs_of((4e-6, 0.0, 6e-6), (False, True, False)), r)
    assert hops[0] == pytest.approx(6e-6) and hops[1] == pytest.approx(6e-6)
    assert channel_hops(obs_of((0.0, 0.0, 0.0)), r) == [HOP_S_PER_ITEM] * 3
    # Per delivered item: a batch of 4 after stage 0 makes its channel carry 4 items per one.
    assert channel_hops(obs_of((4e-6, 8e-6, 6e-6)), [4.0, 1.0, 1.0])[0] == pytest.approx(12e-6)
    # Measured below the prior (encoding and decoding only): priced at the prior.
    assert channel_hops(obs_of((1e-7, 2e-7, 1e-7)), r) == pytest.approx([HOP_S_PER_ITEM] * 3)


def test_a_measured_costly_hop_fuses_stages_the_prior_would_keep_split():
    # Three stages of 200 us of CPU per item on 2 cores. Under the prior (2.5 us a hop)
    # fusing saves about 1%: split. Measured, 40 us of each is crossing channels (small
    # tensors pickled and unpickled): fused, the pipeline gains 15%.
    def obs_of(hop: float) -> Observation:
        stages = tuple(
            StageStats(f"s{i}", 2, items_per_s=3e3, busy=0.9, cpu_s_per_item=200e-6,
                       hop_s_per_item=hop, fusable=i > 0)
            for i in range(3)
        )  # fmt: skip
        return Observation(stages, 3e3, 2.0, 1 << 40, 0)

    assert not any(plan(obs_of(0.0), obs_of(0.0).allocation()).allocation.fused)
    measured = plan(obs_of(40e-6), obs_of(40e-6).allocation())
    assert measured.allocation.fused == (False, True, True)


def test_an_idle_fused_stage_is_planned_without_dividing_by_its_zero_workers():
    # At an epoch's end a fused stage (0 workers of its own) may be idle; splitting it in a
    # candidate shape must still give it a worker.
    stages = (
        StageStats("src", 2, items_per_s=1e3, busy=0.5, cpu_s_per_item=1e-3, hop_s_per_item=5e-5),
        StageStats("m", 0, items_per_s=0.0, idle=True, fused=True, fusable=True),
        StageStats("b", 1, items_per_s=1e3, busy=0.2, cpu_s_per_item=2e-4, hop_s_per_item=5e-5,
                   fusable=True),
    )  # fmt: skip
    obs = Observation(stages, 1e3, 2.0, 1 << 40, 0)
    p = plan(obs, Allocation((2, 1, 1), (MiB,) * 3, fused=(False, True, False)))
    assert p is not None and all(w >= 1 for w in p.allocation.workers)


def test_a_stage_whose_calls_in_flight_are_rising_is_planned_for_them():
    # A read that waits 20x its CPU, at one call per worker, where the concurrency rule (below
    # every tuner) raises its calls in flight to 16: the wait goes to threads, and the plan
    # does not also buy processes for it.
    def read(max_concurrency):
        return StageStats("read", 2, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.01,
                          io_bound=True, max_concurrency=max_concurrency)  # fmt: skip

    udf = StageStats("udf", 1, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.1)
    alone = plan(Observation((read(1), udf), 10.0, 4.0, 1 << 40, 0), Allocation((2, 1), (MiB, MiB)))
    rising = plan(
        Observation((read(64), udf), 10.0, 4.0, 1 << 40, 0), Allocation((2, 1), (MiB, MiB))
    )
    assert settled_concurrency(read(64)) == 16 and settled_concurrency(read(1)) == 1
    assert alone.allocation.workers[0] == 8  # 0.2 worker-s per item, as without threads
    assert rising.allocation.workers[0] < alone.allocation.workers[0] / 3
    assert rising.throughput >= alone.throughput
    # Until its calls in flight settle it keeps the processes it has: with a cheap UDF after
    # it, the plan at one call in flight buys readers; while they rise, it does not.
    fast = dataclasses.replace(udf, cpu_s_per_item=0.001, busy=0.01)
    free = plan(Observation((read(1), fast), 10.0, 4.0, 1 << 40, 0), Allocation((2, 1), (MiB,) * 2))
    held = plan(
        Observation((read(64), fast), 10.0, 4.0, 1 << 40, 0), Allocation((2, 1), (MiB,) * 2)
    )
    assert held.allocation.workers[0] == 2 < free.allocation.workers[0]


def test_a_plan_keeps_the_shape_running_when_its_own_shape_is_slower():
    # Three cheap CPU-bound stages fused into the source's 3 workers on 2 cores (numbers of a
    # live run): the first fused stage's share of its host's wall time is far above its CPU,
    # so it is flagged as waiting, and a shape built from every stage split leaves it (and
    # the stage after it) apart. By the same model that shape is slower than the one running:
    # the plan keeps the stages fused.
    def stage(name, busy, cpu, fused, io=False, rq=0.05):
        return StageStats(
            name, 0 if fused else 3, items_per_s=564.0, items_in_per_s=564.0, busy=busy,
            cpu_s_per_item=cpu, runqueue=rq, fused=fused, fusable=name != "source",
            io_bound=io, hop_s_per_item=110e-6 if not fused else 0.0, max_workers=64,
        )  # fmt: skip

    stages = (
        stage("source", 0.17, 552e-6, False),
        stage("step1", 0.30, 237e-6, True, io=True),
        stage("step2", 0.11, 366e-6, True),
        stage("step3", 0.40, 1000e-6, True),
    )
    obs = Observation(stages, 564.0, 2.0, 1 << 34, 0, consumer_step_s=1.5e-5)
    now = Allocation((3, 1, 1, 1), (MiB,) * 4, fused=(False, True, True, True))
    p = plan(obs, now)
    assert p.allocation.fused == now.fused
    assert p.throughput >= p.current * (1 - 1e-9)


def test_a_cpu_bound_stage_is_planned_at_its_cpu_not_a_few_percent_of_noise_above():
    # Two workers always busy on 2 cores, 3.9 ms of CPU per item and 4.0 ms of wall time,
    # none of it in the run queue: 2.6% of the wall is timer noise, not waiting. At the CPU's
    # rate (513 items/s) the stage needs 2 workers, not the third a need of 2.05 rounds up to.
    s = StageStats("s", 2, items_per_s=500.0, busy=1.0, cpu_s_per_item=3.9e-3, runqueue=0.0)
    obs = Observation((s,), 500.0, 2.0, 1 << 40, 0)
    p = plan(obs, Allocation((2,), (MiB,)))
    assert p.allocation.workers == (2,)
    assert p.throughput == pytest.approx(2 / 3.9e-3, rel=1e-6)
    # Waiting a tenth of the CPU is waiting: the need is 2.2 workers.
    s = dataclasses.replace(s, cpu_s_per_item=3.6e-3)
    assert plan(
        dataclasses.replace(obs, stages=(s,)), Allocation((2,), (MiB,))
    ).allocation.workers == (3,)


def test_a_stage_stays_fused_into_a_host_whose_calls_in_flight_are_rising():
    # A map-style loader's second second (numbers of a live run on 2 cores): 3 fetch workers
    # at 8 calls in flight each, their reads waiting 4 ms, host a fused collate. The fetch
    # stage waits, and the concurrency rule is raising its calls in flight to 64: the wait is
    # what its threads are about to take, and the collate stays fused (split, the plan would
    # then buy fetch workers for the split shape). Once the calls in flight settle (at
    # max_concurrency) a host that still waits has nothing fused into it.
    def obs(concurrency):
        fetch = StageStats("fetch", 3, max_workers=64, items_per_s=137.2, busy=0.8844,
                           cpu_s_per_item=1.138e-3, io_bound=True, items_in_per_s=137.2,
                           concurrency=concurrency, max_concurrency=64, hop_s_per_item=1.257e-4,
                           runqueue=0.0175)  # fmt: skip
        collate = StageStats("collate", 0, max_workers=64, items_per_s=137.2, busy=0.1102,
                             cpu_s_per_item=2.181e-3, items_in_per_s=148.6, fused=True,
                             fusable=True, runqueue=0.0022)  # fmt: skip
        return Observation((fetch, collate), 142.9, 2.0, 1 << 40, 0, consumer_cpus=0.136)

    alloc = Allocation((3, 1), (MiB, MiB), fused=(False, True))
    assert settled_concurrency(obs(8).stages[0]) == 64
    assert plan(obs(8), alloc).allocation.fused == (False, True)
    assert settled_concurrency(obs(64).stages[0]) == 64
    assert plan(obs(64), alloc).allocation.fused == (False, False)


def test_a_fused_group_whose_host_is_done_with_its_epoch_is_planned_without_error():
    # The source (done with its epoch, idle) hosts three fused maps still working off the
    # backlog: every group of the shape running is idle. The plan keeps the workers.
    src = StageStats("source", 2, items_per_s=0.0, idle=True, max_workers=8)
    maps = tuple(
        StageStats(f"m{i}", 0, items_per_s=900.0, items_in_per_s=900.0, busy=0.3,
                   cpu_s_per_item=3e-4, fused=True, fusable=True, max_workers=8)
        for i in range(3)
    )  # fmt: skip
    obs = Observation((src, *maps), 900.0, 2.0, 1 << 40, 0)
    p = plan(obs, Allocation((2, 1, 1, 1), (MiB,) * 4, fused=(False, True, True, True)))
    assert p is not None and p.allocation.workers[0] == 2


def test_no_process_is_planned_onto_cores_the_workers_already_wait_for():
    # A map-style loader on 2 cores (numbers of a live run): 2 fetch workers at 64 calls in
    # flight host the collate; 446 batches/s, 1.3 cores of the stages' CPU, and the workers
    # wait for a CPU a quarter of their time (the calls' bursts, the consumer). By the stages'
    # CPU alone the model promised a third worker 15% (688 against 599 batches/s); measured,
    # it made 448. Workers that queue for a CPU get no more of it from another process.
    def obs(fetch_rq, collate_rq):
        fetch = StageStats("fetch", 2, max_workers=64, items_per_s=446.2, busy=0.3701,
                           cpu_s_per_item=7.764e-4, items_in_per_s=446.2, concurrency=64,
                           max_concurrency=64, hop_s_per_item=1.04e-4, runqueue=fetch_rq)  # fmt: skip
        collate = StageStats("collate", 0, max_workers=64, items_per_s=446.2, busy=0.627,
                             cpu_s_per_item=2.132e-3, items_in_per_s=446.2, fused=True,
                             fusable=True, runqueue=collate_rq)  # fmt: skip
        return Observation((fetch, collate), 446.2, 2.0, 1 << 40, 0, consumer_cpus=0.214)

    alloc = Allocation((2, 1), (MiB, MiB), fused=(False, True))
    p = plan(obs(0.1007, 0.1706), alloc)
    assert p.allocation.workers[0] == 2 and p.throughput <= p.current * 1.05
    # The same workers with a CPU whenever they can run: the cores have room for more.
    p = plan(obs(0.0, 0.0), alloc)
    assert p.allocation.workers[0] >= 3 and p.throughput > p.current * 1.05


def test_a_channel_no_stage_measures_is_priced_at_the_hops_of_stages_with_its_items():
    from torchtune_pipe.tuning.item_costs import HOP_S_PER_ITEM, channel_hops

    # Rows from a reader (a measured 0.05 us hop per row) through a map fused into it, then a
    # collate of 4096 rows whose 4 MiB batches cost 200 us each to cross: the fused channel
    # carries rows, priced at the rows' hop (here the prior, its floor), not at a batch's.
    stages = (
        StageStats("read", 8, items_per_s=4096.0, busy=0.5, cpu_s_per_item=1e-5,
                   hop_s_per_item=5e-8),
        StageStats("lookup", 0, items_per_s=4096.0, busy=0.5, cpu_s_per_item=6e-6, fused=True),
        StageStats("batch", 1, items_per_s=1.0, busy=0.1, cpu_s_per_item=1e-3,
                   hop_s_per_item=2e-4),
    )  # fmt: skip
    obs = Observation(stages, 1.0, 8.0, 1 << 40, 0)
    hops = channel_hops(obs, [4096.0, 4096.0, 1.0])
    assert hops[0] == pytest.approx(HOP_S_PER_ITEM * 4096)
    assert hops[2] == pytest.approx(2e-4)


def test_store_lookups_fused_into_their_reader_get_the_workers_that_wait():
    # A reader, two lookups waiting ~200 us per row on a store, a CPU feature map, batches of
    # 4096 rows: InTune starts every fusable stage fused into the reader. Each of the group's
    # workers waits on the store ~90% of its time: charged the feature map's half core, it
    # got a handful of workers; charged each member's floor for its share of the time, the
    # plan from that interval gives the waits the workers they need, and the pipeline runs
    # at the best static allocation's rate within a few intervals.
    from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload
    from torchtune_pipe.tuning.intune.agent import InTuneTuner
    from torchtune_pipe.tuning.loop import run_episode
    from torchtune_pipe.tuning.oracle import best_static

    us, row, batch = 1e-6, 1024, 4096
    wl = Workload("lookups", (
        StageModel("read", "source", 8 * us, io_s_per_item=20 * us, bytes_per_item=row),
        StageModel("lookup_a", "map", 6 * us, io_s_per_item=200 * us, bytes_per_item=row),
        StageModel("lookup_b", "map", 6 * us, io_s_per_item=220 * us, bytes_per_item=row),
        StageModel("features", "map", 25 * us, bytes_per_item=row),
        StageModel("batch", "batch", 2 * us, ratio=batch, bytes_per_item=batch * row),
        StageModel("prefetch", "prefetch", 4e-4, bytes_per_item=batch * row, max_workers=4),
    ))  # fmt: skip
    sim = SimPipeline(wl, 24, 64 << 30, seed=0)
    trace = run_episode(sim, InTuneTuner(plan_only=True), 8)
    last = trace[-1].stages
    running_lookups = [0 if s.fused else s.workers for s in last[1:3]]
    assert sum(running_lookups) + last[0].workers > 2 * 24
    exact = SimPipeline(wl, 24, 64 << 30, seed=0, noise=0.0)
    _, best = best_static(
        lambda a: exact.evaluate(a, cpus=24), exact.n_stages, 24,
        [s.max_workers for s in wl.stages], fusion=((), exact.widest_fusion()),
    )  # fmt: skip
    assert exact.evaluate(sim.allocation, cpus=24) >= 0.97 * best


def test_the_plan_charges_each_stage_what_its_workers_hold():
    # Three stages, the middle one the costliest and its workers each holding a 1 GiB cache,
    # under 2 GiB. Charged the mean worker, the plan passes the limit with a second cache
    # worker.
    from torchtune_pipe.tuning.planner import MEMORY_SHARE

    stages = tuple(
        StageStats(f"s{i}", 2, items_per_s=100.0, busy=1.0, cpu_s_per_item=c)
        for i, c in enumerate((0.005, 0.02, 0.005))
    )
    limit = 2048 * MiB
    obs = Observation(stages, 100.0, 64.0, limit, 0)
    held = [100 * MiB, 1124 * MiB, 100 * MiB]
    for per_worker in (held, sum(held) / 3):
        p = plan(obs, obs.allocation(), per_worker_bytes=per_worker)
        worst = sum(w * b for w, b in zip(p.allocation.workers, held, strict=True))
        assert (worst <= MEMORY_SHARE * limit) == (per_worker is held)


def test_a_fused_stage_is_charged_what_its_workers_held_when_it_last_ran_split():
    from torchtune_pipe.tuning.planner import _worker_bytes

    stages = (
        StageStats("read", 4, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.01),
        StageStats("cache", 0, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.01, fused=True),
        StageStats("udf", 0, items_per_s=10.0, busy=1.0, cpu_s_per_item=0.01, fused=True),
        StageStats("batch", 1, items_per_s=1.0, busy=0.1, cpu_s_per_item=0.01),
    )
    obs = Observation(stages, 1.0, 8.0, 1 << 40, 0)
    # The reader's workers hold 550 MiB now: 150 their own, 400 the cache stage's, known from
    # when it ran split; the UDF's are not known (the lightest worker's).
    own, lightest = _worker_bytes(obs, [550 * MiB, 550 * MiB, 0.0, 150 * MiB])
    assert lightest == 150 * MiB
    assert own == [150 * MiB, 550 * MiB, 150 * MiB, 150 * MiB]
    assert _worker_bytes(obs, 200 * MiB) == ([200 * MiB] * 4, 200 * MiB)
