"""close() after a storm of resizes and SIGKILLed workers leaves no process and no segment."""

from __future__ import annotations

import os
import random
import signal
import time

import psutil
import pytest

from multiproc import Executor, ExecutorSpec, StageSpec, arena

from .. import _subproc
from . import _fns

UNITS = [(i * 500, (i + 1) * 500) for i in range(12)]


def _parents(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            out.add(psutil.Process(pid).ppid())
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
def test_close_after_a_resize_and_kill_storm_reaps_every_process_and_segment():
    rng = random.Random(11)
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, workers=2, max_workers=4),
            StageSpec("a", "map", _fns.add_one, workers=2, max_workers=4),
            StageSpec("b", "map", _fns.add_one, workers=2, max_workers=4),
            StageSpec("c", "map", _fns.add_one, workers=2, max_workers=4),
        )
    )
    ex = Executor(spec)
    prefix = f"ttp_{ex._tag}_"
    seen: set[int] = set()  # every worker and server of the executor
    kills = 0
    try:
        for epoch in range(2):
            got = 0
            for k, _ in enumerate(ex.run(UNITS, epoch)):
                got += 1
                seen |= {h.pid for h in ex._state.workers.values() if h.pid and not h.thread}
                if k % 150 == 0:
                    ex.resize(rng.choice(["read", "a", "b", "c"]), rng.randint(1, 4))
                if k % 250 == 100 and kills < 12:
                    pids = [h.pid for h in ex._state.workers.values() if h.pid and h.alive()]
                    try:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                        kills += 1
                    except ProcessLookupError:
                        pass
            assert got == 6_000
        # The storm goes on through the close: resizes in flight, a worker just killed.
        ex.resize("a", 4)
        ex.resize("b", 1)
        victim = next(h.pid for h in ex._state.workers.values() if h.pid and h.alive())
        os.kill(victim, signal.SIGKILL)
    finally:
        # This executor's: its workers and their fork server (not the session's other servers).
        seen |= {h.pid for h in ex._state.workers.values() if h.pid and not h.thread}
        seen |= {p.pid for p in psutil.Process().children() if p.pid in _parents(seen)}
        t0 = time.monotonic()
        ex.close()
    assert kills >= 10
    left, _ = _subproc.wait_gone(seen, os.getpid(), max(0.0, 5 - (time.monotonic() - t0)))
    assert not left, f"still running 5 s after close: {left}"
    assert not [n for n in os.listdir(arena.SHM_DIR) if n.startswith(prefix)]
