"""Frames bigger than a worker's budget count against it; nothing deadlocks (``policy``)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from multiproc import Batcher, Executor, ExecutorSpec, StageSpec, policy
from multiproc.frames import WorkerState as WS
from multiproc.items import estimated_size, serialized_size

from . import _fns


@dataclass
class FakeWorker:
    state: WS = WS.READY
    inflight: dict = field(default_factory=dict)
    blocked: bool = False
    flushing: bool = False


def test_a_blocked_worker_spills_only_when_none_of_its_frames_is_pending():
    assert policy.may_spill(0)
    assert not policy.may_spill(1)


def test_stall_releases_every_blocked_worker_when_nothing_can_move():
    a, b = FakeWorker(blocked=True, inflight={1: "unit"}), FakeWorker(blocked=True)
    idle = FakeWorker()
    assert policy.stalled([a, idle, b], sink_frames=0) == [a, b]


@pytest.mark.parametrize(
    "other",
    [
        FakeWorker(inflight={7: "frame"}),  # working on a frame: it will emit or finish
        FakeWorker(state=WS.STARTING),  # will take work once it says hello
        FakeWorker(flushing=True),  # a reducer emitting its last items
        FakeWorker(state=WS.RETIRING, inflight={7: "frame"}),
    ],
)
def test_no_stall_while_another_worker_can_progress(other):
    assert policy.stalled([FakeWorker(blocked=True), other], sink_frames=0) == []


def test_no_stall_while_the_consumer_has_frames_to_take():
    assert policy.stalled([FakeWorker(blocked=True)], sink_frames=1) == []


def test_dead_workers_are_neither_progress_nor_released():
    dead = FakeWorker(state=WS.DEAD, blocked=True, inflight={1: "f"})
    assert policy.stalled([dead], sink_frames=0) == []


def test_items_bigger_than_the_budget_stay_within_it_behind_a_slow_consumer():
    """10 MiB items through a 1 MiB budget: each worker has at most one frame out at a time
    (unpaced, the stage ran 100 items ahead of the consumer: a gigabyte resident)."""
    workers = 2
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=1),
            StageSpec("big", "map", _fns.ten_mb, workers=workers, buffer_bytes=1 << 20),
        ),
        ordered=True,
    )
    ahead = []
    with Executor(spec) as ex:
        for i, x in enumerate(ex.run([(0, 40)])):
            assert x["id"] == i
            del x
            # A slow consumer: whatever the stage could make while it waits, it makes now.
            deadline = time.monotonic() + 0.05
            while time.monotonic() < deadline:
                time.sleep(0.005)
            ahead.append(ex.snapshot().stage("big").items_out - (i + 1))
        spilled = ex.snapshot().stage("big").spilled
    assert max(ahead) <= workers, ahead
    assert spilled == 40


@pytest.mark.parametrize("budget", [64 * 1024, 2 << 20], ids=["oversized", "one-frame-arena"])
def test_ordered_delivery_behind_out_of_order_workers_does_not_deadlock(budget):
    """Two workers finish 2 MiB frames out of order; a batch stage takes them in order. A
    worker can hold (in its arena, or as its one oversized frame) a frame parked behind a
    sequence number it has yet to make: the router lets it through instead of waiting."""
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=1, workers=2),
            StageSpec("big", "map", _fns.two_mb_out_of_order, workers=2, buffer_bytes=budget),
            StageSpec(
                "batch", "stateful", Batcher(4, _fns.ids_of), max_workers=1, buffer_bytes=1 << 16
            ),
        ),
        ordered=True,
    )
    with Executor(spec) as ex:
        got = [i for batch in ex.run([(k, k + 6) for k in range(0, 60, 6)]) for i in batch]
    assert got == list(range(60))


@pytest.mark.parametrize(
    "item_bytes, most, want", [(100, 64, 64), (1 << 20, 64, 4), (10 << 20, 64, 1), (0, 8, 8)]
)
def test_frames_of_large_items_hold_few_of_them(item_bytes, most, want):
    assert policy.frame_items(item_bytes, most) == want


def test_an_item_is_sized_without_pickling_it_and_always_the_same_way():
    rows = torch.randn(1000, 32)
    batch = [(rows[i], torch.tensor(i)) for i in range(128)]  # views of a 128 KB tensor
    size = estimated_size(batch)
    # A view travels as its own bytes (32 floats), not its base's.
    assert 128 * 32 * 4 <= size <= 2 * serialized_size(batch)
    assert estimated_size(batch) == size
    big = np.zeros(1 << 20, dtype=np.uint8)
    assert estimated_size({"x": big, "y": [b"ab"] * 1000}) >= big.nbytes + 2000
    # An object that is neither a container nor an array is pickled to be measured.
    assert estimated_size(_fns.Blob(1 << 16)) == serialized_size(_fns.Blob(1 << 16))
    # A sparse tensor has no nbytes (it raises): pickled, as such an object is.
    sparse = torch.sparse_coo_tensor([[0, 5]], [1.0, 2.0], (1000,))
    assert estimated_size([sparse, sparse]) >= 2 * serialized_size(sparse)


def test_a_source_of_large_items_frames_them_small_and_a_dead_worker_loses_nothing(tmp_path):
    """1 MiB items under frame_items=64 travel three per frame; the source worker, killed
    halfway through a unit, has the unit delivered again with its committed frames skipped:
    the new worker frames it the same way, so every item arrives exactly once."""
    spec = ExecutorSpec(
        (
            StageSpec(
                "read", "source", _fns.ReadBigDieOnce(str(tmp_path / "died")), frame_items=64
            ),
            StageSpec("ids", "map", _fns.id_of, workers=2),
        ),
    )
    with Executor(spec) as ex:
        got = sorted(ex.run([(0, 40), (40, 100)]))
        rows = ex.snapshot(per_worker=True).stage("ids").per_worker
    assert got == list(range(100))
    # Three 1 MiB items (and their pickled headers) per 4 MiB frame: 14 + 20 frames reach the
    # next stage, none of them twice.
    assert sum(w.frames_in for w in rows) == 14 + 20


def _arena_bytes() -> int:
    """Memory behind this process's arenas (written pages of the shared-memory files); not
    the segments of spilled frames (``..._s<n>``), which come and go with their frames."""
    total = 0
    for p in Path("/dev/shm").glob(f"ttp_{os.getpid()}_*"):
        if re.search(r"_s\d+$", p.name):
            continue
        try:
            total += p.stat().st_blocks * 512
        except FileNotFoundError:
            pass  # removed between the listing and the stat
    return total


def test_a_smaller_budget_gives_the_arena_pages_back():
    """Written arena pages stay resident after their frames are freed; when the budget
    shrinks, the worker releases the free ones, so the arena's memory follows the budget."""
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=1),
            StageSpec("big", "map", _fns.big_tensor, buffer_bytes=32 << 20),
        ),
    )
    with Executor(spec) as ex:
        # Items enough that the deadline, not the end of the run, bounds the wait below.
        it = ex.run([(0, 50_000)])
        held = [next(it) for _ in range(64)]  # 64 frames of 256 KiB written: 16 MiB
        before = _arena_bytes()
        del held
        ex.set_budget("big", 1 << 20)
        deadline = time.monotonic() + 30
        for _ in it:
            if _arena_bytes() <= 2 << 20 or time.monotonic() > deadline:
                break
        after = _arena_bytes()
    assert before >= 16 << 20, before
    assert after <= 2 << 20, (before, after)


@dataclass
class Loaded:
    wid: int
    inflight: dict
    ahead: int = 1


def test_the_least_loaded_worker_gets_the_next_frame_within_its_credits():
    a, b = Loaded(0, {1: 0, 2: 0}), Loaded(1, {3: 0})
    assert policy.pick_worker([a, b], credits=2) is b
    assert policy.pick_worker([a, Loaded(1, {3: 0, 4: 0})], credits=2) is None
    # A source worker that reads two units at once has room for one more.
    assert policy.pick_worker([a, Loaded(1, {3: 0, 4: 0}, ahead=2)], credits=2).wid == 1


def test_the_last_units_wait_for_the_workers_still_to_come():
    reading, idle = Loaded(0, {1: 0}), Loaded(1, {})
    # Two shards, the second worker still starting: the ready one reads only its own.
    assert policy.pick_unit_worker([reading], 2, units_left=1, coming=1) is None
    # More units than workers to come: the ready one takes the next as usual.
    assert policy.pick_unit_worker([reading], 2, units_left=2, coming=1) is reading
    # A ready worker holding nothing takes a unit whatever is coming.
    assert policy.pick_unit_worker([reading, idle], 2, units_left=1, coming=1) is idle
    assert policy.pick_unit_worker([reading], 2, units_left=1, coming=0) is reading


def test_a_budget_splits_evenly_with_a_floor():
    assert policy.budget_share(64 << 20, 4) == 16 << 20
    assert policy.budget_share(64 << 10, 8) == policy.MIN_SHARE_BYTES
    assert policy.budget_share(1 << 20, 0) == 1 << 20


def test_a_shrink_retires_the_least_loaded_then_the_newest():
    old_idle, new_idle, busy = Loaded(1, {}), Loaded(5, {}), Loaded(2, {9: 0})
    assert policy.to_retire([busy, old_idle, new_idle], 2) == [new_idle, old_idle]
    assert policy.to_retire([busy, old_idle], 1) == [old_idle]


def test_a_worker_waiting_for_room_inside_a_unit_ends_when_told_to():
    """The consumer took one item and stopped; the worker waits for room in its arena in the
    middle of a unit. Closing the executor tells it to end: it ends then (status 0), not when
    the close's grace period is over, killed by SIGTERM (an epoch ended early waited 1.5 s)."""
    stage = StageSpec("read", "source", _fns.read_two_mb_items, frame_items=1, buffer_bytes=4 << 20)
    ex = Executor(ExecutorSpec((stage,)))
    try:
        run = ex.run([(0, 16)])
        assert float(next(run)[0]) == 0.0
        procs = [h.proc for h in ex._state.workers.values() if not h.thread]
        deadline = time.monotonic() + 10.0
        while ex.snapshot().stage("read").items_out < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # it fills its 4 MiB and waits for room for the next item
        time.sleep(0.1)
    finally:
        ex.close()
    assert procs and [p.exitcode for p in procs] == [0] * len(procs)


def test_a_worker_inside_a_long_unit_ends_when_told_to():
    """A unit as long as a shard (3 s), with room for every frame: the consumer takes one item
    and closes. The worker sees the Exit between two frames and ends then (status 0), not at
    the unit's end or when the close's grace period is over (SIGTERM)."""
    stage = StageSpec("read", "source", _fns.read_slowly, frame_items=1)
    ex = Executor(ExecutorSpec((stage,)))
    try:
        assert next(ex.run([(0, 300)])) == 0
        procs = [h.proc for h in ex._state.workers.values() if not h.thread]
    finally:
        ex.close()
    assert procs and [p.exitcode for p in procs] == [0] * len(procs)
