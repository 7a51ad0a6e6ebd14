"""A small, full or shared /dev/shm: loaders finish (or say what to do), and sweeps remove only
what is dead.

The small /dev/shm cases run a script in a private mount namespace with its own tmpfs on
/dev/shm (``unshare -m``, as root), the size of Docker's default; its segments vanish with the
namespace. The shared /dev/shm case runs a sweep in a new PID namespace (``unshare --pid``),
where the pids in this process's segment names name no process, as in a container started
with ``docker run --ipc=host``. Each is skipped, with the reason, where unshare is not allowed.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from multiproc import Executor, ExecutorSpec, StageSpec, arena, lifetime
from tests.multiproc import _fns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHM = "/dev/shm"


def _unshare_problem(*args: str) -> str | None:
    """Why ``unshare args... true`` cannot run here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    try:
        p = subprocess.run(
            ["unshare", *args], capture_output=True, text=True, timeout=30
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if p.returncode != 0:
        return f"unshare {' '.join(args)} is not permitted here: {p.stderr.strip()[:200]}"
    return None


@pytest.fixture(scope="module")
def small_shm():
    """Runs a script with a tmpfs of a given size on /dev/shm, in a private mount namespace."""
    why = _unshare_problem("-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm")
    if why is not None:
        pytest.skip(why)

    def run(code: str, size_mib: int = 64, env: dict | None = None, timeout_s: float = 120):
        script = f'mount -t tmpfs -o size={size_mib}m tmpfs {SHM} && exec "$0" -c "$1"'
        full_env = {
            **os.environ,
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **(env or {}),
        }
        return subprocess.run(
            ["unshare", "-m", "sh", "-c", script, sys.executable, textwrap.dedent(code)],
            cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip

    return run


def _ok(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0 and "DONE" in p.stdout, (
        f"exit status {p.returncode}\nstdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-6000:]}"
    )
    return p.stdout


# A train and a validation loader of 4 MiB batches (16 samples of 256 KiB), two epochs, every
# batch compared with torch's DataLoader's. FILL_MIB of /dev/shm is taken by something else
# before the loaders start.
LOADERS = """
import os, sys
import torch
from torch.utils.data import DataLoader as TorchDataLoader, Dataset
from torchtune_pipe import DataLoader

NUM_WORKERS = {num_workers!r}
FILL_MIB = {fill_mib}


class Rows(Dataset):
    def __init__(self, n, base):
        self.n, self.base = n, base

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.full((256, 256), float(self.base + i))
        x[0, :4] = torch.tensor([i, i % 7, i % 3, -1.0])
        return x


if FILL_MIB:
    with open("/dev/shm/someone_else", "wb") as f:
        f.write(b"x" * (FILL_MIB << 20))
train, val = Rows(256, 0), Rows(64, 10_000)
kw = dict(batch_size=16, num_workers=NUM_WORKERS)
loaders = [(DataLoader(train, shuffle=False, **kw), train), (DataLoader(val, **kw), val)]
for epoch in range(2):
    for loader, ds in loaders:
        n = 0
        for got, want in zip(loader, TorchDataLoader(ds, batch_size=16)):
            assert torch.equal(got, want), (epoch, n)
            n += 1
        assert n == len(ds) // 16, (epoch, n)
print("DONE")
"""


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [2, "auto"])
def test_train_and_val_loaders_of_4mib_batches_finish_in_docker_default_shm(small_shm, num_workers):
    # Was: SIGBUS in every worker (17 deaths > max_restarts) with 2 workers, and with "auto"
    # too, or torch's "unable to allocate shared memory".
    _ok(small_shm(LOADERS.format(num_workers=num_workers, fill_mib=0), size_mib=64))


@pytest.mark.slow
def test_loaders_finish_with_50mib_of_shm_free(small_shm):
    _ok(small_shm(LOADERS.format(num_workers=2, fill_mib=14), size_mib=64))


# Workers started, then /dev/shm filled up to the last byte: no page of an arena can be
# reserved, so every frame travels through its worker's pipe.
FILLED_AFTER_START = """
import os, time
import numpy as np
from multiproc import Executor, ExecutorSpec, StageSpec


def read(unit):
    lo, hi = unit
    for i in range(lo, hi):
        yield np.full(1 << 17, i, dtype=np.float64)  # 1 MiB


spec = ExecutorSpec((StageSpec("read", "source", read, workers=2, frame_items=1),))
with Executor(spec) as ex:
    deadline = time.monotonic() + 30
    while not ex.started():
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.01)
    st = os.statvfs("/dev/shm")
    with open("/dev/shm/someone_else", "wb") as f:
        f.write(b"x" * (st.f_bavail * st.f_frsize))
    assert os.statvfs("/dev/shm").f_bavail == 0
    got = sorted(int(x[0]) for x in ex.run([(i, i + 4) for i in range(0, 32, 4)]))
    assert got == list(range(32)), got
    assert ex.snapshot().stage("read").spilled > 0
print("DONE")
"""


def test_frames_travel_through_pipes_when_shm_fills_up_after_start(small_shm):
    p = small_shm(FILLED_AFTER_START, size_mib=16)
    _ok(p)
    assert "is full" in p.stderr  # the warning that says why it is slower, and what to do


# Docker's default /dev/shm: a frame bigger than its worker's budget travels in a segment of
# its own (multiproc.spill) where that takes at most a third of the free bytes, else inline.
SPILLED = """
import numpy as np
from multiproc import Executor, ExecutorSpec, StageSpec, arena

kinds = []
decode = arena.decode


def recording(payload, *args):
    kinds.append(payload[0] if payload[0] == "inline" else type(payload[1]).__name__)
    return decode(payload, *args)


def read(unit):
    mib, lo, hi = unit
    for i in range(lo, hi):
        yield np.full(mib << 18, i, dtype=np.float32)


arena.decode = recording
source = StageSpec("read", "source", read, workers=2, frame_items=1, buffer_bytes=1 << 20)
with Executor(ExecutorSpec((source,), ordered=True)) as ex:
    for mib, kind in ((4, "SpillRef"), (24, "inline")):
        kinds.clear()
        got = [int(x[0]) for x in ex.run([(mib, 0, 4), (mib, 4, 8)])]
        assert got == list(range(8)), got
        assert kinds == [kind] * 8, (mib, kinds)
print("DONE")
"""


def test_spilled_frames_take_segments_of_their_own_only_where_they_leave_room(small_shm):
    _ok(small_shm(SPILLED, size_mib=64))


# /dev/shm full before the loader starts: nothing of the pipeline fits there.
NO_ROOM = """
import os
import torch
from torch.utils.data import Dataset
from torchtune_pipe import DataLoader


class Rows(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((256, 256), float(i))


def stack(batch):
    return torch.stack(batch)


st = os.statvfs("/dev/shm")
with open("/dev/shm/someone_else", "wb") as f:
    f.write(b"x" * (st.f_bavail * st.f_frsize))
loader = DataLoader(Rows(), batch_size=16, num_workers=2, collate_fn=stack)
try:
    n = sum(1 for _ in loader)
    shm_dir = os.environ.get("MULTIPROC_SHM_DIR")
    assert shm_dir and n == 4, n
    print("DONE in", shm_dir)
except Exception as e:
    print("FAILED:", type(e).__name__, e)
"""


def test_no_room_at_all_names_shm_its_size_its_free_bytes_and_the_fixes(small_shm):
    p = small_shm(NO_ROOM, size_mib=64)
    assert "FAILED: SharedMemoryError" in p.stdout, (
        f"stdout:\n{p.stdout}\nstderr:\n{p.stderr[-6000:]}"
    )
    message = p.stdout.split("FAILED:", 1)[1]
    for words in ("/dev/shm is 64.0 MiB with 0.0 MiB free", "--shm-size", "MULTIPROC_SHM_DIR"):
        assert words in message, message


@pytest.mark.slow
def test_shm_dir_option_moves_the_segments_to_a_directory_with_room(small_shm, tmp_path):
    p = small_shm(NO_ROOM, size_mib=64, env={"MULTIPROC_SHM_DIR": str(tmp_path)})
    assert f"DONE in {tmp_path}" in p.stdout, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr[-6000:]}"
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ttp_")]  # closed: removed


# The first executor of a process in another PID namespace sweeps stale segments; the pids in
# the test process's segment names name no process there.
SWEEP_ELSEWHERE = """
import os
from multiproc import Executor, ExecutorSpec, StageSpec


def read(unit):
    yield from range(*unit)


assert os.getpid() == 1  # a new PID namespace
spec = ExecutorSpec((StageSpec("read", "source", read, worker_type="thread"),))
with Executor(spec) as ex:
    assert list(ex.run([(0, 3)])) == [0, 1, 2]
    print("TAG", ex._tag)
print("DONE")
"""


def test_a_sweep_in_another_pid_namespace_keeps_a_live_executors_segments():
    why = _unshare_problem("--pid", "--fork", "--mount-proc", "true")
    if why is not None:
        pytest.skip(why)
    spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range, workers=1),))
    with Executor(spec) as ex:
        assert list(ex.run([(0, 5)])) == list(range(5))
        prefix = f"ttp_{ex._tag}_"
        mine = {n for n in os.listdir(SHM) if n.startswith(prefix)}
        assert mine
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        p = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
             textwrap.dedent(SWEEP_ELSEWHERE)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        out = _ok(p)
        tag = out.split("TAG", 1)[1].split()[0]
        assert not [n for n in os.listdir(SHM) if n.startswith(f"ttp_{tag}_")]
        left = {n for n in os.listdir(SHM) if n.startswith(prefix)}
        assert left == mine, f"the sweep in the other namespace removed {sorted(mine - left)}"
        # A new worker maps the counters by name: the executor still works.
        ex.resize("read", 2)
        assert sorted(ex.run([(0, 40)])) == list(range(40))


def _gone_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _touch(name: str, size: int = 1) -> str:
    path = os.path.join(SHM, name)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_the_sweep_goes_by_the_alive_lock_not_by_the_pid():
    # Three executors' leftovers: one whose lock nobody holds though its pid names a live
    # process here (pid 1: a pid reused, or a process of another namespace that is gone), one
    # whose lock is held though its pid names no process here (alive in another namespace),
    # and one whose owner is between creating its alive file and locking it.
    dead = ["ttp_1_90_a1b2c3_alive", "ttp_1_90_a1b2c3_w0", "ttp_1_90_a1b2c3_stats"]
    gone = _gone_pid()
    held = [f"ttp_{gone}_91_d4e5f6_alive", f"ttp_{gone}_91_d4e5f6_w0"]
    starting = [f"ttp_{gone}_92_0a0b0c_alive", f"ttp_{gone}_92_0a0b0c_pickled"]
    made = []
    holder = None
    try:
        for name in dead + held + starting:
            made.append(_touch(name, 0 if name == starting[0] else 1))
        holder = subprocess.Popen(
            [sys.executable, "-c", (
                "import fcntl, os, sys\n"
                f"fd = os.open({os.path.join(SHM, held[0])!r}, os.O_RDONLY)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "print('locked', flush=True)\n"
                "sys.stdin.read()\n"
            )],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert holder.stdout.readline().strip() == "locked"
        removed = set(arena.sweep_stale_segments())
        assert set(dead) <= removed
        assert not removed & set(held + starting)
        assert all(os.path.exists(os.path.join(SHM, n)) for n in held + starting)
        # The fork server's sweep of a dead owner's pid leaves the live one of that pid alone.
        assert set(arena.segment_names(f"ttp_{gone}_")).isdisjoint(held)
        holder.stdin.close()
        holder.wait(10)
        assert set(held) <= set(arena.sweep_stale_segments())
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait(10)
        for path in made:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def test_an_executor_holds_its_alive_lock_until_it_closes():
    spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range, worker_type="thread"),))
    ex = Executor(spec)
    alive = os.path.join(SHM, lifetime.alive_name(ex._tag))
    try:
        fd = os.open(alive, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        ex.close()
    deadline = time.monotonic() + 5
    while os.path.exists(alive):
        assert time.monotonic() < deadline, "the alive file outlived close()"
        time.sleep(0.01)
