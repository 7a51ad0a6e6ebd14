"""Which moves the InTune tuner may make: the plan's model against the network's worker moves."""

from __future__ import annotations

from torchtune_pipe.tuning.base import MiB, Observation, StageStats
from torchtune_pipe.tuning.intune.agent import (
    ACTIONS_PER_STAGE,
    REVERT_DROP,
    WORKER_DELTAS,
    InTuneTuner,
    mask_predicted_drops,
)

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
    assert mask_predicted_drops(opened.clone(), tuner.actions, obs, p.current, None).equal(opened)
    got = mask_predicted_drops(opened.clone(), tuner.actions, obs, p.current, p.planned)
    assert got.equal(p.mask)
