"""Each reader of the consumer's process that stands in for a worker reads a dataset of its own
(``torchtune_pipe.sources.views``): what a read sets on it stays that reader's."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import pickle
import sys
import threading

import pytest
from torch.utils.data import ConcatDataset, Dataset, Subset

from torchtune_pipe import DataLoader
from torchtune_pipe.sources.views import Views, get_in_view, standing_in

_handles = itertools.count()


class Opens(Dataset):
    """Sets an attribute at its first read (as a file opened on first use is kept)."""

    def __init__(self) -> None:
        self.handle = None
        self.scale = 1

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, int]:
        if self.handle is None:
            self.handle = next(_handles)
        return self.handle, i * self.scale


def _read_on_threads(views: Views, n: int) -> list[tuple[int, int]]:
    out: list = [None] * n

    def read(k: int) -> None:
        with standing_in():
            out[k] = views.get()[k]

    threads = [threading.Thread(target=read, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_readers_standing_in_set_nothing_on_the_dataset_nor_on_each_other():
    ds = Opens()
    views = Views(ds)
    views.renew()
    got = _read_on_threads(views, 4)
    assert len({handle for handle, _ in got}) == 4  # each thread opened its own
    assert ds.handle is None  # the caller's dataset: untouched
    assert views.get() is ds  # a read that stands in for no worker reads the dataset itself


def test_datasets_held_by_a_dataset_are_copied_and_other_attributes_shared():
    inner = Opens()
    ds = Subset(ConcatDataset([inner, Opens()]), [0, 9, 3])
    views = Views(ds)
    with standing_in():
        view = views.get()
        assert view[0][1] == 0
    assert view is not ds and view.dataset is not ds.dataset
    assert view.dataset.datasets[0] is not inner and inner.handle is None
    assert view.indices is ds.indices  # not a dataset: shared
    assert view.dataset.cumulative_sizes is ds.dataset.cumulative_sizes


def test_a_new_generation_sees_what_the_caller_changed_and_a_view_is_kept_within_one():
    ds = Opens()
    views = Views(ds)
    views.renew()
    with standing_in():
        first = views.get()
        first[0]
        ds.scale = 3  # between epochs; no new snapshot: the generation's view stays
        assert views.get() is first and views.get()[2][1] == 2
        views.renew()  # the next epoch's snapshot
        second = views.get()
        assert second is not first and second.handle is None  # no read's handle in it
        assert second[2] == (second.handle, 6) and second.handle != first.handle


def test_what_is_no_dataset_is_read_as_it_is_and_calls_on_threads_read_views():
    rows = list(range(10))
    views = Views(rows)
    with standing_in():
        assert views.get() is rows  # a list (or an array) is never copied
    ds = Opens()
    views = Views(ds)
    views.get()
    assert views._template is None  # no snapshot, no reader standing in: nothing copied
    views.generation = 1  # a worker process's (its loader took a snapshot; spawned, no template)
    views.get()  # its first read makes the template, before any read sets anything
    ds[0]  # this reader (the worker process's own) opens it on the dataset itself
    handles = set()
    for k in range(3):
        t = threading.Thread(target=lambda k=k: handles.add(get_in_view(views, k)[0]))
        t.start()
        t.join()
    assert len(handles) == 3 and ds.handle not in handles


def test_a_pickled_views_takes_the_dataset_and_its_generation_only():
    views = Views(Opens())
    views.renew()
    views.renew()
    back = pickle.loads(pickle.dumps(views))
    assert back.generation == 2 and isinstance(back.dataset, Opens)
    assert back._template is None


class Slotted(Dataset):
    __slots__ = ("rows", "__handle")

    def __init__(self) -> None:
        self.rows = [1, 2]
        self.__handle = None

    def __getitem__(self, i: int) -> int:
        return self.rows[i]


@dataclasses.dataclass
class Fields(Dataset):
    path: str
    lower: bool = True  # a class attribute the object holds too
    cache: dict = dataclasses.field(default_factory=dict)

    def __getitem__(self, i: int) -> str:
        return self.path

    @functools.cached_property
    def size(self) -> int:
        return len(self.path)


class OwnCopy(Opens):
    def __getstate__(self) -> dict:
        return {**self.__dict__, "scale": 5}


def _inline(obj: object, value: object) -> bool:
    """Whether ``value`` is held by ``obj`` as an attribute of its own, not through a
    ``__dict__`` CPython made for it (which slows every attribute load on it and its forks)."""
    return any(r is value for r in gc.get_referents(obj))


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's inline attributes")
def test_a_copy_holds_every_attribute_and_the_dataset_keeps_its_attributes_inline():
    slotted, fields, cached, extra = Slotted(), Fields("p"), Fields("q"), Opens()
    cached.size  # noqa: B018 -- cached_property stores it through the object's __dict__
    extra.tag = "set from outside the class"  # type: ignore[attr-defined]
    for ds, attrs in [
        (slotted, {"rows": slotted.rows, "_Slotted__handle": None}),
        (fields, {"path": "p", "lower": True, "cache": fields.cache}),
        (cached, {"path": "q", "lower": True, "cache": cached.cache, "size": 1}),
        (extra, {"handle": None, "scale": 1, "tag": extra.tag}),
    ]:
        views = Views(ds)
        views.renew()
        with standing_in():
            view = views.get()
        assert view is not ds and type(view) is type(ds)
        assert {k: getattr(view, k) for k in attrs} == attrs
        for k, v in attrs.items():
            assert getattr(view, k) is v or v is None or isinstance(v, int)
    assert _inline(slotted, slotted.rows) and _inline(fields, fields.cache)
    # a class that copies itself its own way is copied its way
    views = Views(OwnCopy())
    with standing_in():
        assert views.get()[2][1] == 10


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's inline attributes")
@pytest.mark.parametrize("num_workers", [2, "auto"])
def test_a_loader_with_workers_leaves_the_datasets_attributes_inline(num_workers):
    ds = Subset(ConcatDataset([Opens(), Opens()]), list(range(16)))
    inner = ds.dataset.datasets[0]
    loader = DataLoader(ds, batch_size=4, num_workers=num_workers)
    for _ in range(2):
        assert [x for b in loader for x in b[1].tolist()] == [i % 8 for i in range(16)]
    assert _inline(ds, ds.indices) and _inline(inner, inner.scale) and inner.handle is None
