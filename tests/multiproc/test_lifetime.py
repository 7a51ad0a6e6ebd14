"""The executor's lifetime tied to its owner: killed, interrupted while starting, exiting
without close(), or just dropped, it leaves no process and no shared-memory segment."""

from __future__ import annotations

import gc
import signal
import time

import psutil
import pytest

from multiproc import Executor, ExecutorSpec, StageSpec

from .. import _subproc
from . import _fns

_BUSY = """
import sys, time
from multiproc import Executor, ExecutorSpec, StageSpec

def read(unit):
    yield from range(*unit)

def spin(x):
    while True:  # a UDF that never returns (and never reads its pipe)
        pass

ex = Executor(ExecutorSpec((StageSpec("read", "source", read, workers=2),
                            StageSpec("udf", "map", spin, workers=2))))
it = ex.run([(0, 100), (100, 200)])
deadline = time.monotonic() + 20
while ex.snapshot().stage("udf").items_in == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
import multiprocessing.resource_tracker as rt
assert rt._resource_tracker._pid is None, "the fork server sweeps: no resource tracker"
print("ready", flush=True)
next(it)
"""


_THREADS = """
import time
import multiprocessing.resource_tracker as rt
from multiproc import Executor, ExecutorSpec, StageSpec

def read(unit):
    yield from range(*unit)

ex = Executor(ExecutorSpec((StageSpec("read", "source", read, worker_type="thread"),
                            StageSpec("m", "map", abs, worker_type="thread"))))
it = ex.run([(0, 100)])
next(it)
assert rt._resource_tracker._pid is not None, "no fork server: the tracker sweeps"
print("ready", flush=True)
time.sleep(60)
"""


def test_killed_owner_of_thread_workers_leaves_no_segment():
    """No fork server runs (thread workers only): the resource tracker unlinks the segments."""
    _, err, left, segs = _subproc.leftovers(_THREADS, "ready", signal.SIGKILL)
    assert not left, left
    assert not segs, f"segments left 5 s after SIGKILL: {sorted(segs)}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_owner_leaves_no_process_and_no_segment(sig):
    """Killed while a UDF spins: the workers and the fork server end, and the fork server
    unlinks every segment (no resource tracker runs), with no other executor starting."""
    _, err, left, segs = _subproc.leftovers(_BUSY, "ready", sig)
    assert not left, f"still running 5 s after {sig.name}: {left}"
    assert not segs, f"segments left 5 s after {sig.name}: {sorted(segs)}"


_STARTING = """
import sys
from multiproc import Executor, ExecutorSpec, StageSpec

def read(unit):
    yield from range(*unit)

spec = ExecutorSpec((StageSpec("read", "source", read, workers=3),
                     StageSpec("a", "map", abs, workers=3),
                     StageSpec("b", "map", abs, workers=3)))
print("go", flush=True)
while True:
    Executor(spec).close()
"""


@pytest.mark.parametrize("delay_s", [0.3, 0.7])
def test_ctrl_c_while_starting_releases_everything(delay_s):
    """SIGINT lands in Executor() (which starts nine workers) or in close(): the owner exits
    with KeyboardInterrupt and nothing else, and leaves nothing behind."""
    p = _subproc.start(_STARTING)
    pids: set[int] = set()
    try:
        assert p.stdout.readline().strip() == "go", p.stderr.read()
        deadline = time.monotonic() + delay_s
        while time.monotonic() < deadline:  # the tree changes as executors come and go
            pids |= _subproc.tree(p.pid)
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=20)
        assert "KeyboardInterrupt" in err, err
        for noise in ("Exception ignored", "AttributeError", "leaked"):
            assert noise not in err, err
        left, segs = _subproc.wait_gone(pids, p.pid, within_s=5.0)
        assert not left and not segs, (left, segs)
    finally:
        _subproc.cleanup(pids | {p.pid}, p.pid)


_NO_CLOSE = """
from multiproc import Executor, ExecutorSpec, StageSpec

def read(unit):
    yield from range(*unit)

ex = Executor(ExecutorSpec((StageSpec("read", "source", read, workers=2),
                            StageSpec("a", "map", abs, workers=2))))
assert sorted(ex.run([(0, 500), (500, 1000)])) == list(range(1000))
it = ex.run([(0, 500)])
next(it)  # a run left half-way, never closed
print("done", flush=True)
"""


def test_exit_without_close_is_silent_and_clean():
    code, err, left, segs = _subproc.leftovers(_NO_CLOSE, "done")
    assert code == 0 and err == "", err
    assert not left and not segs, (left, segs)


def test_an_unreferenced_executor_stops_its_workers():
    ex = Executor(
        ExecutorSpec(
            (
                StageSpec("read", "source", _fns.read_range, workers=2),
                StageSpec("a", "map", _fns.identity, workers=2),
            )
        )
    )
    items = list(ex.run([(0, 100), (100, 200)]))
    assert sorted(items) == list(range(200))
    pids = {w.pid for s in ex.snapshot(per_worker=True).stages for w in s.per_worker}
    gc.disable()  # no collector: dropping the last reference must be enough
    try:
        del ex
        gone, alive = psutil.wait_procs(_subproc.processes(pids), timeout=5)
        assert not alive, f"workers of a dropped executor still run: {alive}"
    finally:
        gc.enable()


_SERVER = """
import os, select, sys
import xml.dom.minidom  # imported by this process only, after startup
from multiproc import Executor, ExecutorSpec, StageSpec
from multiproc import handles

def read(unit):
    yield from range(*unit)

def imported(x):
    return "xml.dom.minidom" in sys.modules

r, w = os.pipe()  # a pipe of this process's: the server must not keep its write end open
with Executor(ExecutorSpec((StageSpec("read", "source", read, workers=1),
                            StageSpec("check", "map", imported, workers=1)))) as ex:
    os.close(w)
    # EOF once nobody holds the write end (the server lets go of its copy just after the fork).
    eof = bool(select.select([r], [], [], 20)[0]) and os.read(r, 1) == b""
    print(set(ex.run([(0, 3)])), eof, flush=True)
"""


# A process that has imported Ray, as far as the server's choice sees it.
_RAY = "import sys, types; sys.modules['ray'] = types.ModuleType('ray')\n"


@pytest.mark.parametrize(
    "mode, inherits", [("", True), ("spawn", False), ("ray", False)], ids=["fork", "spawn", "ray"]
)
def test_the_fork_server_is_forked_from_its_owner_and_holds_none_of_its_files(mode, inherits):
    # Forked (the default), the server and its workers have what this process imported
    # (nothing to import again, pages shared); MULTIPROC_FORKSERVER=spawn starts a clean one,
    # and so does a process that imported Ray (its gRPC threads do not survive a fork).
    env = "" if mode != "ray" else _RAY
    env += f"import os; os.environ['MULTIPROC_FORKSERVER'] = {'' if mode == 'ray' else mode!r}\n"
    result = _subproc.run(env + _SERVER)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"{{{inherits}}}", "True"], result.stdout


def test_a_worker_lets_go_of_its_stages_pickle_once_it_runs():
    # A stage's pickle holds what its function holds (a map-style dataset's tensors): kept
    # alive (by the process object, or the run() frame that called the worker with it), it
    # would double the worker's memory for its whole life. A snapshot's worker inherits the
    # function: none of it is the worker's own.
    for method, private in (("spawn", 1), ("fork", 0)):
        spec = ExecutorSpec(
            (StageSpec("read", "source", _fns.read_range), StageSpec("m", "map", _fns.BigBuffers(48))),
            start_method=method,
        )  # fmt: skip
        with Executor(spec) as ex:
            assert set(ex.run([(0, 4)])) == {private}, method


def _ignores(pid: int, sig: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (sig - 1) & 1)


def test_the_fork_server_ignores_sigterm_and_its_workers_do_not():
    """The server outlives a SIGTERM sent to the whole group, to sweep the segments once the
    owner is gone; a worker must still die of one."""
    spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range, workers=1),))
    with Executor(spec) as ex:
        assert list(ex.run([(0, 3)])) == [0, 1, 2]
        worker = next(h.pid for h in ex._state.workers.values() if not h.thread)
        assert not _ignores(worker, signal.SIGTERM)
        assert _ignores(ex._snapshot.server.pid, signal.SIGTERM)


_IMPORTING = """
import os, sys, tempfile, threading, time
from multiproc import Executor, ExecutorSpec, StageSpec

d = tempfile.mkdtemp()
with open(os.path.join(d, "slow_module.py"), "w") as f:
    f.write("import threading, time\\n"
            "if threading.current_thread().name == 'importer':\\n"
            "    time.sleep(0.5)  # still being imported when the fork server is forked\\n"
            "VALUE = 7\\n")
sys.path.insert(0, d)
importer = threading.Thread(target=__import__, args=("slow_module",), name="importer")
importer.start()
while "slow_module" not in sys.modules:
    time.sleep(0.001)

def read(unit):
    import slow_module
    yield from (x * slow_module.VALUE for x in range(*unit))

with Executor(ExecutorSpec((StageSpec("read", "source", read, workers=2),))) as ex:
    print(sorted(ex.run([(0, 3), (3, 6)])), flush=True)
importer.join()
"""


@pytest.mark.parametrize("wait_s", [None, 0.0])
def test_a_module_another_thread_is_importing_does_not_hang_the_workers(wait_s):
    """The fork server is forked while another thread is inside an import: a worker that
    imports that module must get it whole, not wait for a lock no thread will release. The
    fork waits for the import to end; without that wait (0 s) the server forgets the half-run
    module and a worker imports it afresh."""
    head = (
        ""
        if wait_s is None
        else f"from multiproc import forking\nforking.IMPORT_WAIT_S = {wait_s}\n"
    )
    r = _subproc.run(head + _IMPORTING, timeout_s=30)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str([0, 7, 14, 21, 28, 35]), r.stdout


_OPENMP_TEAMS = """
import torch
from multiproc import Executor, ExecutorSpec, StageSpec

def copies(unit):
    for _ in range(unit):
        yield float(torch.ones(2048, 2048).clone().sum())  # a kernel run by a team of 2

torch.set_num_threads(2)
for _ in range(3):
    torch.ones(2048, 2048).clone()  # this thread's OpenMP pool now exists
stage = StageSpec("copy", "source", copies, torch_threads=2)
for _ in range(2):  # a fork server per executor, each forked from this thread
    with Executor(ExecutorSpec((stage,))) as ex:
        print(list(ex.run([2])), flush=True)
    torch.ones(2048, 2048).clone()
"""


def test_workers_run_openmp_teams_after_the_owner_ran_its_own():
    """The owner's thread has run 2-thread kernels (GNU OpenMP keeps that thread's pool), then
    forks the fork server: a worker with ``torch_threads=2`` runs its kernels on a team of its
    own instead of waiting forever for the pool's threads, which are not in the child."""
    r = _subproc.run(_OPENMP_TEAMS, timeout_s=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["[4194304.0,", "4194304.0]"] * 2, r.stdout


class _Value:
    """A stage function returning an attribute its caller may change after a snapshot."""

    def __init__(self):
        self.v = 0

    def __call__(self, unit):
        yield from (self.v for _ in range(*unit))


def test_executors_in_turn_fork_from_a_kept_snapshot_which_the_caller_ends():
    """``keep_snapshot``: each executor's workers fork from the snapshot (they see its
    process as it was then), closing one leaves the snapshot's server running for the next,
    and the caller ends it."""
    from multiproc.snapshot import Snapshot

    fn = _Value()
    spec = ExecutorSpec((StageSpec("read", "source", fn, workers=2),))
    snap = Snapshot.take(spec.stages)
    try:
        for v in (1, 2):
            fn.v = v  # after the snapshot: its workers do not see it
            with Executor(spec, snap, keep_snapshot=True) as ex:
                assert set(ex.run([(0, 4), (4, 8)])) == {0}
            assert not snap.server.ended()
    finally:
        snap.stop()
    assert snap.server.ended()
