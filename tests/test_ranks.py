"""Loaders under torch.distributed end every rank's epoch together (even_ranks)."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch.distributed as dist

from torchtune_pipe import Pipeline
from torchtune_pipe.sources.base import MapDatasetSource

ITEMS = 70  # units of 8 entries: rank 0 gets units 0,2,...,8 (38 items), rank 1 32 items


class Squares:
    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> int:
        return i * i


def _rank_main(rank: int, init_file: str, out_dir: str, inline: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        src = MapDatasetSource(Squares(), entries_per_unit=8, rank=rank, world_size=2)
        pipe = Pipeline.from_source(src).batch(4, collate=None)
        with pipe.loader(inline=inline, ordered=True, timeout_s=60) as loader:
            report = {"len": len(loader), "source_len": len(src), "epochs": []}
            for epoch in range(2):
                loader.set_epoch(epoch)
                batches = [list(b) for b in loader]
                report["epochs"].append(
                    {"batches": batches, "dropped": loader.last_epoch_dropped,
                     "finished": loader.state_dict()["finished"]}
                )  # fmt: skip
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _run_two_ranks(tmp_path: Path, inline: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    init = tmp_path / "init"
    procs = [
        ctx.Process(target=_rank_main, args=(r, str(init), str(tmp_path), inline)) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("inline", [False, True])
def test_uneven_ranks_stop_together_and_count_what_they_drop(tmp_path, inline):
    r0, r1 = _run_two_ranks(tmp_path, inline)
    assert (r0["source_len"], r1["source_len"]) == (38, 32)
    assert r0["len"] == r1["len"] == 8  # the shortest rank's 32 items in batches of 4
    for e0, e1 in zip(r0["epochs"], r1["epochs"], strict=True):
        assert len(e0["batches"]) == len(e1["batches"]) == 8
        assert e0["finished"] and e1["finished"]
        got0 = [x for b in e0["batches"] for x in b]
        got1 = [x for b in e1["batches"] for x in b]
        assert not set(got0) & set(got1)
        assert len(set(got0)) == len(got0) and len(set(got1)) == len(got1)
        # Rank 0 had 10 batches (9 full, 1 of 2): two dropped and counted; rank 1 none.
        assert (e0["dropped"], e1["dropped"]) == (2, 0)
        assert len(got0) + 4 + 2 == 38


def test_even_ranks_true_without_a_process_group_is_an_error():
    src = MapDatasetSource(Squares())
    loader = Pipeline.from_source(src).loader(inline=True, even_ranks=True)
    with pytest.raises(RuntimeError, match="even_ranks=True needs torch.distributed"):
        next(iter(loader))
    loader.close()


def test_rank_lengths_follow_the_unit_deal():
    src = MapDatasetSource(Squares(), entries_per_unit=8, rank=1, world_size=3)
    assert src.rank_lengths() == [24, 24, 22]
    assert len(src) == 24
    assert sum(src.rank_lengths()) == ITEMS
