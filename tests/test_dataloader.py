"""Differential tests: torchtune_pipe.DataLoader yields what torch's DataLoader yields."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, Sampler, get_worker_info

import torchtune_pipe
from torchtune_pipe import DataLoader

from ._compare import assert_same


class Squares(Dataset):
    def __init__(self, n=23, kind="tensor"):
        self.n, self.kind = n, kind

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.kind == "dict":
            return {"x": torch.tensor([i, i * i]), "name": f"s{i}", "w": float(i) / 2}
        if self.kind == "tuple":
            return (torch.full((2,), i), i)
        if self.kind == "str":
            return f"item-{i}"
        if self.kind == "numpy":
            return np.arange(3) * i
        return torch.tensor(i * i)


class Evens(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return math.ceil(self.n / 2)


class Counting(IterableDataset):
    """Shards itself by worker info, as torch's documentation shows."""

    def __init__(self, n=17):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class Flaky(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 6:
            raise IndexError(f"bad sample {i}")
        return i


def _compare(dataset, workers=0, ours=None, **kw):
    seed = kw.pop("seed", None)
    kw_t, kw_o = dict(kw), {**kw, **(ours or {})}
    if seed is not None:
        kw_t["generator"] = torch.Generator().manual_seed(seed)
        kw_o["generator"] = torch.Generator().manual_seed(seed)
    torch_workers = 2 if workers == "auto" else workers
    expected = list(torch.utils.data.DataLoader(dataset, num_workers=torch_workers, **kw_t))
    with DataLoader(dataset, num_workers=workers, **kw_o) as loader:
        got = list(loader)
        assert len(loader) == len(expected) or isinstance(dataset, IterableDataset)
    assert len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)
    return got


@pytest.mark.parametrize("kind", ["tensor", "dict", "tuple", "str", "numpy"])
def test_sample_kinds_inline(kind):
    _compare(Squares(kind=kind), batch_size=4)


@pytest.mark.parametrize("workers", [0, 2, "auto"])
def test_shuffled_with_a_generator(workers):
    _compare(Squares(kind="dict"), workers, batch_size=5, shuffle=True, seed=11, drop_last=True)


def test_global_rng_shuffle_matches_when_seeded_alike():
    torch.manual_seed(5)
    expected = list(torch.utils.data.DataLoader(Squares(), batch_size=4, shuffle=True))
    torch.manual_seed(5)
    got = list(DataLoader(Squares(), batch_size=4, shuffle=True))
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_custom_sampler_batch_sampler_and_no_batching():
    _compare(Squares(kind="tuple"), 0, batch_size=3, sampler=Evens(23))
    _compare(Squares(), 0, batch_sampler=BatchSampler(Evens(23), 4, True))
    _compare(Squares(kind="numpy"), 0, batch_size=None)
    _compare(Squares(), 2, batch_sampler=BatchSampler(Evens(23), 4, False))


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_sharded_by_worker_info(workers):
    got = _compare(Counting(), workers, batch_size=3)
    assert sorted(int(x) for b in got for x in b) == list(range(17))


def _seed_offset(worker_id):
    get_worker_info().dataset.n = 9  # the worker's copy, set up as torch documents


def test_worker_init_fn_sees_worker_info():
    _compare(Counting(), 2, batch_size=2, worker_init_fn=_seed_offset)


@pytest.mark.parametrize("workers", [0, 2])
def test_exception_in_getitem_reaches_the_user_with_its_type(workers):
    it = iter(torch.utils.data.DataLoader(Flaky(), batch_size=2, num_workers=workers))
    with pytest.raises(IndexError, match="bad sample 6"):
        list(it)
    if workers:
        it._shutdown_workers()  # torch leaves its workers to the iterator's GC otherwise
    del it
    with DataLoader(Flaky(), batch_size=2, num_workers=workers) as loader:
        with pytest.raises(IndexError, match="bad sample 6"):
            list(loader)


def test_resume_mid_epoch_under_other_worker_counts():
    g = torch.Generator().manual_seed(2)
    with DataLoader(Squares(), batch_size=3, shuffle=True, generator=g, num_workers=2) as loader:
        full = list(loader)
    g = torch.Generator().manual_seed(2)
    with DataLoader(Squares(), batch_size=3, shuffle=True, generator=g, num_workers=1) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        state = loader.state_dict()
    g = torch.Generator().manual_seed(99)  # resumed order comes from the state, not this seed
    with DataLoader(
        Squares(), batch_size=3, shuffle=True, generator=g, num_workers="auto"
    ) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    for a, b in zip(full, head + rest, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_workers=-1),
        dict(timeout=-1),
        dict(prefetch_factor=2),
        dict(shuffle=True, sampler=Evens(4)),
        dict(batch_sampler=BatchSampler(Evens(4), 2, False), batch_size=3),
        dict(batch_size=None, drop_last=True),
        dict(persistent_workers=True),
    ],
)
def test_invalid_arguments_raise_like_torch(kw):
    with pytest.raises(ValueError):
        torch.utils.data.DataLoader(Squares(), **kw)
    with pytest.raises(ValueError):
        DataLoader(Squares(), **kw)


@pytest.mark.parametrize("kw", [{}, {"num_workers": 2}, {"num_workers": 2, "prefetch_factor": 4}])
def test_the_attributes_read_as_torchs(kw):
    """What scripts and frameworks read off a loader (``prefetch_factor * num_workers``
    batches ahead, a log line) has torch's values, defaults filled in as torch fills them."""
    names = ("batch_size", "drop_last", "num_workers", "timeout", "prefetch_factor",
             "persistent_workers", "pin_memory", "pin_memory_device", "in_order")  # fmt: skip
    want = torch.utils.data.DataLoader(Squares(), batch_size=4, **kw)
    with DataLoader(Squares(), batch_size=4, **kw) as got:
        assert {n: getattr(got, n) for n in names} == {n: getattr(want, n) for n in names}
        assert type(got.sampler) is type(want.sampler)
        assert type(got.batch_sampler) is type(want.batch_sampler)


def test_iterable_dataset_rejects_shuffle_like_torch():
    with pytest.raises(ValueError, match="shuffle"):
        DataLoader(Counting(), shuffle=True)


def test_not_a_torch_dataloader_subclass_but_has_its_attributes():
    loader = DataLoader(Squares(), batch_size=4, shuffle=True)
    assert not isinstance(loader, torch.utils.data.DataLoader)
    assert (
        loader.batch_size == 4 and loader.sampler is not None and loader.batch_sampler is not None
    )
    assert len(loader) == 6
    assert torchtune_pipe.DataLoader is DataLoader
    loader.close()


@pytest.mark.parametrize("tuner", ["intune", "plumber", "autotune"])
def test_any_tuner_with_an_integer_num_workers(tuner, caplog):
    # An integer num_workers is one stage; InTune ships no agent for one stage, so the
    # planner tunes it alone and says so once.
    with caplog.at_level(logging.INFO, "torchtune_pipe.tuning.intune.agent"):
        got = _compare(Squares(), 2, {"tuner": tuner, "tuning_interval_s": 0.01}, batch_size=4)
    assert len(got) == 6
    fallback = [r for r in caplog.records if "planner tunes" in r.getMessage()]
    assert len(fallback) == (tuner == "intune")


def test_weights_and_tuner_options_reach_the_tuner(tmp_path):
    from torchtune_pipe.tuning.intune.agent import weights_path

    with DataLoader(Squares(), batch_size=4, num_workers="auto", weights=weights_path(2),
                    tuner_options={"finetune": True}) as loader:  # fmt: skip
        tuner = loader.loader.tuner
        assert tuner.name == "intune" and tuner.finetune and tuner.weights == weights_path(2)
    with DataLoader(Squares(), batch_size=4, num_workers="auto", weights=tmp_path) as loader:
        with pytest.raises(FileNotFoundError, match="no pre-trained weights for 2 stages"):
            list(loader)
    with pytest.raises(ValueError, match="weights= is for tuner='intune'"):
        DataLoader(Squares(), num_workers=2, tuner="plumber", weights=tmp_path)


def test_auto_with_a_tensor_dataset_matches_torch():
    # Rows of a TensorDataset view the whole data tensor; between the fetch and the collate
    # stage each travels as the bytes it covers.
    data = torch.arange(4000.0).reshape(1000, 4)
    _compare(torch.utils.data.TensorDataset(data, data[:, 0]), "auto", batch_size=64)


class _RemoteRows(Dataset):
    """A remote read: waits 5 ms; a sample is ``(i, read start, read end)``. ``draws``:
    it also draws from torch's global generator (a random augmentation)."""

    def __init__(self, n=96, draws=False):
        self.n, self.draws = n, draws

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import time

        t0 = time.monotonic()
        time.sleep(0.005)
        noise = torch.rand(()).item() if self.draws else 0.0
        return (i, t0, time.monotonic(), noise)


def _fetch_pipe(ds, concurrency, seed=5):
    from torchtune_pipe import Pipeline
    from torchtune_pipe.sources.map_dataset import MapDatasetSource

    g = torch.Generator().manual_seed(seed)
    src = MapDatasetSource(ds, batch_size=4, shuffle=True, generator=g, seed_units=True)
    return Pipeline.from_source(src, concurrency=concurrency, max_concurrency=8)


def _fetched(ds, concurrency, seed=5):
    """Batches of 4 samples of ``ds`` as a fetch stage of one worker reads them."""
    with _fetch_pipe(ds, concurrency, seed).loader() as loader:
        return list(loader)


def test_a_fetch_worker_reads_several_batches_at_once_in_torchs_order():
    # Concurrency 8 over batches of 4: a fetch worker reads two batches side by side.
    g = torch.Generator().manual_seed(5)
    want = [b.tolist() for b in torch.utils.data.DataLoader(range(96), 4, True, generator=g)]
    got = _fetched(_RemoteRows(), 8)
    assert [[s[0] for s in b] for b in got] == want
    spans = [(min(s[1] for s in b), max(s[2] for s in b)) for b in got]
    assert sum(1 for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1]) >= 6


def test_batches_that_draw_random_numbers_are_read_one_at_a_time():
    # Side by side, two batches' draws from the global generator would interleave.
    one, eight = _fetched(_RemoteRows(draws=True), 1), _fetched(_RemoteRows(draws=True), 8)
    assert [[s[3] for s in b] for b in one] == [[s[3] for s in b] for b in eight]
    spans = [(min(s[1] for s in b), max(s[2] for s in b)) for b in eight]
    assert not any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))


def test_a_state_saved_while_batches_are_read_ahead_resumes_exactly():
    # Batches read ahead but not delivered when the state is saved are read again after it.
    full = [[x[0] for x in b] for b in _fetched(_RemoteRows(), 8)]
    with _fetch_pipe(_RemoteRows(), 8).loader() as loader:
        it = iter(loader)
        head = [[x[0] for x in next(it)] for _ in range(5)]
        state = loader.state_dict()
    with _fetch_pipe(_RemoteRows(), 8, seed=99).loader() as loader:
        loader.load_state_dict(state)
        rest = [[x[0] for x in b] for b in loader]
    assert head + rest == full


class Subclassed(DataLoader):
    def __init__(self, dataset, tag, **kw):
        super().__init__(dataset, **kw)
        self.tag = tag


@pytest.mark.parametrize("workers", [0, 2, "auto"])
def test_a_loader_pickles_and_deep_copies_as_torchs_after_its_epochs(workers):
    """torch's DataLoader pickles and deep-copies between epochs (Lightning's spawn
    strategies, an EMA copy of a module holding one): so does ours; the copy, built with the
    same arguments and what was set on it since, gives the same batches and starts its own
    workers."""
    import copy
    import pickle

    g = torch.Generator().manual_seed(4)
    data = torch.utils.data.TensorDataset(torch.arange(40.0))
    with Subclassed(data, "x", batch_size=8, shuffle=True, generator=g, num_workers=workers) as dl:
        assert len(list(dl)) == 5
        for make in (lambda: pickle.loads(pickle.dumps(dl)), lambda: copy.deepcopy(dl)):
            with make() as clone:
                assert isinstance(clone, Subclassed) and clone.tag == "x"
                assert clone.num_workers == dl.num_workers and clone.loader is not dl.loader
                again = list(clone)  # its generator: a copy of dl's after dl's last epoch
            assert_same(again, list(dl))


class Endless(Sampler):
    """An infinite sampler with no ``__len__`` (detectron2's ``TrainingSampler`` kind)."""

    def __iter__(self):
        while True:
            yield from range(10)


class _Own(Sampler):
    """A batch sampler of the user's: another's batches, its ``__len__`` raising as that's."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


class Unsized(Sampler):
    """A finite sampler with no ``__len__``."""

    def __iter__(self):
        return iter([3, 1, 4, 1, 5, 9, 2, 6])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_without_len_reads_as_torchs_and_an_endless_one_is_named(workers):
    """An epoch is planned whole when it starts: a finite sampler with no ``__len__`` gives
    torch's batches; an endless one is refused once it gave ten times the dataset's samples
    (instead of planning forever), naming the sampler and what to do."""
    ds = torch.utils.data.TensorDataset(torch.arange(10))
    want = list(torch.utils.data.DataLoader(ds, batch_size=3, sampler=Unsized()))
    with DataLoader(ds, batch_size=3, sampler=Unsized(), num_workers=workers) as dl:
        assert_same(list(dl), want)
        with pytest.raises(TypeError):
            len(dl)  # as torch's
    with DataLoader(ds, batch_size=3, sampler=Endless(), num_workers=workers) as dl:
        with pytest.raises(ValueError, match=r"sampler Endless has no __len__ .* than 100 "):
            next(iter(dl))
    endless_batches = BatchSampler(Endless(), 3, False)  # __len__ raises: its sampler has none
    with DataLoader(ds, batch_sampler=_Own(endless_batches), num_workers=workers) as dl:
        with pytest.raises(ValueError, match=r"sampler _Own has no __len__"):
            next(iter(dl))


@pytest.mark.parametrize(("cpus", "batches", "start"), [(8, 3, 3), (8, 20, 8), (2, 20, 2)])
def test_auto_starts_the_fetch_group_with_a_worker_per_cpu_or_per_batch(
    monkeypatch, cpus, batches, start
):
    """``"auto"`` starts the fetch group where the tuner starts it, a worker per CPU, but no
    more workers than an epoch has batches (a short validation loader on a many-core host)."""
    import torchtune_pipe.dataloader as dl

    monkeypatch.setattr(dl, "cpus_available", lambda: float(cpus))
    with DataLoader(Squares(n=4 * batches), batch_size=4, num_workers="auto") as loader:
        fetch = loader.loader.pipeline.stages[0]
        assert (fetch.name, fetch.workers, fetch.min_workers) == ("fetch", start, 1)
