"""Every source resumes exactly from a saved state, under any worker count (tests/_save_load.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from examples.dlrm.criteo import CriteoSource
from tests._save_load import check_save_load
from torchtune_pipe import (
    DataLoader,
    IterableDatasetSource,
    LineFileSource,
    MapDatasetSource,
    NodeSource,
    Pipeline,
)

CRITEO = Path(__file__).parent / "data" / "criteo" / "sample_train.txt"


class Squares(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"i": i, "x": torch.tensor([i, i * i])}


class Counter(IterableDataset):
    """Shards itself by worker info, as torch documents."""

    def __iter__(self):
        info = get_worker_info()
        shard, shards = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(shard, 17, shards))


def _double(x):
    return 2 * x


def _loader(source_factory, workers, stages=lambda p: p):
    """A Loader over a fresh source: ``workers`` source workers, or inline for 0."""
    if workers == 0:
        return stages(Pipeline.from_source(source_factory())).loader(inline=True)
    pipe = Pipeline.from_source(source_factory(), workers=workers, max_workers=2)
    return stages(pipe).loader(ordered=True)


@pytest.mark.slow
def test_map_style_dataset_shuffled_and_batched():
    def source():
        generator = torch.Generator().manual_seed(7)
        return MapDatasetSource(Squares(), shuffle=True, generator=generator, entries_per_unit=3)

    check_save_load(lambda w: _loader(source, w, lambda p: p.batch(3)))


@pytest.mark.slow
def test_map_style_dataset_through_the_drop_in_dataloader():
    def make(workers):
        generator = torch.Generator().manual_seed(3)
        return DataLoader(
            Squares(), batch_size=3, shuffle=True, generator=generator, num_workers=workers
        )

    check_save_load(make)


@pytest.mark.slow
def test_iterable_dataset():
    check_save_load(lambda w: _loader(lambda: IterableDatasetSource(Counter(), shards=3), w))


def test_torchdata_node():
    from torchdata.nodes import IterableWrapper

    check_save_load(lambda w: _loader(lambda: NodeSource(IterableWrapper(range(13))), w))


@pytest.fixture
def line_files(tmp_path):
    paths = []
    for f in range(3):
        path = tmp_path / f"part_{f}.tsv"
        path.write_text("".join(f"{f}\t{i}\n" for i in range(9)))
        paths.append(str(path))
    return paths


@pytest.mark.slow
def test_line_files_with_shuffled_units(line_files):
    def source():
        return LineFileSource(line_files, chunk_bytes=16, shuffle_units=True, seed=5)

    check_save_load(
        lambda w: _loader(source, w, lambda p: p.map(_double, workers=max(w, 1)).batch(4))
    )


@pytest.mark.slow
def test_criteo_source_of_the_dlrm_example():
    def source():
        return CriteoSource(str(CRITEO), chunk_rows=8, chunk_bytes=4096)

    check_save_load(lambda w: _loader(source, w))
