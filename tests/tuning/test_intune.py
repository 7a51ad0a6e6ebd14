"""The InTune tuner: actions and masks, reward, shipped weights, persistence, fine-tuning."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats, Tuner
from torchtune_pipe.tuning.intune.agent import (
    ACTIONS_PER_STAGE,
    WORKER_DELTAS,
    ActionSpace,
    InTuneTuner,
    StateEncoder,
    memory_factor,
    rescale,
    reward,
    weights_path,
)

GiB = 1024 * MiB


def _obs(
    workers=(2, 2, 2),
    buffers=(4 * MiB,) * 3,
    busy=(0.5, 1.0, 0.3),
    cpus=8.0,
    limit=8 * GiB,
    used=1 * GiB,
    throughput=100.0,
    max_workers=256,
    oom=False,
) -> Observation:
    stages = tuple(
        StageStats(
            name=f"s{i}",
            workers=w,
            max_workers=max_workers,
            items_per_s=throughput,
            busy=b,
            blocked_in=(1 - b) / 2,
            blocked_out=(1 - b) / 2,
            buffer_bytes=buf,
            buffer_fill=0.5,
        )
        for i, (w, b, buf) in enumerate(zip(workers, busy, buffers, strict=True))
    )
    return Observation(stages, throughput, cpus, limit, used, oom=oom)


def _index(stage: int, k: int) -> int:
    return 1 + ACTIONS_PER_STAGE * stage + k


# -- actions and masks ----------------------------------------------------------------------


def test_action_space_decodes_every_action():
    space = ActionSpace(3)
    assert space.n == 2 + 6 * 3
    assert space.decode(space.plan_index).plan and space.decode(space.plan_index).stage is None
    assert space.decode(0).stage is None
    assert space.decode(_index(1, 2)).workers == 5
    assert space.decode(_index(2, 4)).buffer == 1
    assert space.decode(_index(2, 5)).buffer == -1
    with pytest.raises(ValueError, match="index must be in"):
        space.decode(space.n)


def test_mask_blocks_going_below_one_worker():
    obs = _obs(workers=(1, 4, 3), busy=(0.5, 0.5, 0.3))
    mask = ActionSpace(3).mask(obs, obs.allocation())
    assert not mask[_index(0, 1)]  # -1 on a single worker
    assert not mask[_index(0, 3)]  # -5
    assert mask[_index(1, 1)] and not mask[_index(1, 3)]  # 4 workers: -1 yes, -5 no
    assert mask[0]  # the no-op is always allowed


def test_mask_blocks_max_workers_and_full_cpu_budget_without_donors():
    obs = _obs(workers=(4, 4), buffers=(4 * MiB,) * 2, busy=(1.0, 1.0), cpus=8, max_workers=4)
    mask = ActionSpace(2).mask(obs, obs.allocation())
    assert not mask[_index(0, 0)] and not mask[_index(1, 0)]
    # Two busy cores plus the spare core hold three workers: full, and stage 1 cannot give.
    obs = _obs(workers=(2, 1), buffers=(4 * MiB,) * 2, busy=(1.0, 1.0), cpus=2)
    mask = ActionSpace(2).mask(obs, obs.allocation())
    assert not mask[_index(0, 0)]  # full machine and nobody can give a worker


def test_growing_on_a_full_machine_moves_workers_from_the_idlest_stage():
    # Stage 2 is the idlest (4 workers x 10 % idle); every stage is busy enough to be charged
    # close to a core, so the machine is full: 8 CPUs, 0.4 of a core freed and the spare core
    # hold 9 workers.
    # Their workers use every core (2 + 3 + 3.6 of 8).
    obs = _obs(workers=(2, 3, 4), busy=(1.0, 1.0, 0.9), cpus=8)
    computing = [
        dataclasses.replace(st, cpu_s_per_item=st.busy * st.workers / st.items_per_s)
        for st in obs.stages
    ]
    obs = dataclasses.replace(obs, stages=tuple(computing))
    space = ActionSpace(3)
    assert space.mask(obs, obs.allocation())[_index(1, 0)]
    new = space.apply(obs.allocation(), _index(1, 0), obs)
    assert new.workers == (2, 4, 3)
    assert sum(new.workers) == 9
    # The same stages waiting on I/O for most of that time (a tenth of it on a CPU): no
    # donor keeps its work with a worker fewer, and the move takes none.
    waiting = [dataclasses.replace(st, cpu_s_per_item=st.cpu_s_per_item / 10) for st in computing]
    waiting = dataclasses.replace(obs, stages=tuple(waiting))
    assert space.apply(waiting.allocation(), _index(1, 0), waiting).workers == (2, 4, 4)
    # A source next to a UDF that keeps three workers busy: five more source workers fit the
    # cap only by taking UDF workers, a move from a busier stage to an idler one (a real run
    # lost half its throughput to it): masked.
    obs = _obs(workers=(1, 1, 3), busy=(0.6, 0.02, 1.0), cpus=2)
    assert sum(space.apply(obs.allocation(), _index(0, 2), obs).workers) == 10
    assert not space.mask(obs, obs.allocation())[_index(0, 2)]


def test_only_stages_that_can_use_workers_grow():
    from torchtune_pipe.tuning.intune.space import can_use_workers

    # Plenty of CPUs: the UDF (busy) may grow, the source and parse (waiting on it) may not.
    obs = _obs(workers=(1, 1, 3), busy=(0.01, 0.02, 0.85), cpus=16)
    mask = ActionSpace(3).mask(obs, obs.allocation())
    assert [bool(mask[_index(i, 0)]) for i in range(3)] == [False, False, True]
    assert not mask[_index(2, 1)]  # 2.55 workers' work: 2 cannot keep its rate
    st = obs.stages[0]
    assert can_use_workers(dataclasses.replace(st, io_bound=True))  # waits on I/O
    assert can_use_workers(dataclasses.replace(st, items_per_s=0.0))  # not measured yet
    assert not can_use_workers(dataclasses.replace(st, busy=1.0, idle=True))  # nothing to do
    # A map-style loader's reads (numbers of a live run): 2 workers at 8 calls in flight
    # each, waiting 4 ms a read; the concurrency rule is raising them to 64, so their wait
    # goes to threads. The network added 5 readers there (7 worker processes for a second,
    # the run's memory peak); no worker is added until the calls in flight settle.
    fetch = StageStats("fetch", 2, max_workers=64, items_per_s=97.9, busy=0.884,
                       cpu_s_per_item=1.21e-3, io_bound=True, concurrency=8,
                       max_concurrency=64, runqueue=0.014)  # fmt: skip
    assert not can_use_workers(fetch)
    assert can_use_workers(dataclasses.replace(fetch, concurrency=64))


def test_no_worker_is_added_while_the_workers_queue_for_a_cpu():
    from torchtune_pipe.tuning.run_queue import cpu_saturated

    # A map-style loader on 2 cores (numbers of a live run): two workers read with 64 calls in
    # flight each and collate (fused) at 322 batches/s; they waited for a CPU 32% of their
    # runnable time while the machine was busy elsewhere. The network added a third worker
    # there (57 MiB more, and no more batches/s once the dip passed); only moves stay open.
    fetch = StageStats("fetch", 2, max_workers=64, items_per_s=322.2, busy=0.437,
                       cpu_s_per_item=8.1e-4, io_bound=True, concurrency=64,
                       max_concurrency=64, runqueue=0.1386, fusable=True)  # fmt: skip
    collate = StageStats("collate", 0, max_workers=64, items_per_s=322.2, busy=0.56,
                         cpu_s_per_item=2.15e-3, fused=True, fusable=True,
                         runqueue=0.1776)  # fmt: skip
    obs = Observation((fetch, collate), 322.2, 2.0, 8 * GiB, 300 * MiB)
    alloc = Allocation((2, 0), (64 * MiB, 64 * MiB), fused=(False, True))
    space = ActionSpace(2)
    assert cpu_saturated(obs)
    grows = [_index(0, k) for k, dw in enumerate(WORKER_DELTAS) if dw > 0]
    mask = space.mask(obs, alloc)
    assert not any(mask[i] for i in grows) and mask[_index(0, 1)]  # fewer stays open
    # The same interval with workers that got a CPU whenever they could run: they may grow.
    free = [dataclasses.replace(st, runqueue=0.01) for st in (fetch, collate)]
    obs = dataclasses.replace(obs, stages=tuple(free))
    assert not cpu_saturated(obs)
    assert any(space.mask(obs, alloc)[i] for i in grows)
    # Not measured (the simulator): never saturated.
    unknown = [dataclasses.replace(st, runqueue=None) for st in (fetch, collate)]
    assert not cpu_saturated(dataclasses.replace(obs, stages=tuple(unknown)))


def test_no_stage_loses_workers_below_what_they_do_now_unless_cores_or_memory_run_out():
    from torchtune_pipe.tuning.planner import HEADROOM

    # Stage 1's 10 workers are busy 0.8 of the time: 8 workers' work, 9.6 with the planner's
    # headroom. One fewer cannot keep the rate; stage 2's (busy 0.3: 3 of 10) may lose five.
    obs = _obs(workers=(2, 10, 10), busy=(0.5, 0.8, 0.3), cpus=64.0)
    assert 10 - 1 < HEADROOM * 8 and 10 - 5 >= HEADROOM * 3
    mask = ActionSpace(3).mask(obs, obs.allocation())
    assert not mask[_index(1, 1)] and not mask[_index(1, 3)]
    assert mask[_index(2, 1)] and mask[_index(2, 3)]
    # Every core taken (the stages use 8 of 8 CPUs): a worker fewer frees a core for others.
    full = [dataclasses.replace(st, cpu_s_per_item=8.0 / 3 / st.items_per_s) for st in obs.stages]
    full = dataclasses.replace(obs, stages=tuple(full), cpus=8.0)
    assert ActionSpace(3).mask(full, full.allocation())[_index(1, 1)]
    # Over the memory limit in the worst case: workers go wherever they are.
    tight = _obs(workers=(2, 10, 10), busy=(0.5, 0.8, 0.3), cpus=64.0, limit=GiB, used=GiB)
    assert ActionSpace(3).mask(tight, tight.allocation())[_index(1, 1)]


def test_buffers_shrink_below_the_floor_only_for_memory_or_a_waiting_model():
    from torchtune_pipe.tuning.intune.space import KEEP_BUFFER_BYTES

    big, floor = KEEP_BUFFER_BYTES + 32 * MiB, KEEP_BUFFER_BYTES
    obs = _obs(buffers=(big, floor, 2 * MiB))
    mask = ActionSpace(3).mask(obs, obs.allocation())
    assert [bool(mask[_index(i, 5)]) for i in range(3)] == [True, False, False]
    # Over the memory limit in the worst case every buffer may shrink...
    tight = _obs(buffers=(big, floor, 2 * MiB), limit=2 * GiB, used=2 * GiB)
    mask = ActionSpace(3).mask(tight, tight.allocation())
    assert all(mask[_index(i, 5)] for i in range(3))
    # ...and so may they when the model is the bottleneck (they only hold waiting items).
    waiting = dataclasses.replace(obs, consumer_step_s=0.0095)
    mask = ActionSpace(3).mask(waiting, waiting.allocation())
    assert all(mask[_index(i, 5)] for i in range(3))


def test_intune_proposes_and_the_guard_fits_memory():
    # Workers measured earlier under small buffers come back (an undo) while today's buffers
    # are large: InTune proposes them as they were; what the guard lets through fits the
    # worst case of the one memory model.
    from torchtune_pipe.tuning.safety import MEMORY_SAFE_SHARE, memory_parts, within_limits

    tuner = InTuneTuner()
    small = _obs(workers=(8, 8, 8), limit=4 * GiB, used=int(2.4 * GiB), throughput=200.0)
    tuner.reset(small)
    tuner._before = (small.allocation(), small.throughput)  # the last move cost throughput
    obs = _obs(workers=(4, 4, 4), buffers=(1 * GiB,) * 3, limit=4 * GiB, used=int(2.4 * GiB))
    got = tuner.step(obs)
    assert got.workers == (8, 8, 8)  # the undo, as proposed: the tuner does not clamp
    fitted = within_limits(got, obs)
    assert memory_parts(obs).worst_case_bytes(fitted) <= MEMORY_SAFE_SHARE * obs.memory_limit_bytes


def test_a_buffer_grows_only_while_its_reader_at_times_finds_it_empty():
    # Half full, read by a stage that waits for input a fifth of its time: items come in
    # bursts, and more room helps.
    obs = _obs(busy=(0.5, 0.6, 0.3))
    assert ActionSpace(3).mask(obs, obs.allocation())[_index(0, 4)]
    # Read by a stage that never waits for input: the buffer only holds its producer ahead.
    obs = _obs(busy=(0.5, 1.0, 0.3))
    mask = ActionSpace(3).mask(obs, obs.allocation())
    assert not mask[_index(0, 4)] and mask[_index(1, 4)]  # stage 2 waits: s1's may grow
    # A fused reader reads nothing: the next stage with workers of its own does.
    s1 = dataclasses.replace(obs.stages[1], fused=True, workers=0)
    fused = dataclasses.replace(obs, stages=(obs.stages[0], s1, obs.stages[2]))
    assert ActionSpace(3).mask(fused, fused.allocation())[_index(0, 4)]


def test_an_undo_brings_back_the_shape_it_returns_to():
    # Every stage split, 200 items/s; the plan fused stage 1 into stage 0 and the next
    # interval measured 150: the undo returns to the split shape, not to its workers in the
    # fused one (an allocation's empty shape means "as now").
    tuner = InTuneTuner()
    split = _obs(workers=(4, 4, 4), throughput=200.0)
    tuner.reset(split)
    tuner._before = (tuner._ran(split), 200.0)
    s1 = dataclasses.replace(split.stages[1], fused=True, workers=0)
    fused = dataclasses.replace(
        split, stages=(split.stages[0], s1, split.stages[2]), throughput=150.0
    )
    got = tuner.step(fused)
    assert got.fused == (False, False, False)
    assert got.workers == (4, 4, 4)


def test_buffers_do_not_grow_while_the_model_is_the_bottleneck():
    obs = _obs()  # buffers half full
    assert ActionSpace(3).mask(obs, obs.allocation())[_index(2, 4)]
    # The consumer takes 9.5 ms per item at 100 items/s: busy 95 % of the time.
    waiting = dataclasses.replace(obs, consumer_step_s=0.0095)
    mask = ActionSpace(3).mask(waiting, waiting.allocation())
    assert not any(mask[_index(i, 4)] for i in range(3))
    assert mask[_index(0, 5)]  # shrinking is still allowed


def test_mask_respects_memory_limit_in_the_worst_case():
    # 3 workers use ~900 MiB beyond buffers (300 MiB each); limit leaves room for none more.
    # (Each buffer's reader waits for input a tenth of its time: its buffer may grow.)
    obs = _obs(
        workers=(1, 1, 1), cpus=64, limit=1000 * MiB, used=900 * MiB + 6 * MiB,
        busy=(1, 0.8, 0.8),
    )  # fmt: skip
    mask = ActionSpace(3).mask(obs, obs.allocation())
    for stage in range(3):
        assert not mask[_index(stage, 0)], "a new 300 MiB worker would pass the limit"
        assert mask[_index(stage, 4)], "a 2 MiB buffer step still fits"
    roomy = _obs(workers=(1, 1, 1), cpus=64, limit=64 * GiB, used=906 * MiB, busy=(1, 1, 1))
    assert ActionSpace(3).mask(roomy, roomy.allocation())[_index(0, 0)]


def test_mask_charges_a_new_worker_what_its_stages_workers_hold():
    # Stage 0's one worker holds a 400 MiB cache, stage 2's a 20 MiB one: the guard's model
    # (memory_parts) charges each a worker of its own stage, so under the same limit a worker
    # fits on stage 2 and not on stage 0.
    obs = _obs(workers=(1, 1, 1), cpus=64, limit=900 * MiB, used=500 * MiB, busy=(1, 1, 1))
    held = (400 * MiB, 60 * MiB, 20 * MiB)
    obs = dataclasses.replace(
        obs,
        stages=tuple(
            dataclasses.replace(st, memory_bytes=b) for st, b in zip(obs.stages, held, strict=True)
        ),
    )
    mask = ActionSpace(3).mask(obs, obs.allocation())
    assert not mask[_index(0, 0)], "a second 400 MiB worker would pass 855 MiB"
    assert mask[_index(2, 0)], "a 20 MiB worker fits"


def test_rescale_keeps_proportions_and_fits_the_new_budget():
    alloc = Allocation((2, 4, 2), (4 * MiB,) * 3)
    up = rescale(alloc, _obs(workers=(2, 4, 2), cpus=16), old_cpus=8)
    assert up.workers == (4, 8, 4)
    down = rescale(alloc, _obs(workers=(2, 4, 2), cpus=4, busy=(0.9, 1.0, 0.2)), old_cpus=8)
    assert sum(down.workers) <= 4 and min(down.workers) >= 1


# -- reward ---------------------------------------------------------------------------------


def test_reward_formula_values():
    assert memory_factor(0.5) == 1.0
    assert memory_factor(0.8) == 1.0
    assert memory_factor(0.9) == pytest.approx(0.5)  # smoothstep(0.5) = 0.5
    assert memory_factor(1.0) == 0.0
    assert memory_factor(1.2) == 0.0
    half = _obs(throughput=50.0, limit=1000, used=900)
    assert reward(half, 100.0) == pytest.approx(0.25)
    assert reward(_obs(throughput=80.0, limit=1000, used=100), 100.0) == pytest.approx(0.8)
    assert reward(_obs(oom=True), 100.0) == -1.0


# -- the tuner ------------------------------------------------------------------------------


def test_state_has_the_declared_dimension_and_is_finite():
    enc = StateEncoder(3)
    obs = _obs()
    enc.update_references(obs)
    x = enc.encode(obs, obs.allocation(), None)
    assert x.shape == (enc.dim,) and torch.isfinite(x).all()


@pytest.mark.parametrize("n", range(2, 9))
def test_loads_shipped_weights_for_each_length(n):
    assert weights_path(n).is_file()
    tuner = InTuneTuner()
    assert isinstance(tuner, Tuner)
    obs = _obs(workers=(1,) * n, buffers=(4 * MiB,) * n, busy=(0.5,) * n, cpus=32, limit=64 * GiB)
    first = tuner.reset(obs)
    assert sum(first.workers) == 32  # the even split of InTune's start
    alloc = tuner.step(_obs(workers=first.workers, buffers=first.buffer_bytes, busy=(0.5,) * n))
    assert len(alloc.workers) == n and min(alloc.workers) >= 1
    assert tuner.agent.n_actions == 2 + 6 * n


def test_missing_weights_name_the_file(tmp_path):
    tuner = InTuneTuner(tmp_path)
    with pytest.raises(FileNotFoundError, match="intune_3stages.pt"):
        tuner.reset(_obs())


def test_state_dict_round_trip():
    tuner = InTuneTuner()
    obs = _obs()
    tuner.reset(obs)
    state = tuner.state_dict()
    other = InTuneTuner()
    other.load_state_dict(state)
    x = torch.randn(4, tuner.encoder.dim)
    assert torch.equal(tuner.agent.q_values(x), other.agent.q_values(x))
    assert InTuneTuner(state).reset(obs) == tuner.reset(obs)


def test_step_cost_is_measured():
    """Not a speed assertion: records what one step costs (the loop budget is 20 ms/s)."""
    tuner = InTuneTuner()
    obs = _obs(workers=(3, 3, 2))
    tuner.reset(obs)
    t0 = time.perf_counter()
    for _ in range(50):
        alloc = tuner.step(_obs(workers=tuner._alloc.workers, buffers=tuner._alloc.buffer_bytes))
    per_step_ms = (time.perf_counter() - t0) / 50 * 1e3
    print(f"InTuneTuner.step: {per_step_ms:.3f} ms")
    assert per_step_ms > 0 and len(alloc.workers) == 3


def test_finetune_mode_updates_weights():
    tuner = InTuneTuner(finetune=True, epsilon=0.5, learn_every=1, seed=1)
    obs = _obs()
    tuner.reset(obs)
    before = {k: v.clone() for k, v in tuner.agent.q.state_dict().items()}
    for i in range((tuner.config.warmup + 20) * tuner.learn_every):
        a = tuner._alloc
        tuner.step(_obs(workers=a.workers, buffers=a.buffer_bytes, throughput=100.0 + (i % 7)))
    assert tuner.agent.updates > 0
    after = tuner.agent.q.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_change_of_fusion_is_judged_on_the_first_interval_that_starts_in_the_new_shape():
    # Six cheap stages whose hops cost more than their functions: the plan fuses them. The
    # intervals of the switch (workers retiring, queued frames finishing where they were) are
    # not judged: the tuner holds the new shape until an interval starts with it in effect
    # (fused stages running no workers of their own), then may keep or undo it.
    def obs_of(alloc: Allocation | None, throughput: float, draining: bool = False):
        fused = alloc.fused if alloc is not None and alloc.fused else (False,) * 3
        stages = tuple(
            StageStats(f"s{i}", 1 if draining or not fused[i] else 0, items_per_s=throughput,
                       busy=0.9, cpu_s_per_item=30e-6, hop_s_per_item=24e-6, fusable=i > 0,
                       fused=fused[i])
            for i in range(3)
        )  # fmt: skip
        return Observation(stages, throughput, 2.0, 8 * GiB, GiB)

    tuner = InTuneTuner()
    # With no start given, the tuner starts in the fewest processes: every fusable stage fused,
    # the host running the workers the three stages would have had, up to one per CPU (2).
    start = tuner.reset(obs_of(None, 0.0))
    assert start.fused == (False, True, True) and start.workers == (2, 1, 1)
    split = Allocation((1, 1, 1), (64 * MiB,) * 3)
    first = tuner.reset(obs_of(None, 2e4), start=split)
    fusing = tuner.step(obs_of(first, 2e4))
    assert any(fusing.fused)
    # The switch's interval, and one that ended with fused stages still draining their queues:
    # held, not undone, however low they measured.
    assert tuner.step(obs_of(fusing, 5e3, draining=True)) == fusing
    assert tuner.step(obs_of(fusing, 5e3)) == fusing
    # The interval after, which started in the new shape, is judged: the shape stays.
    assert any(tuner.step(obs_of(fusing, 4e4)).fused)


def _criteo_udf(
    rate: float, udf_busy: float, udf_runqueue: float, readers: int = 2, used: int = 300 * MiB
) -> Observation:
    """The UDF-heavy Criteo pipeline on 2 cores (numbers of a live run): the readers run the
    feature UDFs fused, one worker batches; ``rate`` batches/s."""
    # fmt: off
    read = StageStats("read", readers, max_workers=4, items_per_s=4 * rate, busy=0.18,
                      cpu_s_per_item=4.6e-4, runqueue=0.011, hop_s_per_item=2.3e-5,
                      memory_bytes=70 * MiB * readers)
    feat = StageStats("features", 0, max_workers=4, items_per_s=4 * rate, busy=0.015,
                      cpu_s_per_item=3.9e-5, runqueue=0.001, fused=True, fusable=True)
    udf = StageStats("extra_cost", 0, max_workers=4, items_per_s=4 * rate, busy=udf_busy,
                     cpu_s_per_item=2.54e-3, runqueue=udf_runqueue, fused=True,
                     fusable=True)
    batch = StageStats("batch", 1, max_workers=4, items_per_s=rate, busy=0.11,
                       blocked_in=0.89, cpu_s_per_item=3.2e-4, runqueue=0.06,
                       hop_s_per_item=1.3e-4, memory_bytes=70 * MiB)
    return Observation((read, feat, udf, batch), rate, 2.0, 24 * GiB, used, consumer_cpus=0.06)
    # fmt: on


UDF_RUNS = Allocation((2, 0, 0, 1), (64 * MiB,) * 4, fused=(False, True, True, False))


def test_a_plan_that_moves_only_a_fused_stages_target_is_not_undone_by_a_dip():
    from torchtune_pipe.tuning.intune.space import changes_processes, changes_workers

    # Each step the plan asks for what runs now and moves only the fused UDF's target (1 -> 2,
    # the workers it would get if split again). That ran the same processes, so a dip of 6%
    # in the next second (noise) is no move to undo: undone, it put the plan off for ten
    # steps, and the network took a reader away (half the rows/s for a second, at an epoch's
    # start).
    target = UDF_RUNS.replace(workers=(2, 1, 2, 1))
    assert changes_workers(UDF_RUNS, target) and not changes_processes(UDF_RUNS, target)
    assert changes_processes(UDF_RUNS, target.replace(workers=(1, 1, 2, 1)))
    assert changes_processes(UDF_RUNS, target.replace(fused=(False, True, False, False)))
    tuner = InTuneTuner()
    tuner.reset(_criteo_udf(150.0, 0.8, 0.05), start=UDF_RUNS)
    assert tuner.step(_criteo_udf(164.0, 0.95, 0.15)).workers == (2, 1, 2, 1)  # same processes
    got = tuner.step(_criteo_udf(153.0, 0.8, 0.05))
    assert tuner.pending is not None and tuner.pending.mask[tuner.actions.plan_index]
    assert got.workers[0] == 2 and got.workers[3] == 1


def test_no_worker_is_taken_from_a_group_that_works_flat_out():
    from torchtune_pipe.tuning.intune.space import group_busy

    # The readers spend a fifth of their time reading and the rest in the fused UDFs: the
    # group is busy 0.995 of the time and waited for a CPU 0.06 of it. Read alone (0.18),
    # the readers looked idle to the network, which took one away (a third of the rows/s).
    space = ActionSpace(4)
    flat_out = _criteo_udf(150.0, 0.8, 0.05)
    assert group_busy(flat_out)[0] == pytest.approx(0.995)
    removals = [_index(0, k) for k, dw in enumerate(WORKER_DELTAS) if dw < 0]
    mask = space.mask(flat_out, UDF_RUNS)
    assert not any(mask[i] for i in removals) and mask[0]
    # The same busy share, mostly spent waiting for a CPU: fewer workers lose nothing.
    queued = _criteo_udf(150.0, 0.8, 0.5)
    assert mask_of(space, queued)[_index(0, 1)]
    # Over the memory limit a worker goes anyway.
    over = dataclasses.replace(flat_out, memory_limit_bytes=300 * MiB)
    assert mask_of(space, over)[_index(0, 1)]
    # Nor does a busier stage take one from them on a full machine.
    busier_batch = dataclasses.replace(
        flat_out, stages=(*flat_out.stages[:3], dataclasses.replace(flat_out.stages[3], busy=0.5))
    )
    grown = space.apply(UDF_RUNS, _index(3, 0), busier_batch)
    assert grown.workers[0] == 2
    # The state gives the network the group's busy share on the readers' row too.
    encoder = StateEncoder(4)
    encoder.update_references(flat_out)
    state = encoder.encode(flat_out, UDF_RUNS, None)
    assert state[2] == pytest.approx(0.995)


def mask_of(space: ActionSpace, obs: Observation) -> torch.Tensor:
    return space.mask(obs, obs.allocation().replace(fused=UDF_RUNS.fused))


def test_an_undo_is_the_steps_only_worker_move():
    # A third reader made the group queue for the CPUs: rows/s fell 10%. The next step goes
    # back to two readers and moves no other worker: the network's next choice, the undone
    # move barred, would be judged against an interval that ran neither.
    tuner = InTuneTuner()
    tuner.reset(_criteo_udf(152.0, 0.8, 0.05), start=UDF_RUNS)
    tuner.prepare(_criteo_udf(152.0, 0.8, 0.05))
    grown = tuner.take(_index(0, 0))
    assert grown.workers[0] == 3
    got = tuner.step(_criteo_udf(137.0, 0.7, 0.23, readers=3))
    assert got.workers[0] == 2 and got.workers[3] == 1
    assert tuner.pending is not None
    assert not (tuner.pending.mask & tuner.actions.worker_moves()).any()
    assert tuner.pending.mask[0]


def test_a_plan_that_adds_a_process_for_a_sliver_of_throughput_is_shut():
    from torchtune_pipe.tuning.intune.agent import GROW_MIN_GAIN, _grows_for_little
    from torchtune_pipe.tuning.planner import Plan

    # A third reader (~60 MiB of parse buffers) for 0.2% more rows/s by the plan's model.
    three = UDF_RUNS.replace(workers=(3, 1, 2, 1))
    assert _grows_for_little(Plan(three, 154.6, 154.3), UDF_RUNS)  # +0.2% for 60 MiB
    assert not _grows_for_little(Plan(three, 154.3 * (1 + 2 * GROW_MIN_GAIN), 154.3), UDF_RUNS)
    fewer = UDF_RUNS.replace(workers=(1, 1, 2, 1))
    assert not _grows_for_little(Plan(fewer, 150.0, 154.3), UDF_RUNS)  # not more processes
    # A fused stage's target is no process of its own.
    assert not _grows_for_little(Plan(UDF_RUNS.replace(workers=(2, 1, 2, 1)), 150, 150), UDF_RUNS)


def test_removing_a_worker_from_a_stage_that_runs_none_leaves_it_at_none():
    # A fused stage reports 0 workers; an unmasked removal (the Gymnasium checker's random
    # actions ignore the mask) must not ask for -1 of them.
    space = ActionSpace(2)
    remove = next(
        i for i in range(space.n) if space.decode(i).stage == 1 and space.decode(i).workers < 0
    )
    got = space.apply(Allocation((2, 0), (MiB, MiB), fused=(False, True)), remove)
    assert got.workers == (2, 0)


def test_a_plan_that_runs_fewer_processes_for_the_same_rate_is_taken():
    # Eight readers a quarter busy and two UDF workers feed a consumer that takes 10 items/s:
    # the plan makes the same 10/s with two readers and one UDF worker (each at its need:
    # the headroom's margin is under half a worker). Each process costs its memory, so the
    # tuner takes it (where the network alone would add readers).
    read = StageStats("read", 8, items_per_s=10.0, busy=0.25, cpu_s_per_item=0.01, io_bound=True)
    udf = StageStats("udf", 2, items_per_s=10.0, busy=0.5, cpu_s_per_item=0.1)
    obs = Observation((read, udf), 10.0, 4.0, 8 * GiB, GiB, consumer_step_s=0.1)
    now = Allocation((8, 2), (MiB, MiB))
    tuner = InTuneTuner()
    tuner.reset(obs, start=now)
    assert tuner.step(obs).workers == (2, 1)
    # A plan with as many processes, or fewer for less throughput, is the network's call.
    tuner = InTuneTuner()
    tuner.reset(obs, start=Allocation((2, 1), (MiB, MiB)))
    busier = dataclasses.replace(read, workers=2, busy=1.0)  # the same work on two
    busier_udf = dataclasses.replace(udf, workers=1, busy=1.0)
    tuner.step(dataclasses.replace(obs, stages=(busier, busier_udf)))
    assert not tuner.plan_trims()


def test_the_planner_is_a_tuner_of_its_own_and_the_network_runs_without_the_plan():
    from torchtune_pipe.tuning.registry import TUNERS, make_tuner

    assert "planner" in TUNERS
    planner = make_tuner("planner")
    assert isinstance(planner, InTuneTuner) and planner.plan_only and planner.name == "planner"
    assert make_tuner("intune").name == "intune"
    # The network alone: the plan action is never open, and the stages run as they are.
    read = StageStats("read", 8, items_per_s=10.0, busy=0.25, cpu_s_per_item=0.01, io_bound=True)
    udf = StageStats("udf", 2, items_per_s=10.0, busy=0.5, cpu_s_per_item=0.1, fusable=True)
    obs = Observation((read, udf), 10.0, 4.0, 8 * GiB, GiB, consumer_step_s=0.1)
    alone = InTuneTuner(plan_action=False)
    assert make_tuner("network-only").name == alone.name == "network-only"
    assert not make_tuner("network-only").plan_action
    assert not alone.starts_fused
    assert not any(alone.reset(obs, start=Allocation((8, 2), (MiB, MiB))).fused)
    for _ in range(5):
        alone.step(obs)
        assert not alone.pending.mask[alone.actions.plan_index]
    with pytest.raises(ValueError, match="plan_only"):
        InTuneTuner(plan_only=True, plan_action=False)


def test_the_guard_forgets_what_allocations_delivered_on_another_cpu_count():
    # 4 workers per stage delivered 200 items/s on 16 CPUs, 2 deliver 100 on 8: the guard
    # must not take the 16-CPU rate for a better allocation now and bring the 4 back.
    tuner = InTuneTuner(plan_action=False)
    wide = _obs(workers=(4, 4, 4), cpus=16.0, throughput=200.0)
    tuner.reset(wide, start=wide.allocation())
    narrow = _obs(workers=(2, 2, 2), cpus=8.0, throughput=100.0)
    for obs in (wide,) * 3 + (narrow,) * 3:
        tuner.step(obs)
    tuner.prepare(narrow)
    assert tuner.pending is not None and tuner.pending.current.workers == (2, 2, 2)
