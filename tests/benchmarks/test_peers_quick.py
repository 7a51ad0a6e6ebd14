"""The peers benchmark: its summaries, and a ``--quick`` run's JSON structure."""

from __future__ import annotations

import json

import pytest

from benchmarks import peers


def test_summarize_measures_the_timed_window():
    times = [5.0] + [5.0 + 0.1 * i for i in range(1, 31)]  # first batch at 5 s, then 10/s
    rows = [512] * len(times)
    m = peers.summarize(times, rows, duration_s=3.0)
    assert m["startup_s"] == 5.0
    assert m["samples_per_s"] == pytest.approx(5120, rel=0.01)
    assert m["batches"] == 31
    assert len(m["series"]) == 3
    assert m["time_to_steady_s"] == pytest.approx(5.5)


def test_summarize_without_batches_reports_zero():
    m = peers.summarize([], [], duration_s=3.0)
    assert m["samples_per_s"] == 0.0
    assert m["startup_s"] is None and m["series"] == []


def test_headline_compares_intune_with_the_common_guess_and_best():
    rows = [
        {"label": "dataloader-w2", "tool": "dataloader", "samples_per_s": 100.0, "crash": None},
        {"label": "dataloader-w4", "tool": "dataloader", "samples_per_s": 150.0, "crash": None},
        {"label": "nodes-w4", "tool": "nodes", "samples_per_s": 400.0, "crash": "OOM"},
        {"label": "torchtune_pipe-intune", "tool": "torchtune_pipe", "samples_per_s": 300.0,
         "crash": None},
    ]  # fmt: skip
    peers.add_ratios(rows)
    h = peers.headline(rows, cores=2)
    assert h["dataloader_guess"]["intune_ratio"] == pytest.approx(3.0)
    assert h["dataloader_best"]["label"] == "dataloader-w4"
    assert "nodes_best" not in h  # a crashed run is never "best"
    assert rows[0]["vs_intune"] == pytest.approx(1 / 3)


def test_contenders_sweep_workers_zero_to_twice_the_cores():
    labels = [c.label for c in peers.contenders("udf", 2, quick=False, spdl=False)]
    assert [f"dataloader-w{w}" for w in range(5)] == labels[:5]
    assert {f"torchtune_pipe-{t}" for t in peers.TUNERS} <= set(labels)
    assert not any(label.startswith("spdl") for label in labels)


@pytest.mark.timeout(240)  # ~20 s on an idle machine; a loaded shared one is far slower
def test_quick_run_writes_json(tmp_path):
    # The peers only: torchtune_pipe's start-up (~15 s on 2 cores) is left to the CLI's --quick.
    out = tmp_path / "peers.json"
    cores = peers.usable_cores()
    peers.main(
        ["--quick", "--out", str(out), "--no-plots", "--data-dir", str(tmp_path / "d"),
         "--contenders", f"dataloader-w{cores}", f"nodes-w{cores}"]
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert {"machine", "config", "not_run", "scenarios", "headlines"} <= set(data)
    assert data["config"]["quick"] is True
    assert "tf.data" in data["not_run"]
    rows = data["scenarios"]["steady"]
    assert {r["label"] for r in rows} == {f"dataloader-w{cores}", f"nodes-w{cores}"}
    for r in rows:
        assert set(peers.COLUMNS) <= set(r)
        assert r["crash"] is None, r["crash"]
        assert r["samples_per_s"] > 0 and r["peak_pss_mib"] > 0
    head = data["headlines"]["steady"]
    assert head["intune"] is None  # not run here
    assert head["dataloader_guess"]["label"] == f"dataloader-w{cores}"


def test_repeats_go_round_the_contenders_and_keep_the_median(tmp_path, monkeypatch):
    cores = peers.usable_cores()
    dl, nodes = f"dataloader-w{cores}", f"nodes-w{cores}"
    order = []
    rates = {dl: iter([30.0, 10.0, 20.0]), nodes: iter([5.0, 7.0, 6.0])}

    def fake_run(c, spec, plan, env, workdir):
        order.append(c.label)
        row = dict.fromkeys(peers.COLUMNS, 0)
        row.update(label=c.label, tool=c.tool, workers=c.workers, tuner=c.tuner, series=[])
        return dict(row, samples_per_s=next(rates[c.label]), crash=None)

    monkeypatch.setattr(peers, "run_one", fake_run)
    out = tmp_path / "peers.json"
    peers.main(
        ["--quick", "--out", str(out), "--no-plots", "--data-dir", str(tmp_path / "d"),
         "--repeats", "3", "--contenders", dl, nodes]
    )  # fmt: skip
    assert order == [dl, nodes] * 3
    rows = {r["label"]: r for r in json.loads(out.read_text())["scenarios"]["steady"]}
    assert rows[dl]["samples_per_s"] == 20.0
    assert rows[dl]["runs_samples_per_s"] == [30.0, 10.0, 20.0]
    assert rows[nodes]["samples_per_s"] == 6.0
