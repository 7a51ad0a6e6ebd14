"""Source adapters: map-style and iterable datasets, torchdata nodes, datapipes, line files."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from torchtune_pipe import (
    IterableDatasetSource,
    LineFileSource,
    MapDatasetSource,
    NodeSource,
    Pipeline,
    Source,
    SourceError,
    as_source,
)
from torchtune_pipe.sources.base import read_indexed


class Table(Dataset):
    def __init__(self, n=10):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i * 10


class Batched(Table):
    def __getitems__(self, idx):
        return [("many", i) for i in idx]


class Sharded(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        if info is None:
            return iter([("main", 0)])
        return iter([(info.id, info.num_workers, type(info.dataset).__name__)])


def test_map_source_units_follow_the_sampler_and_shard_by_rank():
    src = MapDatasetSource(Table(), batch_size=3, entries_per_unit=2)
    units = src.units()
    assert [u.entries for u in units] == [([0, 1, 2], [3, 4, 5]), ([6, 7, 8], [9])]
    assert list(src.read(units[1])) == [[60, 70, 80], [90]]
    assert list(read_indexed(src, units[0], frozenset({0}))) == [(1, [30, 40, 50])]
    r1 = MapDatasetSource(Table(), rank=1, world_size=2, entries_per_unit=1).units()
    assert [u.id for u in r1] == [1, 3, 5, 7, 9]
    # Unbatched, a unit holds a frame's worth of samples by default (not one sample each).
    (whole,) = MapDatasetSource(Table()).units()
    assert list(whole.entries) == list(range(10))
    assert len(src) == 4 and isinstance(src, Source)
    assert list(MapDatasetSource(Batched(), batch_size=2).read(src.units()[0]))[0][0] == ("many", 0)


@pytest.mark.parametrize("batch_size", [None, 1, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("per_unit", [1, 2, 5])
def test_torchs_own_samplers_give_the_units_a_batch_by_batch_draw_does(
    batch_size, shuffle, drop_last, per_unit
):
    """torch's BatchSampler over its Random or Sequential sampler is cut into units from the
    whole order at once; the units, their seeds and the generators after the draw are those of
    drawing batch after batch from the sampler (any other sampler is drawn that way)."""
    from torchtune_pipe.sources import map_dataset

    def draw(plain):
        torch.manual_seed(3)
        g = torch.Generator().manual_seed(11)
        src = MapDatasetSource(
            Table(), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
            generator=g, entries_per_unit=per_unit, seed_units=True,
        )  # fmt: skip
        saved, cut = map_dataset._plain_batches, []
        map_dataset._plain_batches = lambda *a: (
            cut.append(saved(*a)) or (cut[-1] if plain else None)
        )
        try:
            units = [src.units(epoch) for epoch in range(2)]
        finally:
            map_dataset._plain_batches = saved
        assert None not in cut  # torch's own samplers: the fast path applies
        return units, g.get_state(), torch.get_rng_state()

    fast, slow = draw(True), draw(False)
    assert [[(u.id, list(u.entries), u.seed) for u in e] for e in fast[0]] == [
        [(u.id, list(u.entries), u.seed) for u in e] for e in slow[0]
    ]
    assert all(type(u.entries) is map_dataset.PackedEntries for e in fast[0] for u in e)
    assert torch.equal(fast[1], slow[1]) and torch.equal(fast[2], slow[2])
    entries = [list(u.entries) for u in fast[0][0]]
    flat = [i for e in entries for x in e for i in (x if batch_size else [x])]
    assert len(flat) == (10 - 10 % batch_size if batch_size and drop_last else 10)
    assert sorted(flat) == sorted(set(flat))  # each index once


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.utils.data.RandomSampler(range(10)),
        lambda: torch.utils.data.RandomSampler(
            range(10), generator=torch.Generator().manual_seed(1)
        ),
        lambda: torch.utils.data.RandomSampler(range(10), num_samples=25),
        lambda: torch.utils.data.RandomSampler(range(10), num_samples=20),
        lambda: torch.utils.data.RandomSampler(
            range(10), num_samples=7, generator=torch.Generator().manual_seed(2)
        ),
        lambda: torch.utils.data.RandomSampler(range(1)),
        lambda: torch.utils.data.SequentialSampler(range(13)),
    ],
)
def test_an_order_drawn_whole_is_the_one_iterating_the_sampler_gives(make):
    """torch's own Random (without replacement) and Sequential samplers' order, drawn whole,
    is the order iterating them to the end gives, and leaves the global generator and the
    sampler's own as iterating them does (the seed drawn where it has none, the permutation
    drawn for the rest even when nothing of it is kept)."""
    from array import array

    from torchtune_pipe.sources.orders import drawn_order

    def draw(whole):
        torch.manual_seed(5)
        s = make()
        order = drawn_order(s) if whole else array("q", iter(s))
        own = getattr(s, "generator", None)
        return list(order), own.get_state() if own is not None else None, torch.get_rng_state()

    whole, one_by_one = draw(True), draw(False)
    assert whole[0] == one_by_one[0]
    assert (whole[1] is None) == (one_by_one[1] is None)
    assert whole[1] is None or torch.equal(whole[1], one_by_one[1])
    assert torch.equal(whole[2], one_by_one[2])
    assert drawn_order(torch.utils.data.RandomSampler(range(4), replacement=True)) is None


def test_map_source_units_hold_int_indices_packed_and_give_them_back_as_the_sampler_did():
    import pickle

    import numpy as np

    from torchtune_pipe.sources.map_dataset import PackedEntries

    batched = MapDatasetSource(Table(), batch_size=3, entries_per_unit=2).units()
    assert all(isinstance(u.entries, PackedEntries) for u in batched)
    entries = batched[1].entries
    assert [type(e) for e in entries] == [list, list] and entries[-1] == [9]
    assert [type(i) for i in entries[0]] == [int] * 3
    assert pickle.loads(pickle.dumps(entries)) == entries == ([6, 7, 8], [9])
    (whole,) = MapDatasetSource(Table(), shuffle=True).units()
    assert isinstance(whole.entries, PackedEntries) and sorted(whole.entries) == list(range(10))
    assert all(type(i) is int for i in whole.entries) and whole.entries[-1] in range(10)
    # A sampler of keys that are not ints (numpy ints, names) hands them over unchanged.
    keys = [np.int64(3), np.int64(1)]
    (unit,) = MapDatasetSource(Table(), sampler=keys).units()
    assert not isinstance(unit.entries, PackedEntries)
    assert [type(i) for i in unit.entries] == [np.int64, np.int64]
    (named,) = MapDatasetSource({"a": 1, "b": 2}, sampler=["b", "a"]).units()
    assert list(MapDatasetSource({"a": 1, "b": 2}, sampler=["b", "a"]).read(named)) == [2, 1]


def test_map_source_replays_a_shuffled_order_from_its_state():
    g = torch.Generator().manual_seed(1)
    src = MapDatasetSource(Table(), shuffle=True, generator=g)
    first = [u.entries for u in src.units()]
    state = src.units_state()
    second = [u.entries for u in src.units()]
    assert first != second  # the generator advanced, as torch's would
    src.load_units_state(state)
    assert [u.entries for u in src.units()] == first


def test_map_source_validates_arguments():
    with pytest.raises(ValueError, match="sampler is mutually exclusive with shuffle"):
        MapDatasetSource(Table(), sampler=[0, 1], shuffle=True)
    with pytest.raises(ValueError, match="batch_size"):
        MapDatasetSource(Table(), batch_size=0)
    with pytest.raises(TypeError, match="__getitem__"):
        MapDatasetSource(3)


def test_iterable_source_sets_worker_info_per_shard():
    src = IterableDatasetSource(Sharded(), shards=3)
    got = [x for u in src.units() for x in src.read(u)]
    assert got == [(0, 3, "Sharded"), (1, 3, "Sharded"), (2, 3, "Sharded")]
    assert get_worker_info() is None  # restored after reading
    one = IterableDatasetSource(Sharded())
    assert list(one.read(one.units()[0])) == [("main", 0)]


def test_iterable_source_batches_per_shard_with_drop_last():
    src = IterableDatasetSource(range_ds(7), batch_size=3, drop_last=True)
    assert list(src.read(src.units()[0])) == [[0, 1, 2], [3, 4, 5]]


class range_ds(IterableDataset):  # noqa: N801
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def test_iterdatapipe_still_exists_and_is_sharded():
    from torch.utils.data.datapipes.iter import IterableWrapper

    dp = IterableWrapper(range(6)).sharding_filter()
    src = as_source(dp)
    assert isinstance(src, IterableDatasetSource)
    src = IterableDatasetSource(dp, shards=2)
    assert [list(src.read(u)) for u in src.units()] == [[0, 2, 4], [1, 3, 5]]


def test_torchdata_node_source_resets_each_read():
    from torchdata.nodes import IterableWrapper

    src = as_source(IterableWrapper(range(4)))
    assert isinstance(src, NodeSource)
    unit = src.units()[0]
    assert list(src.read(unit)) == [0, 1, 2, 3]
    assert list(src.read(unit)) == [0, 1, 2, 3]


def test_as_source_dispatch_and_rejection():
    assert isinstance(as_source(Table()), MapDatasetSource)
    assert isinstance(as_source(range_ds(2)), IterableDatasetSource)
    with pytest.raises(TypeError, match="as_source"):
        as_source(42)


def _parse_int(line: bytes) -> int:
    return int(line)


@pytest.fixture
def corrupt_file(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("1\n2\n3\nthree\n5\n6\n")
    return str(path)


def test_corrupt_line_is_reported_with_file_and_line_through_the_workers(corrupt_file):
    pipe = Pipeline.from_source(LineFileSource(corrupt_file, parse=_parse_int, chunk_bytes=4))
    with pipe.loader(ordered=True) as loader, pytest.raises(SourceError) as info:
        list(loader)
    assert info.value.path == corrupt_file and info.value.line == 4
    assert f"{corrupt_file}:4" in str(info.value)


def test_corrupt_line_is_skipped_and_counted_when_asked(corrupt_file):
    skipped = []
    src = LineFileSource(corrupt_file, parse=_parse_int, on_error="skip", on_skip=skipped.append)
    with Pipeline.from_source(src).loader(inline=True) as loader:
        assert list(loader) == [1, 2, 3, 5, 6]
    assert [(s.line, s.path) for s in skipped] == [(4, corrupt_file)]
