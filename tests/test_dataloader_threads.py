"""``DataLoader(worker_method=...)``: thread workers give torch's batches, see their own
worker info, share the dataset and leave this process's random generators alone; ``"auto"``
moves to threads only where reads need no seed of them."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from torchtune_pipe import DataLoader

from ._compare import assert_same


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
