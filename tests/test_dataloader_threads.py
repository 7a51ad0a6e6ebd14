"""``DataLoader(worker_method=...)``: thread workers give torch's batches, see their own
worker info and their own copy of the dataset (its data shared), and leave this process's
random generators alone; ``"auto"`` moves to threads only where reads need no seed of them."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from torchtune_pipe import DataLoader

from ._compare import assert_same
from .test_faststart import _wait_for_workers


class Rows(Dataset):
    def __init__(self, n=96):
        self.x = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
        self.lock = threading.Lock()  # does not pickle: thread workers share the dataset

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        info = get_worker_info()
        return self.x[i] * 2, -1 if info is None else info.num_workers


class Shards(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        wid, n = (0, 1) if info is None else (info.id, info.num_workers)
        yield from (torch.tensor([i, wid]) for i in range(wid, 40, n))


class Draws(Rows):
    def __getitem__(self, i):
        return self.x[i] + torch.rand(3), 0


class Slow(Rows):
    """Reads of ~0.5 ms: the first batches, read in this process, leave the workers time to
    start, so the epoch runs on them."""

    def __getitem__(self, i):
        time.sleep(0.0005)
        return super().__getitem__(i)


class SlowDraws(Slow):
    def __getitem__(self, i):
        x, _ = super().__getitem__(i)
        return x + torch.rand(3), 0


def test_thread_workers_give_torchs_batches_and_their_own_worker_info():
    g = torch.Generator().manual_seed(3)
    want = list(TorchLoader(Rows(), batch_size=8, shuffle=True, generator=g, num_workers=2))
    g = torch.Generator().manual_seed(3)
    with DataLoader(Rows(), batch_size=8, shuffle=True, generator=g, num_workers=2,
                    worker_method="thread") as dl:  # fmt: skip
        got = list(dl)
    assert_same(got, want)  # num_workers (2) read in every sample: worker info per thread
    assert get_worker_info() is None  # this thread is no worker


def test_an_iterable_dataset_is_sharded_per_thread_worker():
    want = list(TorchLoader(Shards(), batch_size=4, num_workers=2))
    with DataLoader(Shards(), batch_size=4, num_workers=2, worker_method="thread") as dl:
        assert_same(list(dl), want)


def test_thread_workers_leave_this_process_generators_as_torchs_workers_do():
    torch.manual_seed(11)
    list(TorchLoader(Rows(), batch_size=8, shuffle=True, num_workers=2))
    want = torch.get_rng_state()
    torch.manual_seed(11)
    with DataLoader(Rows(), batch_size=8, shuffle=True, num_workers=2,
                    worker_method="thread") as dl:  # fmt: skip
        list(dl)
    assert torch.equal(torch.get_rng_state(), want)


def test_auto_moves_to_threads_only_where_reads_need_no_seed():
    for dataset, threadable in ((Slow(2000), True), (SlowDraws(2000), False)):
        with DataLoader(dataset, batch_size=4, num_workers=2, worker_method="auto",
                        tuning_interval_s=0.05) as dl:  # fmt: skip
            seen = set()
            for k, _ in enumerate(dl):
                if k >= 2 and dl.loader.tunable is not None:
                    seen.add(dl.loader.tunable.observe().stages[0].threadable)
            assert seen == {threadable}, dataset


def test_an_unknown_worker_method_is_named():
    with pytest.raises(ValueError, match="worker_method must be 'process', 'thread' or 'auto'"):
        DataLoader(Rows(), num_workers=2, worker_method="fiber")


class Busy(Rows):
    """Reads of ~0.4 ms of pure Python: they hold the interpreter lock."""

    loops = 4000

    def __getitem__(self, i):
        n = 0
        for k in range(self.loops):
            n += k
        return super().__getitem__(i)


class Heavy(Busy):
    """Reads of ~4 ms of pure Python, each a small tensor: their hop is a fraction of them."""

    loops = 120000


class Fails(Slow):
    def __getitem__(self, i):
        if i == 70:
            raise ValueError("bad row 70")
        return super().__getitem__(i)


def _kind_events(log):
    return [e["message"] for e in map(json.loads, log.read_text().splitlines())
            if e.get("event") == "kind"]  # fmt: skip


def test_auto_starts_reads_that_scale_on_threads_measured_before_the_workers(tmp_path):
    log = tmp_path / "tuning.jsonl"
    want = list(TorchLoader(Slow(400), batch_size=4, num_workers=2))
    with DataLoader(Slow(400), batch_size=4, num_workers="auto", tuning_log=str(log)) as dl:
        it = iter(dl)
        got = [next(it)]
        _wait_for_workers(dl)  # the workers start though the consumer asks for nothing more
        ex = dl.loader.tunable.executor
        assert ex.threads("fetch") == ex.workers("fetch") >= 1  # no process ever ran it
        got += list(it)
    assert_same(got, want)
    (said,) = _kind_events(log)
    assert "start on threads" in said and "reads at once on threads ran" in said
    assert dl.loader._kinds.decisions[0][:3] == ("start", 0, True)
    # The reads wait: run with several calls at once, their CPU may contend for the lock,
    # which reads measured one call at a time cannot show. The rule tries processes later.
    assert "calls in flight per worker" in said
    assert 0 not in dl.loader._kinds.tried


def test_auto_starts_reads_that_hold_the_lock_on_processes(tmp_path):
    log = tmp_path / "tuning.jsonl"
    want = list(TorchLoader(Busy(400), batch_size=4, num_workers=2))
    with DataLoader(Busy(400), batch_size=4, num_workers="auto", tuning_log=str(log)) as dl:
        it = iter(dl)
        got = [next(it)]
        _wait_for_workers(dl)
        assert dl.loader.tunable.executor.threads("fetch") == 0
        got += list(it)
    assert_same(got, want)
    (said,) = _kind_events(log)
    assert "start on processes" in said, said


def test_reads_that_draw_from_the_global_generators_are_not_probed_on_threads(tmp_path):
    log = tmp_path / "tuning.jsonl"
    torch.manual_seed(4)
    with DataLoader(SlowDraws(200), batch_size=4, num_workers=2, worker_method="process") as dl:
        want = list(dl)  # seeded batch by batch (seed_each_batch): the same on any workers
    torch.manual_seed(4)
    with DataLoader(SlowDraws(200), batch_size=4, num_workers="auto",
                    tuning_log=str(log)) as dl:  # fmt: skip
        got = list(dl)
    assert_same(got, want)
    (said,) = _kind_events(log)
    assert "start on processes: the reads were not measured on threads" in said


def test_an_error_in_a_probed_read_reaches_the_consumer_in_its_place():
    with DataLoader(Fails(400), batch_size=4, num_workers="auto") as dl:
        got = []
        with pytest.raises(ValueError, match="bad row 70") as err:
            for b in dl:
                got.append(b)
        assert len(got) == 70 // 4  # every batch before the failing one, in order
        assert "dataset[70] raised it" in "".join(getattr(err.value, "__notes__", []))
        assert dl.loader.tunable is None  # the epoch ended before any executor was built


class ThreadBound(Slow):
    """A handle usable only in the thread that opened it, as a sqlite3 connection is (worker
    processes fork with their own)."""

    def __init__(self, n):
        super().__init__(n)
        self.opened_in = (os.getpid(), threading.get_ident())

    def __getitem__(self, i):
        pid, thread = self.opened_in
        if os.getpid() == pid and threading.get_ident() != thread:
            raise RuntimeError("handle used outside the thread that opened it")
        return super().__getitem__(i)


def test_reads_that_fail_on_a_thread_stay_on_processes_and_lose_nothing(tmp_path):
    log = tmp_path / "tuning.jsonl"
    want = list(TorchLoader(Slow(200), batch_size=4, num_workers=2))
    with DataLoader(ThreadBound(200), batch_size=4, num_workers="auto", tuning_log=str(log)) as dl:
        got = list(dl)
        assert dl.loader._kinds.barred == {0}
    assert_same(got, want)  # the unit that failed on a thread was read again, once
    (said,) = _kind_events(log)
    assert "a read on a thread raised RuntimeError" in said and "stay on processes" in said


class VerySlow(Rows):
    """Batches of 4 that take 0.4 s each: past the probe's bound in one read."""

    def __getitem__(self, i):
        time.sleep(0.1)
        return super().__getitem__(i)


def test_units_too_long_to_measure_start_on_processes_without_waiting(tmp_path):
    from torchtune_pipe.loader.faststart import KIND_PROBE_MAX_S

    log = tmp_path / "tuning.jsonl"
    with DataLoader(VerySlow(40), batch_size=4, num_workers="auto", tuning_log=str(log)) as dl:
        it = iter(dl)
        t0 = time.monotonic()
        got = [next(it)]
        _wait_for_workers(dl)
        # The first batch, one more on the probe's thread, then the workers: not a round.
        assert time.monotonic() - t0 < 3 * 0.4 + KIND_PROBE_MAX_S + 2.0
        got += list(it)
    assert sorted(int(x) for b in got for x in b[0][:, 0] / 6) == list(range(40))
    (said,) = _kind_events(log)
    assert "start on processes: the reads were not measured on threads" in said
    assert 0 not in dl.loader._kinds.tried  # so the rule tries threads while running


def test_a_probe_leaves_torchs_collate_as_it_found_it():
    from torch.utils.data._utils import collate

    before = collate.default_collate_fn_map[torch.Tensor]
    for _ in range(3):
        with DataLoader(Slow(200), batch_size=4, num_workers="auto") as dl:
            assert len(list(dl)) == 50
        assert dl.loader._kinds.decisions  # the probe ran
        assert collate.default_collate_fn_map[torch.Tensor] is before


def _stack_shared(batch):
    """torch's collate, and whether its stacked tensor landed in shared memory."""
    from torch.utils.data import default_collate

    x = default_collate(batch)
    return x, torch.tensor(x[0].is_shared())


@pytest.mark.parametrize("method", ["thread", "auto"])
def test_thread_workers_stack_batches_in_ordinary_memory(method):
    # torch's collate stacks into a new shared-memory segment per tensor wherever
    # get_worker_info() is set; a thread worker (and a read of the probe or of a fast start)
    # has it set, and hands its batch over within this process.
    with DataLoader(Slow(400), batch_size=8, num_workers=2, worker_method=method,
                    collate_fn=_stack_shared) as dl:  # fmt: skip
        flags, threads = [], set()
        for _, shared in dl:
            flags.append(bool(shared))
            if dl.loader.tunable is not None:
                threads.add(dl.loader.tunable.observe().stages[0].threads)
    assert len(flags) == 50 and not any(flags)
    if method == "thread":
        assert threads == {2}  # read on thread workers


def test_a_probe_counts_a_read_alone_without_its_waits_for_a_cpu(tmp_path, monkeypatch):
    """What another process's load takes from a read alone (the thread's run-queue delay) is
    not its cost: a read reported as waiting 90% of its time for a CPU counts a tenth as long,
    so k reads at once on threads no longer look to scale."""
    from torchtune_pipe.loader import faststart

    start = time.perf_counter()
    monkeypatch.setattr(faststart, "runq_s", lambda: 0.9 * (time.perf_counter() - start))
    log = tmp_path / "tuning.jsonl"
    with DataLoader(Slow(400), batch_size=4, num_workers="auto", tuning_log=str(log)) as dl:
        assert len(list(dl)) == 100
    (said,) = _kind_events(log)
    assert re.search(r"start on processes: \d reads at once on threads ran 0\.\d+x", said), said


def test_a_probe_weighs_the_hop_a_process_would_pay(tmp_path, monkeypatch):
    """Reads that hold the lock start on processes, unless each unit's hop between processes
    (pickle, copy into shared memory, rebuild) costs more than the read: then k processes
    would be slower than k threads taking turns, and the stage starts on threads."""
    from torchtune_pipe.loader import faststart

    hops = []

    def hop(items, arena_bytes):
        hops.append(arena_bytes)
        return 0.05  # seconds per unit: some 20x a unit of these reads

    monkeypatch.setattr(faststart, "hop_s", hop)
    log = tmp_path / "tuning.jsonl"
    want = list(TorchLoader(Busy(400), batch_size=4, num_workers=2))
    with DataLoader(Busy(400), batch_size=4, num_workers="auto", tuning_log=str(log)) as dl:
        got = list(dl)
    assert_same(got, want)
    (said,) = _kind_events(log)
    assert re.search(r"start on threads: 2 reads at once on threads ran \d\.\d+x one alone "
                     r"and \d+\.\d+x what 2 processes would", said), said  # fmt: skip
    assert hops and all(b == 64 * 2**20 // 2 for b in hops)  # the stage's budget over k workers


@pytest.mark.parametrize("below", [10.0, 0.0])
def test_a_first_round_that_settles_the_kind_ends_the_probe(monkeypatch, below):
    """A first counted round in which threads read at most ``SETTLED_BELOW`` of what processes
    would (reads that hold the lock: no round's noise brings them to where threads start)
    ends the probe there, and the workers start; otherwise it counts ``KIND_ROUNDS_MIN``
    rounds or more (one hop weighed per counted round)."""
    from torchtune_pipe.loader import faststart, kindstart
    from torchtune_pipe.tuning import worker_kind
    from torchtune_pipe.tuning.worker_kind import start_on_threads

    counted = []
    hop = faststart.hop_s
    monkeypatch.setattr(faststart, "hop_s", lambda items, b: counted.append(b) or hop(items, b))
    monkeypatch.setattr(kindstart, "SETTLED_BELOW", below)
    # threads start from a tie: one read alone never caps the probe (see the test below)
    monkeypatch.setattr(faststart, "start_share", lambda *a: worker_kind.START_SCALING)
    with DataLoader(Busy(400), batch_size=4, num_workers="auto") as dl:
        assert len(list(dl)) == 100
        assert 0 in dl.loader._kinds.kind  # placed by the probe
    assert len(counted) == 1 if below else len(counted) >= faststart.KIND_ROUNDS_MIN
    # Unpatched, a round ends the probe only where its measure starts the stage on processes.
    assert not start_on_threads(worker_kind.SETTLED_BELOW, 1.0, threads_first=False)


def test_reads_that_compute_and_hop_little_end_the_probe_after_one_read_alone(tmp_path):
    """k reads at once on threads read at most k times one alone; reads that compute, whose
    hop is a few percent of them, cannot reach the share of k processes that threads start
    from (``START_SCALING_COMPUTE``): the probe reads nothing on threads, and the stage starts
    on processes, settled (no trial of threads until the CPUs change)."""
    log = tmp_path / "tuning.jsonl"
    want = list(TorchLoader(Heavy(128), batch_size=32, num_workers=2))
    with DataLoader(Heavy(128), batch_size=32, num_workers="auto", tuning_log=str(log)) as dl:
        assert_same(list(dl), want)
        kinds = dl.loader._kinds
        assert kinds.kind[0] is False and 0 in kinds.tried  # processes, settled
    (said,) = _kind_events(log)
    # A read alone that waited for a CPU (a busy machine: its wall time well past its CPU) is
    # not taken for one that computes, and the probe measures threads: processes either way.
    capped = re.search(r"start on processes: 2 reads at once on threads would read at most "
                       r"1\.0\dx what 2 processes would", said)  # fmt: skip
    assert capped or re.search(r"start on processes: 2 reads at once on threads ran", said), said


class Tagged(Dataset):
    """Rows that say which worker's ``worker_init_fn`` set up the dataset that read them."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.tensor([getattr(self, "wid", -1), get_worker_info().id])


def _tag(worker_id):
    get_worker_info().dataset.wid = worker_id  # torch's docs' way to set a worker's copy up


def test_worker_info_dataset_is_the_copy_each_thread_worker_reads():
    """``get_worker_info().dataset`` is the dataset the worker reads, its own: what its
    ``worker_init_fn`` sets there is what its reads see, as in torch's worker processes, and
    never reaches the caller's object or another thread's."""
    ds = Tagged()
    with DataLoader(ds, batch_size=4, num_workers=2, worker_init_fn=_tag,
                    worker_method="thread") as dl:  # fmt: skip
        rows = torch.cat(list(dl))
    assert torch.equal(rows[:, 0], rows[:, 1])
    assert not hasattr(ds, "wid")
