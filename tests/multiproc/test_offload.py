"""Offload workers (multiproc.offload): a stage's workers split between local processes and
threads that forward frames to a remote runtime (a thread-based fake one here, no cluster)."""

from __future__ import annotations

import collections
import threading
import time

import pytest

from multiproc import Executor, ExecutorSpec, SpecError, StageSpec
from multiproc.offload import CALL_BYTES_UNIT, CallSums, Offload, call_point

from . import _fns

DEADLINE_S = 30.0


def _spec(fn=_fns.identity, ordered=False, workers=2, remote=1, frame_items=16):
    far = _fns.FakeRemote(fn)
    return ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=frame_items),
            StageSpec(
                "udf", "map", _fns.tag_local, workers=workers, max_workers=6,
                offload=Offload(far, init=far.start, workers=remote, max_workers=4,
                                runtime="fake"),
            ),
        ),
        ordered=ordered,
    )  # fmt: skip


def _poll(what, ok, timeout_s=DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while not (got := ok()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        time.sleep(0.01)  # polling with a deadline
    return got


def _servers() -> int:
    return sum(t.name == _fns.FakeRemote.THREAD for t in threading.enumerate())


@pytest.mark.parametrize("ordered", [False, True])
def test_exactly_once_and_order_while_local_and_remote_counts_move(ordered):
    n = 24_000
    units = [(i, i + 1000) for i in range(0, n, 1000)]
    # (workers, of them remote), one step every 3000 items: both kinds grow and shrink, and
    # the stage runs all local and all remote on the way.
    steps = [(3, 2), (2, 0), (4, 4), (1, 1), (3, 1), (2, 2), (1, 0)]
    got = []
    with Executor(_spec(ordered=ordered)) as ex:
        for i, (x, where) in enumerate(ex.run(units)):
            got.append((x, where))
            if i % 3000 == 1500 and i // 3000 < len(steps):
                w, r = steps[i // 3000]
                ex.resize("udf", w, remote=r)
        _poll("the last split", lambda: ex.snapshot().stage("udf").workers == 1)
        snap = ex.snapshot().stage("udf")
        assert (snap.workers, snap.remote_workers, snap.remotable) == (1, 0, True)
        assert ex.remote_workers("udf") == 0
        # Per-kind counters: the remote part of the totals, retired workers' included.
        remote_items = sum(where == "remote" for _, where in got)
        assert snap.items_out == n and snap.remote_items_out == remote_items
        assert 0 < remote_items < n, "both kinds must have run"
        assert 0 < snap.remote_busy_ns <= snap.busy_ns
        assert snap.calls.n > 0 and snap.calls.sy > 0  # every remote call was reported
    ids = [x for x, _ in got]
    assert collections.Counter(ids) == collections.Counter(range(n))
    if ordered:
        assert ids == list(range(n))
    _poll("every fake server to stop", lambda: _servers() == 0)


def test_a_stage_starts_split_and_reports_its_remote_workers():
    with Executor(_spec(workers=3, remote=2)) as ex:
        snap = _poll("three workers", lambda: ex.snapshot(per_worker=True).stage("udf"))
        assert ex.remote_workers("udf") == 2 and ex.workers("udf") == 3
        assert snap.remote_workers == 2 and snap.workers == 3
        assert sum(w.remote for w in snap.per_worker) == 2
        out = list(ex.run([(0, 500)]))
        assert sorted(x for x, _ in out) == list(range(500))
        # Growing without saying how many are remote keeps the remote count.
        ex.resize("udf", 5)
        _poll("five workers", lambda: ex.snapshot().stage("udf").workers == 5)
        assert ex.snapshot().stage("udf").remote_workers == 2
    _poll("every fake server to stop", lambda: _servers() == 0)


def test_a_raising_offload_function_reaches_the_consumer_with_its_type_and_stage():
    with Executor(_spec(fn=_fns.remote_fail_on_13, workers=1, remote=1)) as ex:
        with pytest.raises(KeyError, match="on the remote side") as info:
            list(ex.run([(0, 64)]))
    assert info.value.stage == "udf"
    _poll("every fake server to stop", lambda: _servers() == 0)


def test_offload_is_checked_at_the_spec_and_at_resize():
    far = _fns.FakeRemote(_fns.identity)
    with pytest.raises(SpecError, match="only map, flat_map and batch_map"):
        StageSpec("read", "source", _fns.read_range, offload=Offload(far))
    with pytest.raises(SpecError, match=r"offload.workers \(2\) > workers \(1\)"):
        StageSpec("udf", "map", _fns.identity, offload=Offload(far, workers=2))
    with pytest.raises(SpecError, match="offload.kind"):
        StageSpec("udf", "map", _fns.identity, offload=Offload(far, kind="stateful"))  # type: ignore[arg-type]
    plain = ExecutorSpec((StageSpec("read", "source", _fns.read_range),
                          StageSpec("udf", "map", _fns.identity)))  # fmt: skip
    with Executor(plain) as ex:
        with pytest.raises(SpecError, match="has no offload"):
            ex.resize("udf", 2, remote=1)
        assert not ex.snapshot().stage("udf").remotable
    with Executor(_spec(workers=2, remote=0)) as ex:
        with pytest.raises(SpecError, match=r"remote must be an int in \[0, 2\]"):
            ex.resize("udf", 2, remote=3)
        with pytest.raises(SpecError, match=r"\[0, 4\]"):  # offload.max_workers
            ex.resize("udf", 6, remote=5)
        assert not ex.fusable()[1]  # a fused group runs on the host


def test_call_sums_fit_the_round_trip_and_the_bandwidth():
    rpc_s, bw = 0.0005, 100e6  # 0.5 ms a call, 100 MB/s
    sums = CallSums()
    for nbytes in (1_000, 50_000, 200_000, 800_000, 3_000_000):
        x, y = call_point(nbytes, int(1e9 * (rpc_s + nbytes / bw)))
        sums = sums + CallSums(1, x, y, x * x, x * y)
    got_rpc, got_bw = sums.fit()
    assert got_rpc == pytest.approx(rpc_s, rel=0.05)
    assert got_bw == pytest.approx(bw, rel=0.05)
    # Calls of one size cannot tell the two apart: all of it is the round trip.
    x, y = call_point(4096, 2_000_000)
    same = CallSums(4, 4 * x, 4 * y, 4 * x * x, 4 * x * y)
    assert same.fit() == (pytest.approx(0.002), 0.0)
    assert CallSums().fit() == (0.0, 0.0) and CALL_BYTES_UNIT > 0
    assert (sums - sums) == CallSums()
