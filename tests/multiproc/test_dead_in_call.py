"""A worker killed inside its function: its call's time stops counting when it goes."""

from __future__ import annotations

import os
import signal
import time

from multiproc import Executor, ExecutorSpec, StageSpec

from . import _fns


def test_a_worker_killed_in_its_call_stops_counting_busy_time(tmp_path):
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=1),
            StageSpec("udf", "map", _fns.SleepOnceOn7(str(tmp_path / "slept")), frame_items=1),
        )
    )
    with Executor(spec) as ex:
        it = ex.run([(0, 16)])
        got = [next(it) for _ in range(7)]  # 0..6; the worker is now asleep in item 7's call
        deadline = time.monotonic() + 10
        while not (tmp_path / "slept").exists():
            assert time.monotonic() < deadline, "item 7's call never started"
            time.sleep(0.01)
        time.sleep(0.1)
        pid = next(w.pid for w in ex.snapshot(per_worker=True).stage("udf").per_worker if w.pid)
        os.kill(pid, signal.SIGKILL)
        got += list(it)  # a new worker runs item 7 again, at once
        assert sorted(got) == list(range(16))
        busy = ex.snapshot().stage("udf").busy_ns
        time.sleep(0.3)
        assert ex.snapshot().stage("udf").busy_ns - busy < 50_000_000  # idle: ~0 ns more
