"""Samplers and datasets as users combine them: two epochs, batch by batch, as torch's."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import (
    ConcatDataset,
    DistributedSampler,
    IterableDataset,
    Subset,
    TensorDataset,
    WeightedRandomSampler,
    get_worker_info,
)

from torchtune_pipe import DataLoader

from ._compare import assert_same


class Ranged(IterableDataset):
    """torch's documented pattern: ``worker_init_fn`` gives each worker a range."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def _ranges(worker_id: int) -> None:
    info = get_worker_info()
    ds = info.dataset
    per = int(math.ceil((ds.end - ds.start) / float(info.num_workers)))
    ds.start = ds.start + worker_id * per
    ds.end = min(ds.start + per, ds.end)


class Uneven(IterableDataset):
    """Shards of 3 and 9 items, split by ``get_worker_info()``."""

    def __iter__(self):
        info = get_worker_info()
        w = info.id if info is not None else 0
        return iter(range(w * 100, w * 100 + (3 if w == 0 else 9)))


def _tensors(n=30):
    return TensorDataset(torch.arange(n), torch.arange(n).float() / 2)


def _setups():
    """Per case: a function of the loader class and worker count giving (loader, epoch hook)."""

    def weighted(L, w):
        s = WeightedRandomSampler(
            [1.0 + i % 3 for i in range(30)], 20, generator=torch.Generator().manual_seed(1)
        )
        return L(_tensors(), batch_size=4, sampler=s, num_workers=w), None

    def distributed(L, w):
        s = DistributedSampler(range(30), num_replicas=2, rank=1, shuffle=True, seed=4)
        return L(_tensors(), batch_size=4, sampler=s, num_workers=w), s.set_epoch

    def concat_of_subsets(L, w):
        ds = ConcatDataset([Subset(_tensors(), [3, 1, 4, 1, 5]), _tensors(7)])
        g = torch.Generator().manual_seed(2)
        return L(ds, batch_size=3, shuffle=True, generator=g, num_workers=w), None

    def listed_batches(L, w):
        return L(_tensors(), batch_sampler=[[1, 2], [29], [0, 4, 5]], num_workers=w), None

    def worker_ranges(L, w):
        init = _ranges if w else None
        return L(Ranged(3, 20), batch_size=3, num_workers=w, worker_init_fn=init), None

    def uneven_shards(L, w):
        return L(Uneven(), batch_size=2, num_workers=w), None

    return {f.__name__: f for f in (weighted, distributed, concat_of_subsets, listed_batches,
                                    worker_ranges, uneven_shards)}  # fmt: skip


SETUPS = _setups()


def _epochs(setup, loader_cls, workers):
    loader, hook = setup(loader_cls, workers)
    out = []
    for epoch in range(2):
        if hook is not None:
            hook(epoch)
        out.append(list(loader))
    getattr(loader, "close", lambda: None)()
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_the_batches_of_each_epoch_are_torchs(name, workers):
    want = _epochs(SETUPS[name], torch.utils.data.DataLoader, workers)
    got = _epochs(SETUPS[name], DataLoader, workers)
    assert_same(want, got)
    assert all(want)  # every epoch delivered batches


@pytest.mark.parametrize("workers", [0, 2])
def test_a_samplers_epoch_is_its_owners_across_early_ends(workers):
    """The DDP recipe, resumed at epoch 5, each epoch ended after two batches (as
    ``limit_train_batches`` ends it): the order of each epoch is the one its
    ``sampler.set_epoch`` asks for, as under torch, not the loader's own count of epochs."""

    def run(loader_cls):
        s = DistributedSampler(range(30), num_replicas=2, rank=0, shuffle=True, seed=4)
        loader = loader_cls(_tensors(), batch_size=4, sampler=s, num_workers=workers)
        out = []
        for epoch in (5, 6, 7):
            s.set_epoch(epoch)
            for k, batch in enumerate(loader):
                out.append(batch)
                if k == 1:
                    break
        getattr(loader, "close", lambda: None)()
        return out

    want = run(torch.utils.data.DataLoader)
    assert_same(want, run(DataLoader))
    assert not torch.equal(want[0][0], want[2][0])  # the epochs' orders differ


def test_the_loaders_set_epoch_reaches_the_sampler():
    s = DistributedSampler(range(30), num_replicas=2, rank=0, shuffle=True, seed=4)
    with DataLoader(_tensors(), batch_size=4, sampler=s) as loader:
        loader.set_epoch(3)
        assert s.epoch == 3
        list(loader)
        assert s.epoch == 3  # the loader's epochs do not move it
