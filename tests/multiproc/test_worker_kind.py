"""A stage's local workers moved between processes and threads of this process while an epoch
runs (``Executor.resize(stage, n, threads=t)``): every item once, in order where ordered,
fused chains and reducers included; the mix reported; what does not pickle works on both."""

from __future__ import annotations

import collections
import os
import re
import threading

import cloudpickle
import pytest

from multiproc import Batcher, Executor, ExecutorSpec, SpecError, StageError, StageSpec

from . import _fns
from .test_offload import _poll

ME = os.getpid()


def tag_pid(x):
    """The item and the process that ran it (this one: a thread worker)."""
    return (x, os.getpid())


def tag_pid_padded(x):
    """:func:`tag_pid` with 2 KiB of padding: frames that fill a 64 KiB budget in a few, so
    the stage runs at most a few frames ahead of the consumer, whose items tell how far it
    got."""
    return (x, os.getpid(), bytes(2048))


def times_two_tagged(item):
    """Fused after :func:`tag_pid_padded`: runs in the same worker, so the same process."""
    x, pid, pad = item
    return (x * 2, pid, os.getpid(), pad)


class NeedsTwoArgs(Exception):
    """An exception that does not unpickle (its ``__init__`` wants two arguments)."""

    def __init__(self, a, b):
        super().__init__(f"{a} {b}")


def raise_unpicklable_on_13(x):
    if x == 13:
        raise NeedsTwoArgs("bad", x)
    return x


class ReadsOpenFile:
    """A stage function holding an open file (which does not pickle): item ``i`` is the
    file's byte ``i``, read with ``pread`` (safe across forked processes and threads)."""

    def __init__(self, path):
        self.f = open(path, "rb")  # noqa: SIM115 - held for the stage's life

    def __call__(self, i):
        return os.pread(self.f.fileno(), 1, i)[0]


def _worker_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("multiproc-worker-")}


@pytest.fixture(autouse=True)
def no_worker_threads_left():
    """Every thread worker a test started is gone once its executor closed (the suite's
    fixture checks processes and segments)."""
    before = _worker_threads()
    yield
    _poll("thread workers to end", lambda: not (_worker_threads() - before))


def _settled(ex, stage, workers, threads):
    """Whether the stage runs ``workers``, ``threads`` of them threads, with nothing retiring."""
    snap = ex.snapshot(per_worker=True).stage(stage)
    alive = [w for w in snap.per_worker if w.slot >= 0]
    return snap.workers == workers and snap.threads == threads and len(alive) == workers


# (workers, of them threads) of "udf", one step every STEP items: all processes, all threads,
# mixed, and back.
MOVES = [(2, 2), (3, 1), (2, 0), (1, 1), (3, 3), (2, 0)]
STEP = 800
N = STEP * (len(MOVES) + 1)


def _chain(ordered, fused):
    small = {"buffer_bytes": 64 * 1024, "worker_type": "auto"}
    stages = [
        StageSpec("read", "source", _fns.read_range, frame_items=16),
        StageSpec("udf", "map", tag_pid_padded, workers=2, max_workers=4, **small),
    ]
    if fused:
        stages.append(StageSpec("post", "map", times_two_tagged, fused=True, **small))
    stages.append(StageSpec("batch", "stateful", Batcher(50), max_workers=1, **small))
    return ExecutorSpec(tuple(stages), ordered=ordered)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_moving_workers_between_kinds_mid_epoch_delivers_each_item_once(ordered, fused):
    units = [(i, i + 400) for i in range(0, N, 400)]
    got = []
    with Executor(_chain(ordered, fused)) as ex:
        for i, x in enumerate(y for batch in ex.run(units) for y in batch):
            got.append(x)
            if i % STEP == STEP // 2 and i // STEP < len(MOVES):
                n, t = MOVES[i // STEP]
                ex.resize("udf", n, threads=t)
                # The reducer too: one worker, moved to a thread and back (its held items are
                # handed over, in order when ordered).
                ex.resize("batch", 1, threads=(i // STEP) % 2)
        assert ex.threads("udf") == 0 and ex.threads("batch") == 1
        snap = ex.snapshot()
        udf = snap.stage("udf")
        assert udf.items_out == N and 0 < udf.thread_items_out < N
        assert 0 < udf.thread_cpu_ns <= udf.cpu_ns
        if fused:
            assert snap.stage("post").items_out == N
    ids = [x[0] // 2 if fused else x[0] for x in got]
    assert collections.Counter(ids) == collections.Counter(range(N))
    if ordered:
        assert ids == list(range(N))
    pids = collections.Counter(x[1] == ME for x in got)
    assert pids[True] and pids[False], "both kinds must have run"
    if fused:
        # The fused function runs in its host's worker, whatever its kind.
        assert all(x[1] == x[2] for x in got)


def test_threads_and_the_snapshot_report_the_mix():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("udf", "map", tag_pid, workers=3, max_workers=6, worker_type="auto"),
        )
    )
    with Executor(spec) as ex:
        assert ex.threads("udf") == 0  # auto starts as processes
        ex.resize("udf", 3, threads=2)
        _poll("two threads of three workers", lambda: _settled(ex, "udf", 3, 2))
        assert ex.threads("udf") == 2 and ex.workers("udf") == 3
        rows = [w for w in ex.snapshot(per_worker=True).stage("udf").per_worker if w.slot >= 0]
        # A thread worker is this process (its memory no worker process's); a process is not.
        assert sorted((w.thread, w.pid == ME) for w in rows) == [
            (False, False), (True, True), (True, True),
        ]  # fmt: skip
        assert sorted(x for x, _ in ex.run([(0, 2000)])) == list(range(2000))
        # Grown without saying how many threads: the threads stay, processes take the rest.
        ex.resize("udf", 5)
        _poll("two threads of five workers", lambda: _settled(ex, "udf", 5, 2))
        assert ex.threads("udf") == 2
        # Shrunk below them: at most the local count.
        ex.resize("udf", 1)
        _poll("one thread", lambda: _settled(ex, "udf", 1, 1))
        assert ex.threads("udf") == 1
        snap = ex.snapshot().stage("udf")
        assert 0 < snap.thread_items_in <= snap.items_in
        assert 0 < snap.thread_busy_ns <= snap.busy_ns
        with pytest.raises(SpecError, match=r"threads must be an int in \[0, 2\]"):
            ex.resize("udf", 2, threads=3)
        with pytest.raises(SpecError, match="threads must be an int"):
            ex.resize("udf", 2, threads=True)


def test_a_thread_stage_stays_threads_as_it_grows_and_moves_to_processes_when_asked():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("udf", "map", tag_pid, workers=1, max_workers=4, worker_type="thread"),
        )
    )
    with Executor(spec) as ex:
        assert ex.threads("udf") == 1
        ex.resize("udf", 3)
        _poll("three threads", lambda: _settled(ex, "udf", 3, 3))
        assert ex.threads("udf") == 3
        ex.resize("udf", 2, threads=0)
        _poll("two processes", lambda: _settled(ex, "udf", 2, 0))
        got = list(ex.run([(0, 1000)]))
        assert sorted(x for x, _ in got) == list(range(1000))
        assert all(pid != ME for _, pid in got)


def test_worker_type_is_checked():
    with pytest.raises(SpecError, match="worker_type must be 'process', 'thread' or 'auto'"):
        StageSpec("udf", "map", _fns.identity, worker_type="fiber")  # type: ignore[arg-type]


def test_an_auto_stage_over_an_open_file_runs_on_processes_and_threads(tmp_path):
    data = bytes(range(256)) * 8
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    fn = ReadsOpenFile(path)
    with pytest.raises(TypeError):
        cloudpickle.dumps(fn)  # the premise: no by-value pickle of it
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=32),
            StageSpec("udf", "map", fn, workers=2, max_workers=4, worker_type="auto"),
        ),
        ordered=True,
    )
    n = len(data)
    with Executor(spec) as ex:
        assert list(ex.run([(0, n)])) == list(data)  # processes (forked: inherited)
        ex.resize("udf", 2, threads=2)
        _poll("two threads", lambda: _settled(ex, "udf", 2, 2))
        assert list(ex.run([(0, n)], epoch=1)) == list(data)  # threads (this process's fn)
        ex.resize("udf", 3, threads=1)  # processes started after the move: the snapshot's
        _poll("a mix", lambda: _settled(ex, "udf", 3, 1))
        assert list(ex.run([(0, n)], epoch=2)) == list(data)
    assert not fn.f.closed  # a thread worker's end does not touch this process's function
    fn.f.close()


def _error(fn, threads):
    """What the consumer gets from a run through a stage of ``fn`` on a process or a thread."""
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("udf", "map", fn, worker_type="auto"),
        )
    )
    with Executor(spec) as ex:
        if threads:
            ex.resize("udf", 1, threads=1)
            _poll("a thread", lambda: _settled(ex, "udf", 1, 1))
        with pytest.raises(Exception) as info:
            list(ex.run([(0, 100)]))
    e = info.value
    text, *notes = (
        re.sub(r"worker \d+ \(pid \d+\)", "worker W", t) for t in [str(e), *e.__notes__]
    )
    return type(e), text, e.stage, notes, e.__cause__ is not None


@pytest.mark.parametrize("fn", [_fns.fail_on_13, raise_unpicklable_on_13], ids=["own", "stage"])
def test_a_raising_thread_worker_reports_what_a_process_worker_does(fn):
    on_process, on_thread = _error(fn, threads=False), _error(fn, threads=True)
    assert on_thread == on_process
    kind, text, stage, notes, has_tb = on_thread
    assert stage == "udf" and has_tb and "item 13" in notes[0]
    if fn is raise_unpicklable_on_13:
        assert kind is StageError and "NeedsTwoArgs: bad 13" in text
    else:
        assert kind is KeyError


def test_closing_mid_epoch_with_both_kinds_leaves_nothing_behind():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, worker_type="auto"),
            StageSpec("udf", "map", _fns.slow_identity, workers=2, max_workers=4,
                      worker_type="auto"),
        )
    )  # fmt: skip
    ex = Executor(spec)
    it = ex.run([(i, i + 100) for i in range(0, 10_000, 100)])
    for i, _ in enumerate(it):
        if i == 50:
            ex.resize("udf", 4, threads=2)
            ex.resize("read", 1, threads=1)
        if i == 300:
            break
    it.close()  # an iterator closed early closes its executor
    ex.close()


def test_an_auto_stage_may_start_on_threads_and_move_to_processes():
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range),
            StageSpec("udf", "map", tag_pid, workers=2, max_workers=4, worker_type="auto",
                      start_threads=True),
        )
    )  # fmt: skip
    with Executor(spec) as ex:
        assert ex.threads("udf") == 2  # started on threads: no worker process for it
        got = list(ex.run([(0, 500)]))
        assert sorted(x for x, _ in got) == list(range(500))
        assert {pid for _, pid in got} == {ME}
        ex.resize("udf", 3)  # grown without saying: the kind it started on takes the rest
        _poll("three threads", lambda: _settled(ex, "udf", 3, 3))
        ex.resize("udf", 2, threads=0)
        _poll("two processes", lambda: _settled(ex, "udf", 2, 0))
        got = list(ex.run([(0, 500)]))
        assert sorted(x for x, _ in got) == list(range(500))
        assert all(pid != ME for _, pid in got)


def test_start_threads_is_for_auto_stages_only():
    with pytest.raises(SpecError, match="start_threads is for worker_type='auto' stages"):
        StageSpec("udf", "map", _fns.identity, start_threads=True)


def torch_threads_here(x):
    """The item and the torch intra-op threads of the thread that ran it."""
    import torch

    return (x, torch.get_num_threads())


@pytest.mark.parametrize("calls", [1, 4], ids=["one-call", "calls-in-flight"])
def test_thread_workers_run_with_their_stage_torch_threads_not_the_consumers(calls):
    import torch

    from multiproc import intraop

    if not intraop.per_thread():
        pytest.skip("torch's intra-op thread count is the whole process's on this build")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        spec = ExecutorSpec(
            (
                StageSpec("read", "source", _fns.read_range),
                StageSpec("udf", "map", torch_threads_here, workers=2, worker_type="thread",
                          concurrency=calls, max_concurrency=4),
            )
        )  # fmt: skip
        with Executor(spec) as ex:
            got = list(ex.run([(0, 300)]))
        assert sorted(x for x, _ in got) == list(range(300))
        assert {n for _, n in got} == {1}  # StageSpec.torch_threads, on every thread
        assert torch.get_num_threads() == 2  # the consumer's own count is left alone
    finally:
        torch.set_num_threads(before)
