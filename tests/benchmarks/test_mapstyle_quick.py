"""The map-style benchmark's contenders deliver the same rows (a smoke test, not a timing)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import _mapstyle_fns, mapstyle


@pytest.mark.parametrize(
    "tool, workers",
    [("dataloader", 0), ("dataloader", 2), ("nodes-thread", 2), ("torchtune_pipe", -1)],
)
def test_every_tool_delivers_every_row_once(tool, workers):
    spec = dict(mapstyle.SCENARIOS["remote-map"], rows=96, wait_s=0.0005, tool=tool,
                workers=workers)  # fmt: skip
    epochs, stop = _mapstyle_fns.build(spec)
    try:
        labels = torch.cat([y for _, y in epochs(0)])
    finally:
        if stop is not None:
            stop()
    assert sorted(labels.tolist()) == list(range(96))


def test_summary_compares_against_each_peers_best_setting():
    def run(tool, rate):
        return [{"tool": tool, "samples_per_s": rate, "startup_s": 0.1, "peak_pss_mib": 100.0}]

    runs = {
        "dataloader-w2": run("dataloader", 100.0),
        "dataloader-w16": run("dataloader", 400.0),
        "nodes-thread-w16": run("nodes-thread", 300.0),
        mapstyle.OURS: run("torchtune_pipe", 200.0),
    }
    rows = mapstyle.summarize("remote-map", runs)
    assert mapstyle.best_of(rows, "dataloader")["contender"] == "dataloader-w16"
    ours = next(r for r in rows if r["contender"] == mapstyle.OURS)
    assert ours["ours_vs_this"] == 1.0
    assert next(r for r in rows if r["contender"] == "dataloader-w2")["ours_vs_this"] == 2.0
