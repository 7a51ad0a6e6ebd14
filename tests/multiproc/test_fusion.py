"""Fusion: stages run in the previous stage's workers, switched while running."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from multiproc import Batcher, Executor, ExecutorSpec, SpecError, StageSpec

from . import _fns

N = 20_000
UNITS = [(i, i + 500) for i in range(0, N, 500)]


def chain(ordered=False, **kw):
    """read -> +1 -> *2 -> -3 (-> batch): every value tells which functions ran on it."""
    stages = [
        StageSpec("read", "source", _fns.read_range, workers=2, max_workers=3, frame_items=32),
        StageSpec("a", "map", _fns.add_one, workers=2, max_workers=3),
        StageSpec("b", "map", _fns.times_two, workers=1, max_workers=3),
        StageSpec("c", "map", _fns.minus_three, workers=1, max_workers=3, **kw),
    ]
    if ordered:
        stages.append(StageSpec("batch", "stateful", Batcher(100), max_workers=1))
    return ExecutorSpec(tuple(stages), ordered=ordered)


def expected(n=N):
    return sorted((x + 1) * 2 - 3 for x in range(n))


def _wait(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_fused_stages_run_in_their_hosts_workers_and_keep_their_own_counters():
    with Executor(chain()) as ex:
        ex.set_fused("b", True)
        ex.set_fused("c", True)
        assert ex.fused() == (False, False, True, True)
        got = sorted(ex.run(UNITS))
        snap = ex.snapshot()
        _wait(lambda: ex.snapshot().stage("c").workers == 0)
    assert got == expected()
    for name in ("a", "b", "c"):
        assert snap.stage(name).items_in == N, name
        assert snap.stage(name).items_out == N, name
    # b and c ran (almost) entirely in a's workers: their own workers took at most what was
    # queued for them before the switch reached a's workers.
    assert snap.stage("c").busy_ns > 0 and snap.stage("c").cpu_ns > 0


def test_a_source_hosts_the_maps_after_it():
    with Executor(chain()) as ex:
        for name in ("a", "b", "c"):
            ex.set_fused(name, True)
        assert sorted(ex.run(UNITS)) == expected()
        assert ex.snapshot().stage("b").items_in == N


def test_fusion_with_ordered_delivery_keeps_the_order():
    with Executor(chain(ordered=True)) as ex:
        ex.set_fused("b", True)
        ex.set_fused("c", True)
        got = [x for batch in ex.run(UNITS) for x in batch]
    assert got == [(x + 1) * 2 - 3 for x in range(N)]


def test_fuse_and_split_storm_with_killed_workers_delivers_each_item_once():
    """Stages are fused and split at random while items flow and workers are SIGKILLed:
    every item comes out exactly once, with every function applied exactly once."""
    rng = random.Random(7)
    spec = chain()
    with Executor(spec) as ex:
        got = []
        kills = 0
        for k, x in enumerate(ex.run(UNITS)):
            got.append(x)
            if k % 700 == 0:
                for name in ("a", "b", "c"):
                    want = rng.random() < 0.5
                    try:
                        ex.set_fused(name, want)
                    except SpecError:
                        pass  # a chain may not reach that far from its host
            if k % 2_500 == 1_000 and kills < 6:
                pids = [
                    w.pid
                    for w in ex.snapshot(per_worker=True)
                    .stage(rng.choice(["read", "a", "b", "c"]))
                    .per_worker
                    if w.pid
                ]
                if pids:
                    try:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                        kills += 1
                    except ProcessLookupError:
                        pass  # a worker of a fused stage that has just retired
    assert kills > 0
    assert sorted(got) == expected()


def test_an_error_in_a_fused_stage_names_that_stage():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("a", "map", _fns.add_one),
            StageSpec("lookup", "map", _fns.fail_on_13),
        )
    )
    with Executor(spec) as ex:
        ex.set_fused("lookup", True)
        with pytest.raises(KeyError, match="bad id 13") as e:
            list(ex.run([(0, 100)]))
    assert e.value.stage == "lookup"


def test_skips_in_a_fused_stage_count_for_that_stage():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("a", "map", _fns.add_one),
            StageSpec("lookup", "map", _fns.fail_on_13, on_error="skip"),
        )
    )
    with Executor(spec) as ex:
        ex.set_fused("lookup", True)
        got = sorted(ex.run([(0, 100)]))
        snap = ex.snapshot()
    assert got == [x + 1 for x in range(100) if x + 1 != 13]
    assert snap.stage("lookup").errors == 1 and snap.stage("a").errors == 0


def test_stages_that_cannot_fuse_say_why():
    with Executor(chain(ordered=True)) as ex:
        assert ex.fusable() == (False, True, True, True, False)
        with pytest.raises(SpecError, match="stateful"):
            ex.set_fused("batch", True)
        with pytest.raises(SpecError, match="first stage"):
            ex.set_fused("read", True)
        ex.close()


def test_fuse_all_is_the_shape_set_fused_accepts_stage_after_stage():
    from multiproc.fusion import fuse_all
    from multiproc.stats import MAX_FUSED

    assert fuse_all(chain(ordered=True).stages) == (False, True, True, True, False)
    # A host runs at most MAX_FUSED stages after it: the next one hosts the rest.
    maps = [StageSpec(f"m{i}", "map", _fns.add_one) for i in range(MAX_FUSED + 2)]
    long = [StageSpec("read", "source", _fns.read_range), *maps]
    want = (False,) + (True,) * MAX_FUSED + (False, True)
    assert fuse_all(long) == want
    with Executor(chain(ordered=True)) as ex:
        for j, f in enumerate(fuse_all(ex.spec.stages)):
            if f:
                ex.set_fused(j, True)  # accepted one after the other
        assert ex.fused() == (False, True, True, True, False)
        ex.close()


def test_a_split_stage_gets_its_workers_back():
    # Between set_fused(stage, False) and the router giving the stage its workers back, its
    # host's workers still run it: a snapshot then must not report it split with no worker
    # (a tuner stepping on that observation read a stage below its minimum).
    with Executor(chain()) as ex:
        ex.set_fused("c", True)
        it = ex.run(UNITS)
        got = [next(it) for _ in range(2_000)]
        _wait(lambda: ex.snapshot().stage("c").workers == 0)
        ex.set_fused("c", False)
        c = ex.snapshot().stage("c")
        assert c.fused or c.workers >= 1, c
        _wait(lambda: not ex.snapshot().stage("c").fused)
        assert ex.snapshot().stage("c").workers >= 1
        got += list(it)
        assert ex.snapshot().stage("c").workers == 1
    assert sorted(got) == expected()
