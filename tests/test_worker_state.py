"""What a worker sees of the calling process: what torch's forked DataLoader workers see.

Each case runs torch's DataLoader and ours on the same dataset and script, batch by batch: a
module global and an environment variable set after the loader was built, a dataset attribute
set before each epoch, datasets holding an open file or a sqlite connection, a closure over a
module global in a Pipeline.map, and a loader built in a forked child.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import struct
import time

import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset
from torch.utils.data import DataLoader as TorchDataLoader

from torchtune_pipe import DataLoader, Pipeline

ENV = "TTP_TEST_WORKER_STATE"
SCALE = 1  # read by GlobalsDataset's workers
FACTOR = 1  # read by the Pipeline.map closure
N, BATCH = 48, 8

# (num_workers, tuner): fixed workers, and "auto" under its tuner.
MODES = [(2, None), ("auto", "intune")]
MODE_IDS = ["workers2", "auto"]


class GlobalsDataset(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, SCALE, int(os.environ.get(ENV, "0"))])


class EpochDataset(Dataset):
    def __init__(self) -> None:
        self.epoch = 0

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, self.epoch])


class FileDataset(Dataset):
    """Packed records read through a handle opened in ``__init__`` (it does not pickle)."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 - held for the dataset's life, as users do

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        # pread, not seek + read: forked workers (torch's too) share the handle's offset.
        return torch.tensor(struct.unpack("<q", os.pread(self.f.fileno(), 8, 8 * i)))


class SqliteDataset(Dataset):
    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        (v,) = self.db.execute("SELECT v FROM t WHERE k = ?", (i,)).fetchone()
        return torch.tensor([i, v])


def _ours(ds, num_workers, tuner, persistent, **kw):
    return DataLoader(
        ds, batch_size=BATCH, num_workers=num_workers, tuner=tuner,
        persistent_workers=persistent, tuning_interval_s=0.05, **kw,
    )  # fmt: skip


def _torch(ds, persistent, **kw):
    return TorchDataLoader(ds, batch_size=BATCH, num_workers=2, persistent_workers=persistent, **kw)


def _epochs(loader, before_epoch, epochs=3) -> list[list[list[int]]]:
    out = []
    for e in range(epochs):
        before_epoch(e)
        out.append([b.tolist() for b in loader])
    return out


@pytest.fixture
def restore_globals():
    global SCALE, FACTOR
    saved = (SCALE, FACTOR, os.environ.get(ENV))
    yield
    SCALE, FACTOR = saved[0], saved[1]
    if saved[2] is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = saved[2]


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("num_workers, tuner", MODES, ids=MODE_IDS)
def test_globals_and_environment_set_after_the_loader_was_built(
    num_workers, tuner, persistent, restore_globals
):
    def set_state(e: int) -> None:
        global SCALE
        SCALE = 10 + e
        os.environ[ENV] = str(100 + e)

    def run(make):
        global SCALE
        SCALE = 1
        os.environ[ENV] = "1"
        loader = make()  # built before the values change, iterated after
        try:
            return _epochs(loader, set_state)
        finally:
            getattr(loader, "close", lambda: None)()

    ds = GlobalsDataset()
    want = run(lambda: _torch(ds, persistent))
    got = run(lambda: _ours(ds, num_workers, tuner, persistent))
    assert got == want
    seen = {tuple(row[1:]) for epoch in want for batch in epoch for row in batch}
    # torch: each epoch's values (fresh workers), or the first epoch's (persistent ones).
    assert seen == ({(10, 100)} if persistent else {(10, 100), (11, 101), (12, 102)})


def test_a_loader_built_after_a_change_sees_it(restore_globals):
    global SCALE
    SCALE = 1
    first = _ours(GlobalsDataset(), 2, None, False)
    assert {b[0, 1].item() for b in first} == {1}
    SCALE = 7
    second = _ours(GlobalsDataset(), 2, None, False)
    try:
        assert {row[1] for b in second for row in b.tolist()} == {7}
        assert {row[1] for b in first for row in b.tolist()} == {7}  # a new epoch: new values
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("num_workers, tuner", MODES, ids=MODE_IDS)
def test_a_dataset_attribute_set_before_each_epoch(num_workers, tuner, persistent):
    def run(ds, loader):
        try:
            return _epochs(loader, lambda e: setattr(ds, "epoch", e))
        finally:
            getattr(loader, "close", lambda: None)()

    ds = EpochDataset()
    want = run(ds, _torch(ds, persistent))
    ds = EpochDataset()
    got = run(ds, _ours(ds, num_workers, tuner, persistent))
    assert got == want
    assert [{row[1] for b in epoch for row in b} for epoch in want] == (
        [{0}, {0}, {0}] if persistent else [{0}, {1}, {2}]
    )


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_a_loader_that_reads_inline_for_good_sees_the_dataset_as_workers_would(persistent):
    """Once ``"auto"`` reads in the calling thread in place of workers, each epoch reads the
    dataset as that epoch's workers would see it: as set before the epoch, or, with persistent
    workers, as the first epoch's saw it."""
    ds = EpochDataset()
    want = _epochs(_torch(ds, persistent), lambda e: setattr(ds, "epoch", e))
    ds = EpochDataset()
    with _ours(ds, "auto", None, persistent) as loader:
        list(loader)
        loader.loader._go_inline("as the shape choice would")  # what the choice decides
        got = _epochs(loader, lambda e: setattr(ds, "epoch", e))
        assert loader.loader.inline
    assert got == want


@pytest.fixture
def records(tmp_path):
    path = tmp_path / "records.bin"
    path.write_bytes(b"".join(struct.pack("<q", 1000 + i) for i in range(N)))
    db = tmp_path / "table.sqlite"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v INTEGER)")
        c.executemany("INSERT INTO t VALUES (?, ?)", [(i, 3 * i) for i in range(N)])
    c.close()
    return str(path), str(db)


class LazyFileDataset(Dataset):
    """Records read through a file opened at the first read (what torch's docs advise for a
    handle that does not survive a fork: each worker opens its own), then seek and read."""

    def __init__(self, path: str) -> None:
        self.path, self.f = path, None

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.f is None:
            self.f = open(self.path, "rb")  # noqa: SIM115 - kept for the reader's life
        self.f.seek(8 * i)
        time.sleep(0.001)  # another reader of this handle, if any, moves its offset meanwhile
        return torch.tensor([i, *struct.unpack("<q", self.f.read(8))])


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize(
    "num_workers, tuner, method",
    [(*m, "process") for m in MODES] + [(2, None, "thread")],
    ids=[*MODE_IDS, "threads2"],
)
def test_a_file_opened_at_the_first_read_is_each_readers_own(
    num_workers, tuner, method, persistent, records
):
    """No reader shares another's handle, whether the dataset opens it or a dataset it holds
    does: not the workers of a later epoch (forked after this process read some batches
    itself), nor threads reading side by side. Every record is read at its own offset."""
    makes = (
        lambda: LazyFileDataset(records[0]),
        lambda: Subset(ConcatDataset([LazyFileDataset(records[0])] * 2), range(N // 2, N + N // 2)),
    )
    for make in makes:
        want = _epochs(_torch(make(), persistent), lambda e: None)
        assert all(row[1] == 1000 + row[0] for epoch in want for b in epoch for row in b)
        ours = _ours(make(), num_workers, tuner, persistent, worker_method=method)
        try:
            assert _epochs(ours, lambda e: None) == want
        finally:
            ours.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("num_workers, tuner", MODES, ids=MODE_IDS)
def test_datasets_holding_an_open_file_or_a_database_connection(
    num_workers, tuner, persistent, records
):
    for make in (lambda: FileDataset(records[0]), lambda: SqliteDataset(records[1])):
        want = _epochs(_torch(make(), persistent), lambda e: None, epochs=2)
        ours = _ours(make(), num_workers, tuner, persistent)
        try:
            assert _epochs(ours, lambda e: None, epochs=2) == want
        finally:
            ours.close()


def test_under_spawn_the_error_names_what_does_not_pickle(records):
    loader = DataLoader(FileDataset(records[0]), batch_size=BATCH, num_workers=2,
                        multiprocessing_context="spawn")  # fmt: skip
    try:
        with pytest.raises(Exception, match=r"dataset\.f \(_io\.BufferedReader\).*spawn") as e:
            list(loader)  # the first batches may come from this process, as workers start
        assert "worker_type" not in str(e.value)  # no argument the DataLoader lacks
    finally:
        loader.close()


class Ids:
    """Units of 5 ids each."""

    def __len__(self) -> int:
        return 40

    def units(self, epoch: int = 0) -> list[int]:
        return list(range(8))

    def read(self, unit: int) -> range:
        return range(5 * unit, 5 * unit + 5)


def _scaled(x: int) -> int:
    return x * FACTOR


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_a_pipeline_map_closure_over_a_module_global(persistent, restore_globals):
    global FACTOR
    FACTOR = 1
    pipe = Pipeline.from_source(Ids(), workers=2).map(lambda x: _scaled(x), workers=2)
    seen = []
    with pipe.loader(ordered=True, persistent_workers=persistent) as loader:
        for e in range(3):
            FACTOR = 2 + e
            seen.append({x // i for i, x in enumerate(loader) if i})
    assert seen == ([{2}, {2}, {2}] if persistent else [{2}, {3}, {4}])


def _child_builds_its_own(q) -> None:
    try:
        dl = DataLoader(GlobalsDataset(), batch_size=BATCH, num_workers=2)
        q.put([b[:, 0].tolist() for b in dl])
        dl.close()
    except BaseException as e:  # reported to the parent's assertion
        q.put(repr(e))


def _child_iterates_the_parents(loader, q) -> None:
    try:
        list(loader)
        q.put("iterated")
    except BaseException as e:
        q.put(f"{type(e).__name__}: {e}")


def test_a_forked_child_builds_its_own_loader_and_the_parents_keeps_working():
    parent = DataLoader(GlobalsDataset(), batch_size=BATCH, num_workers=2)
    try:
        want = [list(range(i, i + BATCH)) for i in range(0, N, BATCH)]
        assert [b[:, 0].tolist() for b in parent] == want
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        child = ctx.Process(target=_child_builds_its_own, args=(q,))
        child.start()
        assert q.get(timeout=60) == want
        child.join(30)
        assert child.exitcode == 0
        it = iter(parent)
        first = next(it)
        child = ctx.Process(target=_child_iterates_the_parents, args=(parent, q))
        child.start()
        said = q.get(timeout=60)
        child.join(30)
        assert said.startswith("RuntimeError") and "fork" in said, said
        assert [first[:, 0].tolist(), *(b[:, 0].tolist() for b in it)] == want
        assert [b[:, 0].tolist() for b in parent] == want
    finally:
        parent.close()


_FORK_MID_EPOCH = """
import os, sys, time
import torch
from torchtune_pipe import DataLoader

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 256
    def __getitem__(self, i):
        time.sleep(0.002)  # the workers are still reading when the child forks, and exits
        return torch.tensor(i)

if __name__ == "__main__":
    dl = DataLoader(Ids(), batch_size=8, num_workers=2)
    it = iter(dl)
    got = [next(it)]
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # the child exits through interpreter shutdown, the epoch's iterator alive
    os.waitpid(pid, 0)
    got += list(it)
    print(sum(len(b) for b in got))
    dl.close()
"""


def test_a_child_forked_mid_epoch_exits_quietly_and_the_parent_goes_on(tmp_path):
    from . import _subproc

    script = tmp_path / "fork_mid_epoch.py"
    script.write_text(_FORK_MID_EPOCH)
    done = _subproc.run(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["256"]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("num_workers, tuner", MODES, ids=MODE_IDS)
def test_persistent_workers_after_an_epoch_ended_early_see_the_first_iter(num_workers, tuner):
    """An epoch ended early ends our workers, persistent or not; those of the next epoch fork
    from the snapshot of the first ``iter()``, so they see what torch's persistent workers
    (which go on) see: the dataset as it was then, not the attribute set since."""

    def run(ds, loader):
        out = []
        try:
            for e in range(3):
                ds.epoch = e
                batches = []
                for batch in loader:
                    batches.append(batch.tolist())
                    if e == 0 and len(batches) == 2:
                        break
                out.append(batches)
            return out
        finally:
            getattr(loader, "close", lambda: None)()

    ds = EpochDataset()
    want = run(ds, _torch(ds, True))
    ds = EpochDataset()
    assert run(ds, _ours(ds, num_workers, tuner, True)) == want
    assert {row[1] for epoch in want for b in epoch for row in b} == {0}
