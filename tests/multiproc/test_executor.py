from __future__ import annotations

import gc
import os
import random
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from tensordict import TensorDict

from multiproc import (
    Batcher,
    Executor,
    ExecutorSpec,
    Shuffler,
    SpecError,
    StageSpec,
    WorkerDiedError,
    arena,
    serialize,
)

from .._compare import assert_same
from . import _fns

N_IDS = 100_000
UNITS = [(i, i + 1000) for i in range(0, N_IDS, 1000)]


def four_stage(ordered=False, batch_workers=1, **kw):
    return ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, workers=1, max_workers=3, frame_items=128),
            StageSpec("a", "map", _fns.identity, workers=1, max_workers=3),
            StageSpec("b", "map", _fns.identity, workers=1, max_workers=3),
            StageSpec(
                "batch",
                "stateful",
                Batcher(500),
                workers=batch_workers,
                max_workers=3 if not ordered else 1,
            ),
        ),
        ordered=ordered,
        **kw,
    )


def collect_ids(batches):
    ids = []
    for b in batches:
        ids.extend(b)
    return ids


def assert_exactly_once(ids, n=N_IDS):
    arr = np.asarray(ids)
    assert len(arr) == n, f"got {len(arr)} ids, expected {n}"
    assert len(np.unique(arr)) == n, "duplicated ids"
    assert arr.min() == 0 and arr.max() == n - 1


def test_exactly_once_while_resizing():
    stop = threading.Event()
    resizes = []
    with Executor(four_stage()) as ex:
        rng = random.Random(0)

        def resizer():
            while not stop.wait(0.05):
                stage = rng.choice(["read", "a", "b", "batch"])
                n = rng.randint(1, 3)
                ex.resize(stage, n)
                resizes.append((stage, n))

        t = threading.Thread(target=resizer)
        t.start()
        try:
            ids = collect_ids(ex.run(UNITS))
        finally:
            stop.set()
            t.join()
        assert_exactly_once(ids)
        assert len(resizes) >= 3
        snap = ex.snapshot()
        assert snap.stage("read").items_out == N_IDS
        assert snap.delivered_items == snap.stage("batch").items_out


def test_exactly_once_while_workers_are_killed():
    stop = threading.Event()
    killed = []
    with Executor(four_stage(max_restarts=1000)) as ex:
        for s in ("read", "a", "b"):
            ex.resize(s, 2)
        rng = random.Random(1)

        def killer():
            # Ten kills spread over the run: enough to hit every stage kind, bounded so a
            # loaded machine (slow restarts) still finishes in time. The first comes early:
            # on an idle machine the whole run takes about 0.2 s.
            while len(killed) < 10 and not stop.wait(0.2 if killed else 0.02):
                snap = ex.snapshot(per_worker=True)
                pids = [w.pid for s in snap.stages for w in s.per_worker if w.pid > 0]
                if pids:
                    pid = rng.choice(pids)
                    try:
                        psutil.Process(pid).kill()
                        killed.append(pid)
                    except psutil.Error:
                        pass

        t = threading.Thread(target=killer)
        t.start()
        try:
            ids = collect_ids(ex.run(UNITS))
        finally:
            stop.set()
            t.join()
        assert_exactly_once(ids)
        restarts = sum(s.restarts for s in ex.snapshot().stages)
        assert killed and restarts >= 1


_DYING = {
    # A map that kills its process on every item: the error names the stage, the signal, the
    # frame and the limit.
    "map": (
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("killer", "map", _fns.die_on_first),
        ),
        r"stage 'killer'.*SIGKILL.* in its function on .*frame \d+.*max_restarts=2",
    ),
    # A source that crashes its process on one item (a decoder's segfault, say): each death,
    # and the error once they are too many, name the unit it was reading and where in it.
    "source": (
        (StageSpec("read", "source", _fns.read_range_dying_at_13, frame_items=1),),
        r"SIGKILL.* in its function on work unit \(10, 20\), at or after its item 3",
    ),
}


@pytest.mark.parametrize("kind", sorted(_DYING))
def test_too_many_deaths_is_an_error_naming_what_they_died_on(kind):
    stages, pattern = _DYING[kind]
    with (
        Executor(ExecutorSpec(stages, max_restarts=2)) as ex,
        pytest.raises(WorkerDiedError, match=pattern),
    ):
        list(ex.run([(0, 10), (10, 20), (20, 30)]))


def test_udf_exception_reaches_consumer_with_type_stage_and_traceback():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("udf", "map", _fns.fail_on_13, workers=2),
        )
    )
    with Executor(spec) as ex:
        with pytest.raises(KeyError) as info:
            list(ex.run([(0, 100)]))
    err = info.value
    assert err.stage == "udf"
    assert "bad id 13" in str(err)
    assert any("stage 'udf'" in n for n in getattr(err, "__notes__", []))
    assert "fail_on_13" in str(err.__cause__)


def test_skip_mode_counts_bad_items():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("udf", "map", _fns.fail_on_13, on_error="skip"),
        )
    )
    with Executor(spec) as ex:
        out = sorted(ex.run([(0, 100)]))
        assert out == [i for i in range(100) if i != 13]
        assert ex.snapshot().stage("udf").errors == 1


@pytest.mark.parametrize("with_batch", [False, True])
def test_ordered_mode_delivers_in_source_order(with_batch):
    stages = [
        StageSpec("read", "source", _fns.read_range, workers=2, frame_items=7),
        StageSpec("a", "map", _fns.add_one, workers=3),
    ]
    if with_batch:
        stages.append(StageSpec("batch", "stateful", Batcher(10), max_workers=1))
    units = [(i, i + 50) for i in range(0, 2000, 50)]
    with Executor(ExecutorSpec(tuple(stages), ordered=True)) as ex:
        out = list(ex.run(units))
    if with_batch:
        assert all(len(b) == 10 for b in out)
        out = collect_ids(out)
    assert out == list(range(1, 2001))


def test_shuffle_is_a_permutation_and_differs_by_epoch():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("shuffle", "stateful", Shuffler(200, seed=3)),
        )
    )
    with Executor(spec) as ex:
        e0 = list(ex.run([(0, 1000)], epoch=0))
        e1 = list(ex.run([(0, 1000)], epoch=1))
    assert sorted(e0) == list(range(1000)) == sorted(e1)
    assert e0 != list(range(1000)) and e0 != e1


def test_serialize_roundtrip_every_supported_type():
    obj = _fns.make_payload(0)
    obj["td"] = TensorDict(
        {"x": torch.randn(100, 3), "y": {"z": torch.arange(100)}}, batch_size=[100]
    )
    header, bufs = serialize.dumps(obj)
    sizes = serialize.buffer_nbytes(bufs)
    arena = bytearray(sum(sizes))
    serialize.copy_into(memoryview(arena), bufs)
    views, pos = [], 0
    for n in sizes:
        views.append(memoryview(arena)[pos : pos + n])
        pos += n
    out = serialize.loads(header, views)
    td = out.pop("td")
    assert (td == obj.pop("td")).all()
    assert_same(obj, out)
    # Zero copy: the rebuilt tensor lives in the arena.
    base = np.frombuffer(arena, dtype=np.uint8).ctypes.data
    assert base <= out["f32"].data_ptr() < base + len(arena)


def test_payloads_through_processes():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=1),
            StageSpec("make", "map", _fns.make_payload, workers=2),
        ),
        ordered=True,
    )
    with Executor(spec) as ex:
        outs = list(ex.run([(0, 6)]))
    for seed, out in enumerate(outs):
        assert_same(_fns.make_payload(seed), out)


def test_small_budget_backpressure_and_set_budget():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=4),
            StageSpec(
                "big",
                "map",
                _fns.big_tensor,
                workers=2,
                buffer_bytes=1 << 20,
                max_buffer_bytes=8 << 20,
            ),
        ),
        ordered=True,
    )
    with Executor(spec) as ex:
        got = []
        for i, x in enumerate(ex.run([(0, 200)])):
            assert x["id"] == i and float(x["payload"][0]) == float(i)
            got.append(x["id"])
            if i == 50:
                ex.set_budget("big", 4 << 20)
        assert got == list(range(200))
        assert ex.budget("big") == 4 << 20


def _queue_in_front_of_a_slow_stage(budget: int) -> list[int]:
    """Frames queued for a slow stage, sampled while a fast source of 16-int frames feeds it."""
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=16, buffer_bytes=budget),
            StageSpec("slow", "map", _fns.slow_identity),
        ),
    )
    with Executor(spec) as ex:
        it = ex.run([(i, i + 16) for i in range(0, 200_000, 16)])
        queued = []
        for k, _ in enumerate(it):
            if k % 50 == 0:
                queued.append(ex.snapshot().stage("slow").queued_frames)
            if k == 800:
                break
    return queued


def test_small_frames_are_held_back_by_the_budget_too():
    """Frames small enough to travel inline (no arena bytes) must not pile up without bound
    in front of a slower stage: the producer gets no new work past its stage's budget."""
    queued = _queue_in_front_of_a_slow_stage(64 << 10)
    # A 16-int frame pickles to about 64 bytes, so 64 KiB holds some 1,000 of them. Unchecked,
    # the source queues all 12,500 frames while the slow stage takes 800 items (the queue grows
    # at every sample); checked, it levels off at the budget (or the frame cap below it).
    half = len(queued) // 2
    assert max(queued[half:]) <= max(queued[:half]) + 8, queued
    assert max(queued) < 1_500, queued


def test_tiny_frames_are_held_back_by_count_under_a_large_budget():
    """Under a byte budget that holds tens of thousands of tiny frames, the queue in front of
    a slower stage stops at MAX_INLINE_FRAMES frames instead (seconds, not minutes, of work)."""
    from multiproc.frames import MAX_INLINE_FRAMES

    queued = _queue_in_front_of_a_slow_stage(64 << 20)
    assert MAX_INLINE_FRAMES // 2 < max(queued) <= MAX_INLINE_FRAMES + 8, queued


@pytest.mark.parametrize("budget", [64 << 10, 64 << 20])
def test_a_paused_consumer_resumes_a_stage_held_back_by_small_frames(budget):
    """The last stage waits for room in the consumer's queue (its byte budget, or the frame
    count for a large budget); taking items must wake it."""
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=16, buffer_bytes=budget),
            StageSpec("last", "map", _fns.identity, buffer_bytes=budget, frame_items=16),
        ),
    )
    units = [(i, i + 1000) for i in range(0, 40_000, 1000)]
    with Executor(spec) as ex:
        it = ex.run(units)
        first = next(it)
        time.sleep(1.0)  # both stages fill their budgets and stop getting work
        got = [first, *it]
    assert sorted(got) == list(range(40_000))


def test_consumer_may_keep_every_item():
    """Holding every batch (list(loader)) must not deadlock a small arena: frames spill."""
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=2),
            StageSpec("big", "map", _fns.big_tensor, buffer_bytes=1 << 20),
        )
    )
    with Executor(spec) as ex:
        kept = list(ex.run([(0, 100)]))
        assert sorted(x["id"] for x in kept) == list(range(100))
        assert ex.snapshot().stage("big").spilled > 0


def test_thread_workers():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, worker_type="thread"),
            StageSpec("a", "map", _fns.add_one, workers=2, worker_type="thread"),
        )
    )
    with Executor(spec) as ex:
        assert sorted(ex.run([(0, 500)])) == list(range(1, 501))


def test_lambdas_pickle_with_process_workers():
    spec = ExecutorSpec(
        (StageSpec("read", "source", lambda u: range(u)), StageSpec("sq", "map", lambda x: x * x))
    )
    with Executor(spec) as ex:
        assert sorted(ex.run([5])) == [0, 1, 4, 9, 16]


def _spec():
    return ExecutorSpec(
        (StageSpec("read", "source", _fns.read_range), StageSpec("a", "map", _fns.identity))
    )


@pytest.mark.parametrize(
    "how",
    ["exhaust", "close", "context", "break", "consumer_exception", "gc", "keyboard_interrupt"],
)
def test_every_way_of_ending_cleans_up(how):
    if how == "exhaust":
        ex = Executor(_spec())
        assert len(list(ex.run([(0, 100)]))) == 100
        ex.close()
    elif how == "close":
        ex = Executor(_spec())
        it = ex.run([(0, 10_000)])
        next(it)
        ex.close()
    elif how == "context":
        with Executor(_spec()) as ex:
            next(iter(ex.run([(0, 10_000)])))
    elif how == "break":
        ex = Executor(_spec())
        for _ in ex.run([(0, 10_000)]):
            break
        ex.close()
    elif how == "consumer_exception":
        with pytest.raises(RuntimeError, match="model blew up"), Executor(_spec()) as ex:
            for _ in ex.run([(0, 10_000)]):
                raise RuntimeError("model blew up")
    elif how == "gc":
        ex = Executor(_spec())
        next(iter(ex.run([(0, 10_000)])))
        del ex
        gc.collect()
    elif how == "keyboard_interrupt":
        with pytest.raises(KeyboardInterrupt), Executor(_spec()) as ex:
            for _ in ex.run([(0, 10_000)]):
                raise KeyboardInterrupt
    # the autouse fixture checks children and /dev/shm; also check the 2 s promise here
    t0 = time.monotonic()
    while psutil.Process().children() and time.monotonic() - t0 < 2.0:
        kids = [
            c
            for c in psutil.Process().children()
            if "forkserver" not in " ".join(c.cmdline())
            and "resource_tracker" not in " ".join(c.cmdline())
        ]
        if not kids:
            break
        time.sleep(0.02)


def test_invalid_specs_are_rejected_with_clear_messages():
    with pytest.raises(SpecError, match="stage 'x': workers must be a positive int, got 0"):
        StageSpec("x", "map", _fns.identity, workers=0)
    with pytest.raises(SpecError, match="stage 'x': kind must be one of"):
        StageSpec("x", "mapp", _fns.identity)
    with pytest.raises(SpecError, match="stage 'x': fn must be callable"):
        StageSpec("x", "map", 3)
    with pytest.raises(SpecError, match="min_workers <= workers <= max_workers"):
        StageSpec("x", "map", _fns.identity, workers=5, max_workers=2)
    with pytest.raises(SpecError, match="buffer_bytes must be an int >= 64 KiB"):
        StageSpec("x", "map", _fns.identity, buffer_bytes=10)
    with pytest.raises(SpecError, match="first stage must have kind 'source'"):
        ExecutorSpec((StageSpec("x", "map", _fns.identity),))
    with pytest.raises(SpecError, match="duplicate stage name"):
        ExecutorSpec(
            (StageSpec("x", "source", _fns.read_range), StageSpec("x", "map", _fns.identity))
        )
    with pytest.raises(SpecError, match="ordered=True needs stateful stages with max_workers=1"):
        ExecutorSpec(
            (
                StageSpec("r", "source", _fns.read_range),
                StageSpec("b", "stateful", Batcher(2), max_workers=2),
            ),
            ordered=True,
        )
    with Executor(_spec()) as ex:
        with pytest.raises(
            SpecError, match=r"resize\(\): stage 'a': n must be in \[1, 64\], got 0"
        ):
            ex.resize("a", 0)
        with pytest.raises(SpecError, match="no stage 'zz'"):
            ex.resize("zz", 2)
        with pytest.raises(SpecError, match="set_budget"):
            ex.set_budget("a", 5)


def test_unpicklable_function_names_the_stage():
    lock = threading.Lock()

    def uses_lock(x):
        with lock:
            return x

    stages = (StageSpec("r", "source", _fns.read_range), StageSpec("locky", "map", uses_lock))
    # Spawned workers get it by pickle: the error names the stage and what does not pickle.
    with pytest.raises(
        SpecError,
        match=r"stage 'locky': its function does not pickle at fn\.<closure lock> \(_thread\.lock\)",
    ):
        Executor(ExecutorSpec(stages, start_method="spawn"))
    # Forked workers inherit it, as a forked torch DataLoader worker does.
    with Executor(ExecutorSpec(stages)) as ex:
        assert sorted(ex.run([(0, 5)])) == [0, 1, 2, 3, 4]


def test_allocator_reuses_and_coalesces():
    a = arena.Allocator(1 << 16, 1 << 16)
    offs = [a.alloc(1000) for _ in range(10)]
    assert None not in offs and len(set(offs)) == 10
    for o in offs[::2]:
        a.free(o)
    for o in offs[1::2]:
        a.free(o)
    assert a.used == 0 and a.alloc(1 << 16) == 0


def test_oversized_frames_between_stages_do_not_deadlock():
    """Frames larger than a worker's whole budget travel inline through the router. Its sends
    to a worker must never block: that worker may itself be blocked sending to the router."""
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=1),
            StageSpec("big", "map", _fns.two_mb, workers=2, buffer_bytes=64 * 1024),
            StageSpec("same", "map", _fns.identity, workers=2, buffer_bytes=64 * 1024),
        ),
        ordered=True,
    )
    with Executor(spec) as ex:
        out = [x["id"] for x in ex.run([(0, 60)])]
        assert out == list(range(60))
        assert ex.snapshot().stage("same").spilled == 60


def test_segments_of_dead_processes_are_swept(tmp_path):
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = f"ttp_{proc.pid}_0_dead_w0"
    with open(os.path.join(arena.SHM_DIR, stale), "wb") as f:
        f.write(b"x")
    mine = f"ttp_{os.getpid()}_sweeptest_w0"
    with open(os.path.join(arena.SHM_DIR, mine), "wb") as f:
        f.write(b"x")
    try:
        removed = arena.sweep_stale_segments()
        assert stale in removed and mine not in removed
        assert not os.path.exists(os.path.join(arena.SHM_DIR, stale))
    finally:
        os.unlink(os.path.join(arena.SHM_DIR, mine))


@pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel exports no schedstat"
)
def test_workers_report_the_time_they_waited_for_a_cpu():
    # More CPU-burning workers than cores: the kernel's run queue holds some of them while
    # the others run, and the snapshot counts that wait (which busy time alone cannot tell
    # from work or I/O).
    n = len(os.sched_getaffinity(0)) + 2
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=4),
            StageSpec("burn", "map", _fns.burn_2ms, workers=n, max_workers=n, frame_items=4),
        )
    )
    with Executor(spec) as ex:
        got = sum(1 for _ in ex.run([(i, i + 40) for i in range(0, 1600, 40)]))
        snap = ex.snapshot(per_worker=True)
    assert got == 1600
    burn = snap.stage("burn")
    assert burn.runq_ns > 0
    assert burn.runq_ns == sum(w.runq_ns for w in burn.per_worker)
    assert burn.runq_ns < burn.worker_ns
