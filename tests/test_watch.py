"""Seeing the stages: progress=True without rich, and `torchtune-pipe watch LOG`."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time

from torchtune_pipe import DataLoader
from torchtune_pipe.tools.watch import LogFollower, main, render_text
from torchtune_pipe.tuning.base import Allocation, Observation, StageStats
from torchtune_pipe.tuning.loop import observation, read_log

OBS = Observation(
    (StageStats("fetch", 3, items_per_s=120.0, busy=0.5, buffer_bytes=2 << 20),
     StageStats("collate", 1, items_per_s=40.0, busy=0.25, buffer_bytes=1 << 20)),
    throughput=40.0, cpus=2, memory_limit_bytes=1 << 30, memory_used_bytes=1 << 20, t=3.0,
)  # fmt: skip


def _record(obs: Observation, labels: dict | None = None) -> str:
    from torchtune_pipe.tuning.loop import TuningLoop

    loop = TuningLoop(None, object(), interval_s=1.0, labels=labels)  # its record format only
    return json.dumps(loop._record(obs, Allocation(obs.workers, obs.buffer_bytes), True, 0.0))


def test_progress_without_rich_prints_plain_text(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)  # as if rich were not installed
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    with DataLoader(list(range(64)), batch_size=2, num_workers=1, progress=True) as loader:
        it = iter(loader)
        next(it)
        deadline = time.monotonic() + 20
        text = ""
        while "batches/s to the consumer" not in text and time.monotonic() < deadline:
            threading.Event().wait(0.05)  # the display refreshes every second
            text += capsys.readouterr().err
        rest = list(it)
    assert len(rest) == 31 and not errors
    assert "fetch" in text and "batches/s to the consumer" in text  # a DataLoader's unit


def test_render_text_has_a_row_per_stage():
    text = render_text(OBS)
    assert "fetch" in text and "collate" in text and "40 items/s to the consumer" in text


def test_a_log_record_gives_back_its_observation(tmp_path):
    log = tmp_path / "tuning.jsonl"
    log.write_text(_record(OBS) + "\n" + '{"t": 1, "obs": {"thr')  # a line being written
    records = read_log(log)
    assert len(records) == 1
    back = observation(records[0])
    assert [s.name for s in back.stages] == ["fetch", "collate"]
    assert back.stages[0].items_per_s == 120 and back.throughput == 40 and back.t == 3


def test_watch_follows_a_log_that_grows(tmp_path, capsys):
    log = tmp_path / "tuning.jsonl"
    follow = LogFollower(log)
    assert follow() is None  # no log yet: the loader has not started tuning
    with open(log, "w") as f:
        f.write(_record(OBS) + "\n" + _record(OBS)[:20])
    assert follow().throughput == 40
    assert follow() is None  # nothing new: the half-written line waits
    with open(log, "a") as f:
        f.write(_record(OBS)[20:] + "\n")
    assert [s.name for s in follow().stages] == ["fetch", "collate"]
    assert main([str(log), "--once", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "fetch" in out and "collate" in out and "3 [1..65536]" in out
    assert main([str(tmp_path / "missing.jsonl"), "--once"]) == 2


def test_a_fused_stage_shows_no_workers_and_the_consumer_its_unit_and_its_wait():
    fused = dataclasses.replace(OBS.stages[1], fused=True)
    stalled = dataclasses.replace(OBS, stages=(OBS.stages[0], fused), data_wait_share=0.8)
    text = render_text(stalled, unit="batches")
    assert "0 [1..65536] fused in fetch" in text  # its function runs in fetch's workers
    assert "40 batches/s to the consumer" in text
    assert "waits for data 80% of the time: stalled on data" in text
    keeps_up = render_text(dataclasses.replace(OBS, data_wait_share=0.01))
    assert "waits for data 1% of the time: data keeps up" in keeps_up
    assert "waits for data (not measured)" in render_text(OBS)


def test_a_logged_decision_names_its_consumers_unit_and_rank(tmp_path, capsys):
    log = tmp_path / "tuning.jsonl"
    log.write_text(_record(OBS, {"unit": "batches", "rank": 1}) + "\n")
    record = read_log(log)[0]
    assert record["unit"] == "batches" and record["rank"] == 1
    follow = LogFollower(log)
    assert follow() is not None and follow.unit == "batches"
    assert main([str(log), "--once", "--plain"]) == 0
    assert "40 batches/s to the consumer" in capsys.readouterr().out
