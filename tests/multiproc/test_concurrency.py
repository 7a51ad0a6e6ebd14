"""Calls in flight per worker: order, exactly-once, errors and hangs, resizing the knob."""

from __future__ import annotations

import os

import pytest

from multiproc import (
    CallPool,
    Executor,
    ExecutorSpec,
    SpecError,
    StageSpec,
    StageTimeoutError,
    concurrency,
)

from . import _fns


def _spec(fn, width, **kw):
    return ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=32),
            StageSpec("fetch", "map", fn, concurrency=width, max_concurrency=16, **kw),
        ),
        ordered=True,
    )


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_calls_of_a_frame_run_side_by_side_in_order(worker_type):
    with Executor(_spec(_fns.wait_10ms_thread, 8, worker_type=worker_type)) as ex:
        out = list(ex.run([(0, 96)]))
        snap = ex.snapshot().stage("fetch")
    assert [x for x, _ in out] == list(range(96))
    assert len({t for _, t in out}) > 1  # more than one thread ran the calls
    assert snap.concurrency == 8 and snap.items_out == 96


def test_concurrency_changes_while_running_exactly_once():
    with Executor(_spec(_fns.wait_10ms_thread, 1)) as ex:
        got = []
        for k, (x, _) in enumerate(ex.run([(i, i + 32) for i in range(0, 640, 32)])):
            got.append(x)
            if k in (40, 300):
                ex.set_concurrency("fetch", 12 if k == 40 else 2)
            if k == 150:
                ex.resize("fetch", 2)
        assert ex.concurrency("fetch") == 2
    assert got == list(range(640))


def test_a_raising_call_is_reported_with_its_item_or_skipped():
    with Executor(_spec(_fns.wait_then_fail_on_5, 8)) as ex:
        with pytest.raises(KeyError, match="missing record 5") as info:
            list(ex.run([(0, 64)]))
    assert (
        "stage 'fetch'" in info.value.__notes__[0]
        and "item 5 of frame 0" in (info.value.__notes__[0])
    )
    spec = _spec(_fns.wait_then_fail_on_5, 8, on_error="skip", max_errors=None)
    with Executor(spec) as ex:
        out = list(ex.run([(0, 64)]))
    assert out == [x for x in range(64) if x % 10 != 5]


def test_a_hanging_call_is_named_by_the_stage_timeout():
    spec = _spec(_fns.sleep_on_7, 8, timeout_s=1.0)
    with Executor(spec) as ex:
        with pytest.raises(StageTimeoutError, match="fetch"):
            list(ex.run([(0, 32)]))


def test_a_source_reads_through_the_workers_call_pool():
    spec = ExecutorSpec(
        (StageSpec("read", "source", _fns.read_range_concurrently, concurrency=6),),
        ordered=True,
    )
    with Executor(spec) as ex:
        out = list(ex.run([(0, 50), (50, 100)]))
    assert [x for x, _ in out] == list(range(100))
    assert len({t for _, t in out}) > 1


def test_outside_a_worker_calls_run_serially_in_order():
    outs = concurrency.current().map(lambda x: 10 // x, [5, 0, 2])
    assert [o.value for o in outs] == [2, None, 5]
    assert isinstance(outs[1].error, ZeroDivisionError)
    pool = CallPool(4, max_width=4)
    try:
        assert [o.value for o in pool.map(lambda x: x * x, range(10))] == [x * x for x in range(10)]
    finally:
        pool.close()


def test_invalid_concurrency_is_rejected_with_the_stage_name():
    with pytest.raises(SpecError, match="'fetch'.*concurrency"):
        StageSpec("fetch", "map", _fns.identity, concurrency=0)
    with pytest.raises(SpecError, match="max_concurrency"):
        StageSpec("fetch", "map", _fns.identity, concurrency=9, max_concurrency=8)
    with Executor(_spec(_fns.identity, 1)) as ex:
        with pytest.raises(SpecError, match="set_concurrency.*'fetch'"):
            ex.set_concurrency("fetch", 17)
        assert list(ex.run([(0, 3)])) == [0, 1, 2]


def test_a_pool_keeps_its_width_in_flight_until_no_call_is_left():
    """A slow call does not hold back the calls after it: the other threads take them."""
    import threading
    import time

    lock, now, peak, order = threading.Lock(), [0], [0], []

    def call(x):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.3 if x == 0 else 0.01)
        with lock:
            now[0] -= 1
            order.append(x)
        return -x

    pool = CallPool(3, max_width=8)
    try:
        outs = pool.map(call, range(12))
        assert [o.value for o in outs] == [-x for x in range(12)]  # results in order
        assert peak[0] == 3  # never more than the width at once
        assert order[-1] == 0 and set(order) == set(range(12))  # 1..11 ran while 0 waited
        threads = {t.name for t in pool._threads}
        pool.map(call, range(3, 6))  # the threads are kept for the next map
        assert {t.name for t in pool._threads} == threads and len(threads) == 3
        assert pool.take_cpu_ns() > 0
    finally:
        pool.close()


def test_a_call_that_raises_systemexit_raises_it_from_map_as_a_serial_call_does():
    def call(x):
        if x == 2:
            raise SystemExit(3)
        return x

    pool = CallPool(4, max_width=4)
    try:
        with pytest.raises(SystemExit):
            pool.map(call, range(5))
        assert [o.value for o in pool.map(call, [0, 1])] == [0, 1]  # the pool still runs
    finally:
        pool.close()


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no schedstat")
def test_a_pool_counts_the_run_queue_delay_of_its_calls_threads():
    """A stage's calls run on the pool's threads: their time runnable but waiting for a CPU is
    counted (one thread sampled per batch) for the worker's run-queue delay, as the worker's
    own thread's is; on a machine whose cores are all taken it is above 0."""
    import subprocess
    import sys
    import time

    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    pool = CallPool(8, max_width=8)
    try:
        end = time.monotonic() + 5.0
        while pool.runq_ns == 0 and time.monotonic() < end:
            pool.map(lambda x: sum(range(20_000)) + x, range(32))
        assert pool.runq_ns > 0
    finally:
        pool.close()
        for p in burners:
            p.kill()
            p.wait()
