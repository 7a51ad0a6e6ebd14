"""Which moves the InTune tuner may make: the plan's model against the network's worker moves,
and what an undo bars (at one CPU count only)."""

from __future__ import annotations

import dataclasses

from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats
from torchtune_pipe.tuning.intune.agent import (
    ACTIONS_PER_STAGE,
    REVERT_DROP,
    TABU_STEPS,
    WORKER_DELTAS,
    InTuneTuner,
)
from torchtune_pipe.tuning.intune.space import mask_predicted_drops

GiB = 1024 * MiB


def _move(stage: int, delta: int) -> int:
    return 1 + ACTIONS_PER_STAGE * stage + WORKER_DELTAS.index(delta)


def _read_udf(cpus: float = 8.0, throughput: float = 20.0) -> Observation:
    """Eight readers a quarter busy feed two UDF workers that work flat out (0.1 s an item):
    the UDF's two workers bound the pipeline."""
    read = StageStats("read", 8, items_per_s=throughput, busy=0.25, cpu_s_per_item=0.01,
                      io_bound=True)  # fmt: skip
    udf = StageStats("udf", 2, items_per_s=throughput, busy=1.0, cpu_s_per_item=0.1)
    return Observation((read, udf), throughput, cpus, 8 * GiB, GiB)


def test_a_worker_move_the_model_rates_as_a_drop_is_closed_to_the_network():
    """Two cores, both taken: a reader half busy, two UDF workers three quarters busy at
    0.15 s of CPU an item, 10 items/s. The removal masks leave a UDF worker open to removal
    (a worker fewer frees a core), but one UDF worker makes 6.7 items/s by the plan's model:
    closed (the undo would take it back, after an interval a third slower). A move the model
    rates no lower stays open."""
    read = StageStats("read", 1, items_per_s=10.0, busy=0.5, cpu_s_per_item=0.05)
    udf = StageStats("udf", 2, items_per_s=10.0, busy=0.75, cpu_s_per_item=0.15)
    obs = Observation((read, udf), 10.0, 2.0, 8 * GiB, GiB)
    tuner = InTuneTuner()
    tuner.reset(obs, start=obs.allocation())
    tuner.prepare(obs)
    p = tuner.pending
    assert p is not None and p.planned is not None and p.planned.rate_of is not None
    assert p.planned.rate_of((1, 1)) < (1 - REVERT_DROP) * p.planned.rate_of((1, 2))
    assert not p.mask[_move(1, -1)] and p.mask[_move(0, 1)]
    # The same mask without the model's word: the removal is open.
    opened = p.mask.clone()
    opened[_move(1, -1)] = True
    assert mask_predicted_drops(
        opened.clone(), tuner.actions, obs, p.current, None, REVERT_DROP
    ).equal(opened)
    got = mask_predicted_drops(
        opened.clone(), tuner.actions, obs, p.current, p.planned, REVERT_DROP
    )
    assert got.equal(p.mask)


def test_what_an_undo_bars_is_forgotten_when_the_cpu_count_changes():
    """A UDF worker added on 8 CPUs cost 20% of the rate: undone, and barred at 8 CPUs. On 16
    CPUs it is a move like any other."""
    tuner = InTuneTuner(plan_action=False)
    obs = _read_udf()
    tuner.reset(obs, start=obs.allocation())
    tuner.prepare(obs)
    grown = tuner.take(_move(1, 1))
    assert grown.workers[1] == 3
    worse = dataclasses.replace(_read_udf(throughput=16.0))
    worse = dataclasses.replace(
        worse, stages=(worse.stages[0], dataclasses.replace(worse.stages[1], workers=3))
    )
    tuner.prepare(worse)
    assert tuner.pending.current.workers == (8, 2)  # undone
    tuner.take(0)
    tuner.prepare(obs)
    assert not tuner.pending.mask[_move(1, 1)]  # barred
    tuner.take(0)
    tuner.prepare(_read_udf(cpus=16.0))
    assert tuner.pending.mask[_move(1, 1)]


def test_a_reshape_undone_again_is_barred_twice_as_long():
    """The plan's model errs most where a reshape frees or splits a stage's cache: a move to
    a fusion shape the undo took back may not be planned again at this CPU count for
    TABU_STEPS steps, then twice as long after each further undo; another CPU count clears
    it."""
    tuner = InTuneTuner()
    read = StageStats("read", 2, items_per_s=10.0, busy=0.5, cpu_s_per_item=0.05)
    udf = StageStats("udf", 2, items_per_s=10.0, busy=0.5, cpu_s_per_item=0.05, fusable=True)
    obs = Observation((read, udf), 10.0, 8.0, 8 * GiB, GiB)
    split = Allocation((2, 2), (MiB, MiB), fused=(False, False))
    fused = Allocation((2, 0), (MiB, MiB), fused=(False, True))
    tuner.reset(obs, start=split)
    for times in (1, 2):
        tuner._alloc = fused  # the move the undo takes back
        tuner._bar_reshape(obs, split)
        until = tuner.steps + TABU_STEPS * 2 ** (times - 1)
        assert tuner._reshape_barred(fused, split, obs)
        assert not tuner._reshape_barred(split, split, obs)  # no reshape: not barred
        tuner.steps = until - 1
        assert tuner._reshape_barred(fused, split, obs)
        tuner.steps = until
        assert not tuner._reshape_barred(fused, split, obs)
    tuner._bar_reshape(obs, split)
    tuner.prepare(dataclasses.replace(obs, cpus=16.0))
    assert not tuner._reshape_barred(fused, split, obs)
