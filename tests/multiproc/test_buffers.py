"""Large arrays of a stage's pickle shared by its workers (multiproc/buffers.py)."""

from __future__ import annotations

import ast
import os
import pickle

import numpy as np
import pytest
import torch

from multiproc import Executor, ExecutorSpec, StageSpec, arena, buffers

from .. import _subproc
from . import _fns


def _run(fn, n=4):
    # Workers from multiprocessing's spawned server get the stage by pickle: the arrays go to
    # the file (a snapshot's workers inherit them, tested in a fresh interpreter below).
    spec = ExecutorSpec(
        (StageSpec("read", "source", _fns.read_range), StageSpec("m", "map", fn)),
        start_method="spawn",
    )
    with Executor(spec) as ex:
        name = ex._buffers.name
        assert os.path.exists(os.path.join(arena.SHM_DIR, name))
        out = list(ex.run([(0, n)]))
    assert not os.path.exists(os.path.join(arena.SHM_DIR, name))  # removed with the executor
    return out


def test_process_workers_inherit_the_snapshots_arrays_thread_workers_get_the_file():
    # Each executor forks its server when it is built: its workers inherit the stage.
    r = _subproc.run(_FROM_SERVER, timeout_s=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    # Nothing in /dev/shm, each worker views the consumer's own addresses, shares the pages.
    assert lines["server"] == "file=False shared=True private=0", r.stdout
    assert ast.literal_eval(lines["views"]) == {_VIEWS}, r.stdout
    # Changed before the next executor was built: its workers see the change.
    assert lines["changed"] == "file=False cols3=7.0", r.stdout
    assert lines["thread"] == "file=True total=4096.0", r.stdout  # threads: by pickle
    # The server ended (killed): another is forked for the workers started after.
    assert lines["restarted"] == "sums=[4096.0, 4096.0, 4096.0]", r.stdout


def test_a_worker_started_as_the_fork_server_is_killed_starts_through_its_successor():
    # waitpid can see a server killed a moment ago as running: the launch of the crashed worker's
    # replacement through it fails (EOF, refused); the executor waits for it to be reaped and
    # launches again through a new one.
    r = _subproc.run(_KILLED_SERVER, timeout_s=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "new_server=True raced=True sums=[4096.0, 4096.0, 4096.0]"


_KILLED_SERVER = """
import os, signal, threading, time
from multiproc import Executor, ExecutorSpec, StageSpec, handles, servers
from tests.multiproc import _fns

class Sum:
    def __init__(self):
        import numpy as np
        self.data = np.ones(1 << 20, dtype=np.float32)
    def __call__(self, x):
        time.sleep(0.3)  # still on the next item when its worker is killed
        return float(self.data[::256].sum())

racing, raced = threading.Event(), []
ended, wait_ended = servers.ForkServer.ended, servers.ForkServer.wait_ended
servers.ForkServer.ended = lambda self: False if racing.is_set() else ended(self)
def waited(self, wait_s=2.0):
    raced.append(racing.is_set())
    racing.clear()
    return wait_ended(self, wait_s)
servers.ForkServer.wait_ended = waited

spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range),
                     StageSpec("m", "map", Sum(), workers=1)))
with Executor(spec) as ex:
    it = ex.run([(0, 1), (1, 2), (2, 3)])
    first = next(it)
    old = ex._snapshot.server.pid
    racing.set()
    os.kill(old, signal.SIGKILL)
    os.kill(next(h.pid for h in ex._state.workers.values() if h.stage == 1), signal.SIGKILL)
    sums = [first, *it]
    new = ex._snapshot.server.pid
    print(f"new_server={new not in (None, old)} raced={raced == [True]} sums={sums}")
"""


_VIEWS = (-1.0, 26.0, 1000.0, 5 * 512 + 3, False, 3 * 512 + 5, True, 14, 9, True)
_FROM_SERVER = """
import os, signal, time
import numpy as np
from multiproc import Executor, ExecutorSpec, StageSpec
from tests.multiproc import _fns

def run(fn, kind="process", n=4):
    spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range),
                         StageSpec("m", "map", fn, worker_type=kind)))
    with Executor(spec) as ex:
        return ex._buffers.created, list(ex.run([(0, n)]))

class Where:
    def __init__(self):
        self.data = np.ones(48 << 20, dtype=np.uint8)
        self.here = self.data.__array_interface__["data"][0]
    def __call__(self, x):
        same = self.data.__array_interface__["data"][0] == self.here
        return same, _fns.private_mappings(48), int(self.data[::4096].sum())

class Sum:
    def __init__(self):
        self.data = np.ones(1 << 20, dtype=np.float32)
    def __call__(self, x):
        return float(self.data[::256].sum())

views, where, thread_sum, again = _fns.Views(), Where(), Sum(), Sum()
created, out = run(where)
assert {o[2] for o in out} == {(48 << 20) // 4096}, out
print("server", f"file={created} shared={all(o[0] for o in out)} private={max(o[1] for o in out)}")
created, out = run(views)
print("views", set(out))
views.base[26] = 7.0  # cols[3]
created, out = run(views)
print("changed", f"file={created} cols3={out[0][1]}")
created, out = run(thread_sum, kind="thread")
print("thread", f"file={created} total={out[0]}")
spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range),
                     StageSpec("m", "map", again, workers=1)))
with Executor(spec) as ex:
    it = ex.run([(0, 1), (1, 2), (2, 3)])
    first = next(it)
    os.kill(ex._snapshot.server.pid, signal.SIGKILL)
    print("restarted", f"sums={[first, *it]}")
"""


def test_workers_see_the_consumers_views_with_their_sharing_and_write_only_their_own_copy():
    fn = _fns.Views()
    out = _run(fn)
    # Every item of a worker after its first write sees it; values otherwise the consumer's.
    expected = (-1.0, 26.0, 1000.0, 5 * 512 + 3, False, 3 * 512 + 5, True, 14, 9, True)
    assert set(out) == {expected}
    assert float(fn.base[1]) == 1.0  # the consumer's tensor is untouched


def test_a_worker_maps_a_large_array_instead_of_holding_a_copy():
    # Bytes travel in the pickle (a private copy per worker); an array is mapped, shared.
    assert set(_run(_fns.BigBuffers(48, array=True))) == {0}


def test_small_arrays_grad_tensors_and_object_arrays_stay_in_the_pickle():
    out = buffers.BufferFile(f"ttp_{os.getpid()}_test_{os.urandom(3).hex()}")
    try:
        kept = [
            np.zeros(1000),
            torch.zeros(1 << 20, requires_grad=True),
            np.array([object()] * (1 << 18), dtype=object),
        ]
        out.dumps(kept)
        assert not out.created
        big = np.ones(1 << 18)  # 2 MiB
        out.dumps([big, big[:10], big])
        assert out.created and out.size >= big.nbytes
    finally:
        out.close()
        if out.created:
            arena.remove_segment(out.name)


def test_values_are_a_snapshot_taken_when_the_stage_was_pickled():
    fn = _fns.Views()
    spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range), StageSpec("m", "map", fn)))
    with Executor(spec) as ex:
        fn.base[1] = 123.0  # after the executor pickled the stage
        out = list(ex.run([(0, 2)]))
    assert {o[2] for o in out} == {1000.0}
    assert {o[0] for o in out} == {-1.0}


def test_the_executor_removes_the_file_when_a_stage_fails_to_pickle():
    before = set(os.listdir(arena.SHM_DIR))

    class Holder:
        def __init__(self):
            self.big = np.ones(1 << 18)
            self.lock = __import__("threading").Lock()  # does not pickle

        def __call__(self, x):
            return x

    spec = ExecutorSpec(
        (StageSpec("read", "source", _fns.read_range), StageSpec("m", "map", Holder())),
        start_method="spawn",  # a snapshot's workers inherit it instead
    )
    with pytest.raises(Exception, match=r"'m'.*pickle at fn\.lock \(_thread\.lock\)"):
        Executor(spec)
    left = {n for n in os.listdir(arena.SHM_DIR) if n.endswith("_pickled")} - before
    assert not left, left


def test_without_room_in_dev_shm_arrays_travel_in_the_pickle(monkeypatch):
    monkeypatch.setattr(buffers, "_room_for", lambda nbytes: False)
    out = buffers.BufferFile(f"ttp_{os.getpid()}_test_{os.urandom(3).hex()}")
    big = np.arange(1 << 18, dtype=np.float64)
    data = out.dumps(big)
    out.close()
    assert not out.created and len(data) > big.nbytes
    assert np.array_equal(pickle.loads(data), big)


def test_a_light_pickle_names_the_same_modules_without_the_arrays_data():
    from multiproc.spec import imported_modules

    fn = _fns.BigBuffers(8, array=True)
    light = buffers.dumps_light(fn)
    assert len(light) < 1 << 16  # not the 8 MiB
    assert set(imported_modules(light)) >= {"tests.multiproc._fns", "numpy"}
    assert not any(n.startswith("ttp_unwritten") for n in os.listdir(arena.SHM_DIR))


def test_without_a_dev_shm_to_write_to_arrays_travel_in_the_pickle(tmp_path):
    out = buffers.BufferFile("ttp_nowhere")
    out.path = str(tmp_path / "missing" / "ttp_nowhere")  # its directory does not exist
    big = torch.arange(1 << 18, dtype=torch.float64)
    data = out.dumps([big, big[10:]])
    out.close()
    back = pickle.loads(data)
    assert not out.created and torch.equal(back[0], big) and torch.equal(back[1], big[10:])


class _Mapped:
    """A map over a memory-mapped ``.npy`` (an array and a tensor over it, and a slice)."""

    def __init__(self, path):
        self.m = np.load(path, mmap_mode="r")
        self.tail = self.m[1000:]
        self.t = torch.from_numpy(np.load(path, mmap_mode="r+"))

    def __call__(self, x):
        return (float(self.m[5]), float(self.tail[0]), float(self.t[7]),
                bool(self.m.flags.writeable), _fns.private_mappings(32))  # fmt: skip


def test_a_memory_mapped_array_is_mapped_from_its_file_in_the_workers(tmp_path):
    path = str(tmp_path / "x.npy")
    np.save(path, np.arange(1 << 23, dtype=np.float32))  # 32 MiB
    fn = _Mapped(path)
    data = buffers.dumps_light(fn)
    assert len(data) < 1 << 16  # not pickled with its bytes
    spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range), StageSpec("m", "map", fn)))
    with Executor(spec) as ex:
        out = set(ex.run([(0, 4)]))
        assert not ex._buffers.created  # neither copied to /dev/shm
    assert out == {(5.0, 1000.0, 7.0, False, 0)}
