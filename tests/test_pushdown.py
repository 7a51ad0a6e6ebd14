"""Batching moved into the source (torchtune_pipe.loader.pushdown): the same batches as the pipeline
as written, and the rewrite only where that holds."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from torchtune_pipe import Pipeline
from torchtune_pipe.sources.map_dataset import MapDatasetSource


class Squares(Dataset):
    def __init__(self, n: int = 103):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([i, i * i]), i


def _plus(row):
    x, i = row
    return x + 1, i


def _times(row):
    x, i = row
    return x * 2, i


def _fails_on_50(row):
    if row[1] == 50:
        raise ValueError("row 50 is bad")
    return row


def _kinds(loader) -> list[str]:
    return [s.kind for s in loader.pipeline.stages]


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


@pytest.mark.slow
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_rewritten_pipeline_delivers_the_batches_as_written(drop_last):
    def pipe() -> Pipeline:  # each loader its own sampler generator, seeded alike
        gen = torch.Generator().manual_seed(5)
        src = MapDatasetSource(Squares(), shuffle=True, generator=gen)
        return (
            Pipeline.from_source(src)
            .map(_plus, workers=2)
            .map(_times)
            .batch(8, drop_last=drop_last)
        )

    with (
        pipe().loader(ordered=True) as moved,
        pipe().loader(ordered=True, batch_at_source=False) as kept,
    ):
        assert _kinds(moved) == ["source", "map", "map", "map"]  # the batch stage collates
        assert _kinds(kept) == ["source", "map", "map", "batch"]
        assert len(moved) == len(kept) == (12 if drop_last else 13)
        for epoch in range(2):  # the sampler's order of each epoch, drawn the same way
            got, want = list(moved), list(kept)
            _same(got, want)
            assert epoch == 1 or got[0][1].tolist() != list(range(8))  # shuffled


def test_a_resumed_rewritten_pipeline_delivers_the_rest_of_the_epoch():
    pipe = Pipeline.from_source(Squares()).map(_plus).batch(10)
    with pipe.loader(ordered=True) as loader:
        want = list(loader)
    with pipe.loader(ordered=True) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(4)]
        state = loader.state_dict()
    with pipe.loader(ordered=True) as loader:
        loader.load_state_dict(state)
        _same(head + list(loader), want)


@pytest.mark.parametrize(
    "build",
    [
        lambda p: p.map(_plus, on_error="skip").batch(8),  # a skipped row would shorten a batch
        lambda p: p.shuffle(16).batch(8),  # a stateful stage before the batch
        lambda p: p.map(_plus, max_concurrency=4).batch(8),  # calls a row at a time in threads
        lambda p: p.map(_plus),  # nothing to batch
    ],
    ids=["skip", "shuffle", "concurrency", "no-batch"],
)
def test_pipelines_whose_batches_could_differ_run_as_written(build):
    pipe = build(Pipeline.from_source(Squares()))
    with pipe.loader() as loader:
        assert loader.pipeline is pipe


def test_sharded_or_seeded_sources_run_as_written():
    for src in (
        MapDatasetSource(Squares(), rank=1, world_size=2),
        MapDatasetSource(Squares(), seed_units=True),
    ):
        pipe = Pipeline.from_source(src).map(_plus).batch(8)
        with pipe.loader() as loader:
            assert loader.pipeline is pipe


def test_an_error_in_a_map_names_the_sample_in_its_batch():
    pipe = Pipeline.from_source(Squares()).map(_fails_on_50, name="check").batch(8)
    with pipe.loader(ordered=True) as loader, pytest.raises(ValueError, match="row 50") as e:
        list(loader)
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "sample 2 of 8 of the batch" in notes and "'check'" in notes
