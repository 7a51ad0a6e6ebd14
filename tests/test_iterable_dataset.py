"""Streaming datasets in the drop-in DataLoader: an ``IterableDataset`` split by
``get_worker_info()`` has its shards read side by side from the first batch, each batch
travels as soon as it is made, the fetch stage never runs more workers than shards whatever
the tuner, and the batches are torch's."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tests._compare import assert_same
from torchtune_pipe import DataLoader
from torchtune_pipe.sources.base import IterableDatasetSource, frame_items, max_readers
from torchtune_pipe.telemetry.measure import cpus_available
from torchtune_pipe.tuning.base import Allocation


class TimedShards(IterableDataset):
    """Shard ``i`` yields ``[i, k, t]`` at ``step_s`` a sample, ``t`` the monotonic time it
    was made (one clock for every process)."""

    def __init__(self, items: int = 16, step_s: float = 0.05):
        self.items = items
        self.step_s = step_s

    def __iter__(self):
        info = get_worker_info()
        i = 0 if info is None else info.id
        for k in range(self.items):
            time.sleep(self.step_s)  # a read that takes its time (a remote shard)
            yield torch.tensor([i, k, time.monotonic()], dtype=torch.float64)


class CountedShards(IterableDataset):
    """Shard ``i`` yields ``[i, k]`` at ``step_s`` a sample, and writes how many batches of
    ``batch`` it has made to a file after each one: the consumer reads how far a shard had
    gone when its first batch arrived."""

    def __init__(self, folder: str, batches: int = 30, batch: int = 2, step_s: float = 0.02):
        self.folder = folder
        self.batches = batches
        self.batch = batch
        self.step_s = step_s

    def __iter__(self):
        info = get_worker_info()
        i = 0 if info is None else info.id
        made = os.path.join(self.folder, f"made-{i}")
        for k in range(self.batches * self.batch):
            time.sleep(self.step_s)  # a read that takes its time (a remote shard)
            if k % self.batch == 0 and k:
                _write(made, k // self.batch)
            yield torch.tensor([i, k])
        _write(made, self.batches)


def _write(path: str, n: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(n))
    os.replace(tmp, path)


def _auto_shards() -> int:
    return max(1, round(cpus_available()))


def test_the_source_declares_its_shards_as_its_bound_and_a_batch_per_frame():
    ds = TimedShards()
    assert max_readers(IterableDatasetSource(ds, shards=3)) == 3
    assert frame_items(IterableDatasetSource(ds, shards=3, batch_size=4)) == 1
    assert frame_items(IterableDatasetSource(ds, shards=3)) is None  # samples: grouped
    assert max_readers(range(3)) is None


@pytest.mark.parametrize("workers", [2, 3, "auto"])
def test_shards_are_read_side_by_side_from_the_first_batch(workers):
    # Every shard's first sample is made before any shard's 10th: no shard waits for
    # another to be read first (as when "auto" started one worker for two shards).
    with DataLoader(TimedShards(), batch_size=2, num_workers=workers) as loader:
        rows = torch.cat(list(loader))
    shards = _auto_shards() if workers == "auto" else workers
    made = {i: rows[rows[:, 0] == i] for i in range(shards)}
    assert all(len(m) == 16 for m in made.values())
    first = max(float(m[0, 2]) for m in made.values())
    tenth = min(float(m[9, 2]) for m in made.values())
    assert first < tenth, f"a shard started {first - tenth:.2f} s after another's 10th sample"


@pytest.mark.parametrize("workers", [2, "auto"])
def test_a_shards_first_batch_arrives_within_a_few_of_its_batch_times(tmp_path, workers):
    # A batch travels as it is made: when a shard's first batch arrives, the shard has made
    # only a few more (each takes 40 ms). Framed with the next ones, it came with all 30.
    ds = CountedShards(str(tmp_path))
    seen: dict[int, int] = {}
    with DataLoader(ds, batch_size=2, num_workers=workers) as loader:
        for b in loader:
            i = int(b[0, 0])
            if i not in seen:
                path = tmp_path / f"made-{i}"
                seen[i] = int(path.read_text()) if path.exists() else 0
    assert seen and max(seen.values()) <= 5, seen


class Counting(IterableDataset):
    """Shards itself by worker info, as torch's documentation shows."""

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, 37, step))


def test_auto_matches_torch_with_a_worker_per_core():
    want = list(torch.utils.data.DataLoader(Counting(), batch_size=3, num_workers=_auto_shards()))
    with DataLoader(Counting(), batch_size=3, num_workers="auto") as loader:
        got = list(loader)
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)


class Greedy:
    """A tuner that asks every stage for 8 workers, split, every step."""

    def reset(self, obs, start=None) -> Allocation:
        return self.step(obs)

    def step(self, obs) -> Allocation:
        n = len(obs.stages)
        return Allocation((8,) * n, tuple(s.buffer_bytes for s in obs.stages), fused=(False,) * n)


@pytest.mark.parametrize("tuner", [Greedy(), "intune"])
def test_no_tuner_grows_the_fetch_stage_past_its_shards(tmp_path, tuner):
    log = tmp_path / "tuning.jsonl"
    ds = CountedShards(str(tmp_path), batches=20, step_s=0.01)
    with DataLoader(
        ds, batch_size=2, num_workers="auto", tuner=tuner, tuning_interval_s=0.05,
        tuning_log=str(log),
    ) as loader:  # fmt: skip
        n = sum(1 for _ in loader)
    shards = _auto_shards()
    assert n == 20 * shards
    records = [json.loads(line) for line in log.read_text().splitlines()]
    fetch = [r["obs"]["stages"][0] for r in records if "obs" in r]
    assert fetch, "the tuner never stepped"
    assert all(s["max_workers"] == shards for s in fetch)
    assert all(shards == s["workers"] for s in fetch)  # never fewer either: all side by side
