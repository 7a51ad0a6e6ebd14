"""`torchtune-pipe report`: the demo's tuning log as a PNG naming every stage."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402  (matplotlib's own dependency)

from torchtune_pipe.tools import (
    demo,
    report,  # noqa: E402
)


def test_report_png_from_the_demo_names_every_stage(tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo.main(["--time-budget-s", "3", "--rows", "3000", "--val-rows", "500",
                      "--interval-s", "0.2", "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "held-out AUROC" in text and "torchtune-pipe report" in text
    log = out / "tuning.jsonl"
    assert report.main([str(log), "-o", str(tmp_path / "tuning.png")]) == 0
    png = tmp_path / "tuning.png"
    assert png.stat().st_size > 10_000
    with Image.open(png) as im:
        assert im.size == (1000, 1300)
        assert im.text["Stages"] == "fetch,collate"  # every stage has a line in the panels
    drawn = report.plot(log, tmp_path / "again.png")
    assert drawn.stages == ("fetch", "collate") and drawn.decisions >= 3
    assert drawn.unit == "batches" and drawn.ranks == (0,)  # a DataLoader's consumer
    assert drawn.data_wait_share[0] is not None
    assert "training waits for data" in capsys.readouterr().out


def test_report_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    log = tmp_path / "tuning.jsonl"
    log.write_text('{"t": 0, "obs": {}}\n')
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    assert report.main([str(log)]) == 2
    assert "pip install 'torchtune-pipe[plot]'" in capsys.readouterr().err


def test_report_of_a_log_without_decisions(tmp_path, capsys):
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    assert report.main([str(log)]) == 2
    assert "holds no tuning decision" in capsys.readouterr().err


def _decision(t, rank, throughput, step_s, share, fused):
    stage = {"busy": 0.5, "buffer_bytes": 1 << 20}
    return {
        "t": t, "rank": rank, "unit": "batches", "tuner": "intune", "step": int(t),
        "applied": True,
        "obs": {"throughput": throughput, "cpus": 2, "memory_limit_bytes": 1 << 30,
                "memory_used_bytes": 1 << 20, "consumer_step_s": step_s,
                "data_wait_share": share,
                "stages": [{"name": "fetch", "workers": 2, **stage},
                           {"name": "collate", "workers": 0 if fused else 1, "fused": fused,
                            **stage}]},
        "allocation": {"workers": [2, 1], "buffer_bytes": [1 << 20, 1 << 20],
                       "fused": [False, fused]},
    }  # fmt: skip


def test_report_per_rank_with_a_spike_clipped_and_fused_stages_at_zero(tmp_path, capsys):
    # Two ranks in one log: rank 0 keeps up (2% waiting), rank 1 is stalled on data (70%);
    # one interval of rank 0 delivered 50x the others; collate runs fused, then split.
    records = [
        _decision(t, rank, 5000.0 if (rank, t) == (0, 3) else 100.0, 0.01,
                  0.02 if rank == 0 else 0.7, fused=t < 5)
        for t in range(10) for rank in (0, 1)
    ]  # fmt: skip
    log = tmp_path / "tuning.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.running_workers(records[0]) == [2, 0]  # fused: no workers of its own
    assert report.running_workers(records[-1]) == [2, 1]
    drawn = report.plot(log)
    assert drawn.path == log.with_suffix(".png") and drawn.path.stat().st_size > 10_000
    assert drawn.ranks == (0, 1) and drawn.unit == "batches"
    assert drawn.data_wait_share == {0: pytest.approx(0.02), 1: pytest.approx(0.7)}
    assert drawn.clipped == ("throughput",)  # the spike; the other panels keep their scale
    assert report.clip_top([100.0] * 9 + [5000.0]) == pytest.approx(125.0)
    assert report.clip_top([100.0, 120.0, 90.0, 110.0, 105.0]) is None
    assert report.main([str(log)]) == 0
    assert "training waits for data 70% of the time: stalled on data (rank 1" in (
        capsys.readouterr().out
    )


def test_epochs_of_fresh_workers_follow_one_another_on_the_time_axis():
    # Each epoch's pipeline starts its clock at 0 (workers that do not persist).
    ts = report.timeline([{"t": t} for t in (0.04, 1.2, 0.05, 1.1)])
    assert ts == pytest.approx([0.0, 1.16, 1.21, 2.26])


def test_report_of_a_log_per_rank(tmp_path):
    logs = []
    for rank in (0, 1):
        log = tmp_path / f"rank{rank}.jsonl"
        rs = [_decision(t, rank, 100.0, 0.01, 0.1, False) for t in range(3)]
        log.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "rank"}) + "\n"
                               for r in rs))  # fmt: skip
        logs.append(str(log))
    drawn = report.plot(logs, tmp_path / "both.png")
    assert drawn.ranks == (0, 1) and drawn.decisions == 6
