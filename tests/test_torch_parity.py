"""Samplers and datasets as users combine them: two epochs, batch by batch, as torch's."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch.utils.data import (
    ConcatDataset,
    Dataset,
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


class Draws(IterableDataset):
    """Shards split by ``get_worker_info()``, each item the draws of the three generators
    and the worker's seed, as a dataset augmenting at random draws them."""

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        seed = info.seed if info is not None else -1
        for i in range(w, 12, n):
            yield i, seed, torch.rand(1).item(), float(np.random.rand()), random.random()


class Indexed(TensorDataset):
    def __init__(self):
        super().__init__(torch.arange(24))


def _draws_after(loader_cls, make, workers, persistent, stop=None):
    """Three epochs (each ended after ``stop`` batches, if given) of ``make()``'s dataset
    from seeded generators: the batches, and what the generators draw after each epoch (what
    the training step would draw: the loader must move them as torch's does)."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    kw = {"persistent_workers": True} if persistent else {}
    loader = loader_cls(make(), batch_size=3, num_workers=workers, **kw)
    if isinstance(loader.dataset, Indexed):
        loader = loader_cls(make(), batch_size=3, num_workers=workers, shuffle=True, **kw)
    out, after = [], []
    for _ in range(3):
        for k, batch in enumerate(loader):
            out.append(batch)
            if stop is not None and k + 1 == stop:
                break
        after.append((torch.rand(1).item(), float(np.random.rand()), random.random()))
    getattr(loader, "close", lambda: None)()
    return out, after


@pytest.mark.parametrize("stop", [None, 2], ids=["whole", "early"])
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("make", [Draws, Indexed], ids=["iterable", "map"])
def test_random_draws_and_the_callers_generators_are_torchs(make, workers, persistent, stop):
    """Each worker of an IterableDataset is seeded as torch seeds it (its draws differ from
    the other worker's and from one epoch to the next; ``get_worker_info().seed`` is
    torch's), and the loader draws its base seed from the caller's generators as torch's
    iterator does: every ``iter()``, the first only with persistent workers.

    One difference: with persistent workers an IterableDataset's later epochs seed each
    shard from the first epoch's base seed and their count (our workers take whichever shard
    is next; torch's worker ``i`` goes on with its streams): the first epoch is torch's, the
    later ones differ from it, from each other and between shards, the same in every run."""
    want = _draws_after(torch.utils.data.DataLoader, make, workers, persistent, stop)
    got = _draws_after(DataLoader, make, workers, persistent, stop)
    if not (make is Draws and persistent):
        assert_same(want, got)
        return
    first = stop or 4  # batches of an epoch
    assert_same(want[1], got[1])  # the caller's generators
    assert_same(want[0][:first], got[0][:first])
    assert_same(got, _draws_after(DataLoader, make, workers, persistent, stop))
    draws = [tuple(b[2].tolist()) for b in got[0]]
    assert len(set(draws)) == len(draws)  # no worker or epoch repeats another's draws


class DrawingRows(Dataset):
    """Rows whose ``__getitem__`` augments at random (all three generators)."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return i, torch.rand(1).item(), float(np.random.rand()), random.random()


def _epoch_and_steps(make_loader):
    """An epoch of ``make_loader()`` from seeded generators: its batches, and what a training
    step draws after each batch."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    loader, batches, steps = make_loader(), [], []
    for batch in loader:
        batches.append(batch)
        steps.append((torch.rand(1).item(), float(np.random.rand()), random.random()))
    getattr(loader, "close", lambda: None)()
    return batches, steps


def test_a_loader_reading_inline_by_choice_leaves_the_callers_draws_alone():
    """``"auto"`` that chose to read in the calling thread seeds each batch as a worker's
    (its batches are those of its workers, wherever they were read) and puts the caller's
    generators back after each: the training step draws what it draws beside torch's
    workers."""

    def auto_inline():
        dl = DataLoader(DrawingRows(), batch_size=3, num_workers="auto")
        dl.loader.inline = True  # the shape choice's verdict (made in tests/test_faststart.py)
        return dl

    torch_steps = _epoch_and_steps(
        lambda: torch.utils.data.DataLoader(DrawingRows(), batch_size=3, num_workers=2)
    )[1]
    batches, steps = _epoch_and_steps(auto_inline)
    assert_same(torch_steps, steps)
    workers = _epoch_and_steps(lambda: DataLoader(DrawingRows(), batch_size=3, num_workers=2))
    assert_same(workers[0], batches)
