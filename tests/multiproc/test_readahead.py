"""A source worker reads the units it holds side by side (multiproc.readahead): in order,
exactly once, its counters as if read one at a time, failures where they happened."""

from __future__ import annotations

import threading
import time

import pytest

from multiproc import Executor, ExecutorSpec, StageSpec, StageTimeoutError

from . import _fns

UNITS = [(i, i + 4) for i in range(0, 160, 4)]  # 40 units of 4 records


def _spec(read, width=8, workers=1, max_restarts=3, **kw):
    st = StageSpec(
        "read", "source", read, workers=workers, concurrency=width, max_concurrency=16, **kw
    )
    return ExecutorSpec(
        (st,),
        ordered=True,
        max_restarts=max_restarts,
    )


def _ids(out):
    return [x for x, *_ in out if x >= 0]


def _overlapped(out) -> int:
    """Units whose read started before the previous unit's read ended."""
    spans = sorted({(t0, t1) for x, t0, t1 in out if x >= 0})
    return sum(1 for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1])


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_units_are_read_side_by_side_and_committed_in_order(worker_type):
    with Executor(_spec(_fns.ReadSideBySide(), worker_type=worker_type)) as ex:
        out = list(ex.run(UNITS))
        snap = ex.snapshot().stage("read")
    assert _ids(out) == list(range(160))
    assert [m for m in out if m[0] < 0] == [(-1, lo, hi) for lo, hi in UNITS]  # ends in order
    # Concurrency 8 over units of 4 calls: two units in flight, most of the time.
    assert _overlapped(out) >= len(UNITS) // 2
    # The end marks are not items; the reading threads' CPU is counted.
    assert snap.items_in == snap.items_out == 160 and snap.cpu_ns > 0


def test_a_worker_is_busy_while_a_unit_is_read_counted_once_however_many():
    # Busy time is wall time with at least one unit in flight: overlapping reads are not
    # counted twice, so the stage's wall seconds per item (busy * workers / items per s)
    # fall as more units overlap, as the simulator's calls in flight make them fall.
    with Executor(_spec(_fns.ReadSideBySide(), width=16)) as ex:
        t0 = time.monotonic_ns()
        out = list(ex.run(UNITS))
        wall_ns = time.monotonic_ns() - t0
        snap = ex.snapshot().stage("read")
    assert _ids(out) == list(range(160))
    assert 0 < snap.busy_ns <= wall_ns
    # Four units at once: 40 units of 10 ms reads in well under 40 reads' time.
    assert snap.busy_ns < 40 * 10_000_000 * 0.75


def test_at_concurrency_of_one_unit_units_are_read_one_at_a_time():
    with Executor(_spec(_fns.ReadSideBySide(), width=4)) as ex:
        out = list(ex.run(UNITS[:10]))
    assert _ids(out) == list(range(40))
    assert _overlapped(out) == 0


def test_concurrency_and_workers_change_while_units_overlap_exactly_once():
    with Executor(_spec(_fns.ReadSideBySide(), width=8)) as ex:
        got = []
        for k, item in enumerate(ex.run(UNITS * 2)):
            got.append(item[0])
            if k == 20:
                ex.set_concurrency("read", 16)  # four units at once
            if k == 60:
                ex.resize("read", 2)
            if k == 120:
                ex.set_concurrency("read", 1)
            if k == 200:
                ex.set_concurrency("read", 8)
    assert [x for x in got if x >= 0] == list(range(160)) * 2


def test_a_worker_killed_while_reading_two_units_loses_and_repeats_nothing(tmp_path):
    read = _fns.ReadSideBySide(die_at=42, marker=str(tmp_path / "died"))
    with Executor(_spec(read)) as ex:
        out = list(ex.run(UNITS))
        restarts = ex.snapshot().stage("read").restarts
    assert (tmp_path / "died").exists() and restarts == 1
    assert _ids(out) == list(range(160))


def test_a_read_that_raises_is_reported_with_its_unit_after_the_units_before_it():
    got = []
    with Executor(_spec(_fns.ReadSideBySide(fail_at=57))) as ex:
        with pytest.raises(KeyError, match="missing record 57") as info:
            for item in ex.run(UNITS):
                got.append(item[0])
    assert "stage 'read'" in info.value.__notes__[0] and "(56, 60)" in info.value.__notes__[0]
    # Ordered: records before the failure, in order, nothing at or after it (the executor
    # raises as soon as the error reaches it, before frames still waiting in its sink).
    ids = [x for x in got if x >= 0]
    assert ids == list(range(len(ids))) and len(ids) <= 57
    with Executor(_spec(_fns.ReadSideBySide(fail_at=57), on_error="skip")) as ex:
        out = list(ex.run(UNITS))
    assert _ids(out) == [x for x in range(160) if not 57 <= x < 60]


def test_a_hanging_read_is_named_by_the_stage_timeout():
    with Executor(_spec(_fns.ReadSideBySide(hang_at=30), timeout_s=1.0)) as ex:
        with pytest.raises(StageTimeoutError, match="read"):
            list(ex.run(UNITS))


def _reading_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name.startswith(("multiproc-unit", "multiproc-call"))
    ]


def test_a_thread_workers_reading_threads_end_before_close_returns():
    """A thread worker's reads side by side stop at the item they make when it ends, and its
    threads are gone once the executor is closed: the process goes on, and one still freeing
    an item as the interpreter exits would abort it."""
    before = set(_reading_threads())
    ex = Executor(_spec(_fns.SlowItems(), worker_type="thread"))
    with ex:
        run = ex.run([(i, i + 20) for i in range(0, 160, 20)])
        assert next(run) == 0
        assert set(_reading_threads()) - before  # units being read side by side
        run.close()  # ends the run early: the executor closes
    assert not set(_reading_threads()) - before
