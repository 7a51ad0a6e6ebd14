"""Buffer sizing below every tuner: a buffer's floor (room for a few takes of its reader),
its lean size where memory bounds a plan, and the plan action that carries them."""

import dataclasses
import math

import pytest

from torchtune_pipe.tuning import MiB, Observation, StageStats
from torchtune_pipe.tuning.base import Allocation
from torchtune_pipe.tuning.intune.agent import ActionSpace
from torchtune_pipe.tuning.planner import plan


def test_where_memory_bounds_the_plan_buffers_that_hold_little_shrink_to_buy_workers():
    from torchtune_pipe.tuning.planner import HEADROOM, MEMORY_SHARE, _plan
    from torchtune_pipe.tuning.safety import LEAN_FILL, SHED_BUFFER_FLOOR_BYTES, lean_buffers

    # Read (waits on I/O) -> a CPU map, each worker 100 MiB; two 512 MiB buffers a tenth full
    # (item sizes not measured, as live). Under 2 GiB the buffers leave room for fewer
    # workers than the 16 cores could run.
    read = StageStats("read", 2, items_per_s=100.0, busy=1.0, cpu_s_per_item=0.002,
                      io_bound=True, buffer_bytes=512 * MiB, buffer_fill=0.1)  # fmt: skip
    udf = StageStats("udf", 2, items_per_s=100.0, busy=1.0, cpu_s_per_item=0.02,
                     buffer_bytes=512 * MiB, buffer_fill=0.1)  # fmt: skip
    obs = Observation((read, udf), 100.0, 16.0, 2048 * MiB, 0)
    alloc = obs.allocation()
    lean = lean_buffers(obs, alloc)
    assert lean == (math.ceil(LEAN_FILL * 0.1 * 512 * MiB),) * 2
    p = plan(obs, alloc, per_worker_bytes=100 * MiB)
    assert p.allocation.buffer_bytes == lean
    worst = sum(p.allocation.workers) * 100 * MiB + sum(p.allocation.buffer_bytes)
    assert worst <= MEMORY_SHARE * obs.memory_limit_bytes
    # What the buffers as they are allow: fewer workers, a lower rate.
    as_is = _plan(obs, alloc, per_worker_bytes=100 * MiB, fixed_bytes=0.0, headroom=HEADROOM,
                  fusion=True, known_hops=())  # fmt: skip
    assert sum(as_is.allocation.workers) < sum(p.allocation.workers)
    assert p.throughput > as_is.throughput
    # Roomy memory: the plan keeps the buffers it was given.
    roomy = dataclasses.replace(obs, memory_limit_bytes=64 << 30)
    kept = plan(roomy, alloc, per_worker_bytes=100 * MiB)
    assert kept.allocation.buffer_bytes == (512 * MiB,) * 2
    assert kept.allocation.workers == p.allocation.workers or kept.throughput >= p.throughput
    # Item sizes measured: a buffer needs LEAN_S of its stage's bytes and LEAN_ITEMS items,
    # never less than the shed floor nor more than it has; a full buffer only holds a
    # producer ahead of a slower reader, so its fill does not count then.
    sized = [dataclasses.replace(s, bytes_per_item=1e6, buffer_fill=1.0) for s in obs.stages]
    sized = dataclasses.replace(obs, stages=tuple(sized))
    assert lean_buffers(sized, alloc) == (10**7,) * 2  # 0.1 s of 100 items/s of 1 MB
    tiny = [dataclasses.replace(s, bytes_per_item=10.0) for s in sized.stages]
    tiny = dataclasses.replace(obs, stages=tuple(tiny))
    assert lean_buffers(tiny, alloc) == (SHED_BUFFER_FLOOR_BYTES,) * 2


def test_the_plan_action_takes_the_plan_as_it_is_buffers_included():
    from torchtune_pipe.tuning.planner import Plan

    space = ActionSpace(2)
    now = Allocation((2, 2), (512 * MiB, 4 * MiB))
    planned = Plan(Allocation((6, 7), (8 * MiB, 16 * MiB)), 10.0, 5.0)
    got = space.apply(now, space.plan_index, planned=planned)
    assert got == planned.allocation


def _rows_into_a_collate(buffer_bytes: int, limit: int = 64 << 30) -> Observation:
    # Rows of 520 B at 300k/s into a collate of 8192 rows (37 batches/s): one batch's rows
    # are 4.3 MB, more than a 4 MiB buffer holds.
    rows = StageStats("rows", 12, items_per_s=300_000.0, busy=0.7, cpu_s_per_item=2e-5,
                      buffer_bytes=buffer_bytes, buffer_fill=1.0, bytes_per_item=520.0)  # fmt: skip
    batch = StageStats("batch", 1, items_per_s=300_000.0 / 8192, busy=0.6, cpu_s_per_item=0.015,
                       buffer_bytes=64 * MiB, buffer_fill=0.1, bytes_per_item=520.0 * 8192)  # fmt: skip
    return Observation((rows, batch), 300_000.0 / 8192, 96.0, limit, 0)


def test_a_buffer_holds_a_few_takes_of_its_reader():
    from torchtune_pipe.tuning.safety import (
        LEAN_ITEMS,
        SHED_BUFFER_FLOOR_BYTES,
        buffer_floors,
        fit_memory,
        take_bytes,
    )

    obs = _rows_into_a_collate(4 * MiB)
    # The collate takes 8192 rows per batch; the consumer takes one batch at a time.
    assert take_bytes(obs) == [pytest.approx(520.0 * 8192), pytest.approx(520.0 * 8192)]
    floors = buffer_floors(obs)
    assert floors[0] == math.ceil(LEAN_ITEMS * 520 * 8192) > 4 * MiB
    # Item sizes not measured (live): the shed floor.
    unsized = dataclasses.replace(
        obs, stages=tuple(dataclasses.replace(s, bytes_per_item=0.0) for s in obs.stages)
    )
    assert buffer_floors(unsized) == [SHED_BUFFER_FLOOR_BYTES] * 2
    # The plan raises the collate's input buffer to its floor...
    p = plan(obs, obs.allocation())
    assert p.allocation.buffer_bytes[0] == floors[0]
    # ...and shedding for memory stops there before any worker goes.
    # (Under 40 MiB the two buffers fit at their floors, 2 x 17 MB, and not at 16 MiB each
    # above a 4 MiB shed floor's halving.)
    tight = dataclasses.replace(_rows_into_a_collate(256 * MiB), memory_limit_bytes=40 * MiB)
    fitted = fit_memory(tight.allocation(), tight)
    assert fitted.buffer_bytes == (floors[0], floors[1])
    assert fitted.workers == tight.workers


def test_a_hosts_buffer_is_sized_by_its_groups_last_items():
    from torchtune_pipe.tuning.safety import take_bytes

    # A reader of 520 B rows with a map fused into it that makes 2 KB rows, read by a collate
    # of 8192: the host's buffer carries the map's rows.
    obs = _rows_into_a_collate(64 * MiB)
    rows, batch = obs.stages
    wider = dataclasses.replace(rows, name="widen", workers=0, fused=True, bytes_per_item=2048.0)
    obs = dataclasses.replace(obs, stages=(rows, wider, batch))
    assert take_bytes(obs) == [pytest.approx(2048.0 * 8192), 0.0, pytest.approx(520.0 * 8192)]
