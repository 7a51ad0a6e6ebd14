"""A thread worker hands the frames it makes for the consumer over as they are
(``multiproc.arena.keep``): no copy, its arena's pages untouched, the same budget, order and
frees as any frame, and nothing kept once the executor is gone."""

from __future__ import annotations

import os
import time

import torch

from multiproc import Executor, ExecutorSpec, StageSpec, arena, shm

from . import _fns

MADE: dict[int, int] = {}  # id -> data_ptr of the tensor a thread worker made


def made_here(x: int) -> dict:
    t = torch.full((256 * 1024,), float(x))  # 1 MiB
    MADE[x] = t.data_ptr()
    return {"id": x, "t": t}


def spec(fn=made_here, worker_type="thread", budget=8 << 20, ordered=True) -> ExecutorSpec:
    return ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=1, worker_type=worker_type),
            StageSpec("make", "map", fn, workers=2, buffer_bytes=budget, worker_type=worker_type),
        ),
        ordered=ordered,
    )


def arena_blocks(ex: Executor, stage: str) -> int:
    """512-byte blocks of the arenas of ``stage``'s workers backed by memory now."""
    i = ex._names.index(stage)
    names = [h.seg_name for h in ex._state.workers.values() if h.stage == i]
    return sum(os.stat(arena.segment_path(n)).st_blocks for n in names)


def test_frames_for_the_consumer_arrive_as_the_objects_the_worker_made():
    MADE.clear()
    with Executor(spec()) as ex:
        got = list(ex.run([(0, 20), (20, 40)]))
        assert arena_blocks(ex, "make") == 0  # nothing was written to the arenas
    assert [x["id"] for x in got] == list(range(40))  # in order, each once
    assert [x["t"].data_ptr() for x in got] == [MADE[i] for i in range(40)]  # not copies
    assert all(float(x["t"][-1]) == x["id"] for x in got)
    assert not arena._kept


def test_process_workers_frames_still_travel_through_their_arena():
    with Executor(spec(fn=_fns.big_tensor, worker_type="process")) as ex:
        it = ex.run([(0, 40)])
        held = [next(it) for _ in range(4)]  # views of the arenas, alive
        assert arena_blocks(ex, "make") > 0
        rest = list(it)
    assert [x["id"] for x in held + rest] == list(range(40))


def test_kept_frames_hold_their_workers_budget_behind_a_slow_consumer():
    """Each frame holds a block of its estimated size: a worker stops at its share of the
    budget (2 MiB here, 1 MiB frames) until the consumer takes frames."""
    with Executor(spec(budget=4 << 20)) as ex:
        it = ex.run([(0, 30)])
        next(it)
        time.sleep(0.3)  # the workers fill their shares
        snap = ex.snapshot().stage("make")
        assert snap.items_out <= 1 + 2 * 3  # taken + 2 workers x (2 in the arena, 1 waiting)
        assert len(arena._kept) <= 2 * 3
        rest = list(it)
    assert [x["id"] for x in rest] == list(range(1, 30))


def test_a_frame_bigger_than_the_budget_is_handed_over_without_a_segment():
    with Executor(spec(fn=_fns.ten_mb, budget=1 << 20)) as ex:
        got = list(ex.run([(0, 6)]))
        assert ex.snapshot().stage("make").spilled == 6
        assert not [n for n in os.listdir(shm.directory()) if n.startswith(f"ttp_{ex._tag}_w")
                    and "_s" in n]  # fmt: skip
    assert [x["id"] for x in got] == list(range(6))


def test_an_executor_closed_mid_run_keeps_no_frame():
    ex = Executor(spec(ordered=False))
    it = ex.run([(0, 200)])
    next(it)
    time.sleep(0.2)
    assert arena._kept  # frames waiting for the consumer
    ex.close()
    assert not arena._kept
