"""Every error names its place, skips are exact and bounded, a stuck stage is named."""

from __future__ import annotations

import time

import pytest

from multiproc import (
    Executor,
    ExecutorClosedError,
    ExecutorSpec,
    StageError,
    StageSpec,
    StageTimeoutError,
    TooManyErrorsError,
)

from . import _fns


def _spec(*stages, **kw):
    return ExecutorSpec(tuple(stages), **kw)


def _read(**kw):
    return StageSpec("read", "source", _fns.read_range, **kw)


def test_a_source_that_raises_under_skip_keeps_every_item_it_made():
    spec = _spec(StageSpec("read", "source", _fns.read_fail_at_100, on_error="skip", max_errors=5))
    with Executor(spec) as ex:
        got = sorted(ex.run([(0, 1000), (1000, 2000)]))
        assert got == list(range(100)) + list(range(1000, 1100))  # not 64 of each
        assert ex.snapshot().stage("read").errors == 2


def test_skips_past_max_errors_raise_with_counts_and_last_errors():
    spec = _spec(_read(), StageSpec("udf", "map", _fns.fail_every_5th, on_error="skip"))
    with Executor(spec) as ex, pytest.raises(TooManyErrorsError) as e:
        list(ex.run([(0, 2000)]))
    msg = str(e.value)
    assert "stage 'udf'" in msg and "items skipped of" in msg and "max_errors=0.1" in msg
    assert "ValueError: bad" in msg  # the last errors
    counted = _spec(_read(), StageSpec("udf", "map", _fns.fail_every_5th, on_error="skip",
                                       max_errors=3))  # fmt: skip
    with Executor(counted) as ex, pytest.raises(TooManyErrorsError, match="4 items skipped"):
        list(ex.run([(0, 100)]))
    unbounded = _spec(_read(), StageSpec("udf", "map", _fns.fail_every_5th, on_error="skip",
                                         max_errors=None))  # fmt: skip
    with Executor(unbounded) as ex:
        assert len(list(ex.run([(0, 100)]))) == 80


def test_a_return_value_that_does_not_pickle_names_stage_item_and_type():
    spec = _spec(_read(), StageSpec("udf", "map", _fns.lock_on_13))
    with Executor(spec) as ex, pytest.raises(StageError) as e:
        list(ex.run([(0, 100)]))
    text = str(e.value) + "".join(getattr(e.value, "__notes__", []))
    assert "stage 'udf'" in text and "item 13" in text and "['state']" in text
    assert "_thread.lock" in text and "worker start" not in text
    skipping = _spec(_read(), StageSpec("udf", "map", _fns.lock_on_13, on_error="skip"))
    with Executor(skipping) as ex:
        assert sorted(x["id"] for x in ex.run([(0, 100)])) == [i for i in range(100) if i != 13]
        assert ex.snapshot().stage("udf").errors == 1


def test_error_notes_cut_a_huge_unit():
    spec = _spec(StageSpec("read", "source", _fns.read_big_unit))
    with Executor(spec) as ex, pytest.raises(ValueError) as e:
        list(ex.run([list(range(1_000_000))]))
    notes = "".join(e.value.__notes__)
    assert "work unit [0, 1, 2" in notes and len(notes) < 1000


def test_after_close_snapshot_and_iteration_say_closed():
    spec = _spec(_read(), StageSpec("a", "map", _fns.identity))
    ex = Executor(spec)
    it = ex.run([(0, 50_000)])
    next(it)
    ex.close()
    with pytest.raises(ExecutorClosedError, match="after close"):
        ex.snapshot()
    with pytest.raises(ExecutorClosedError, match="after close"):
        list(it)  # the rest of the frame in hand, then the next frame's segment is gone
    with pytest.raises(ExecutorClosedError):
        ex.run([(0, 10)])


@pytest.mark.slow
def test_busy_and_timeout_name_the_stuck_stage_worker_and_item():
    spec = _spec(_read(frame_items=4), StageSpec("udf", "map", _fns.sleep_on_7))
    with Executor(spec) as ex:
        it = ex.run([(0, 16)])
        deadline = time.monotonic() + 20
        while not ex.busy(0.3) and time.monotonic() < deadline:
            time.sleep(0.02)  # polling with a deadline: entering a function has no event
        (b,) = ex.busy(0.3)
        assert b.stage == "udf" and b.work.startswith("item 3 of frame") and b.pid > 0
        assert ex.snapshot().stage("udf").busy_ns >= 0.3e9  # a running call counts as busy
        it.close()
    timed = _spec(_read(frame_items=4), StageSpec("udf", "map", _fns.sleep_on_7, timeout_s=0.3))
    with Executor(timed) as ex, pytest.raises(StageTimeoutError) as e:
        list(ex.run([(0, 16)]))
    assert "stage 'udf' worker" in str(e.value) and "item 3 of frame" in str(e.value)
    assert "timeout_s=0.3" in str(e.value)
    source = _spec(StageSpec("read", "source", _fns.read_stuck_at_3, timeout_s=0.3))
    with (
        Executor(source) as ex,
        pytest.raises(StageTimeoutError, match=r"work unit \(0, 9\)"),
    ):
        list(ex.run([(0, 9)]))
