"""The peers benchmark: its summaries, its contenders, and ``--quick`` runs' JSON structure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import _mapstyle_fns, _peers_shape, peers


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


def test_the_harness_maps_no_library_of_its_contenders(tmp_path):
    # PSS splits a page among every process mapping it, the harness included: a harness that
    # imported torch (for its version, or the example's table sizes) took half of a
    # one-process tool's torch pages and a fifth of a four-process tree's.
    code = (
        "import sys\n"
        "from benchmarks import peers\n"
        f"paths, sizes = peers.prepare_data({str(tmp_path)!r}, 1, 50, True)\n"
        "spec = peers.base_spec(paths, 1.0, sizes)\n"
        "info = peers.machine_info()\n"
        "assert len(paths) == 1 and len(sizes) == 26 and info['torch'], (paths, sizes, info)\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=peers.REPO, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(peers.REPO)))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    with open(tmp_path / "day_0_50.txt") as f:
        assert len(f.readlines()) == 50


@pytest.mark.slow
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


# ------------------------------------------------------------ the execution-shape scenarios
@pytest.mark.parametrize(
    "scenario, tool, workers",
    [
        ("remote-map", "dataloader", 0),
        ("remote-map", "dataloader", 2),
        ("remote-map", "nodes-thread", 2),
        ("remote-map", "torchtune_pipe", -1),
        ("fusion", "dataloader", 2),
        ("fusion", "nodes-thread", 2),
        ("fusion", "torchtune_pipe-maps", 0),
        ("fusion", "torchtune_pipe-fused", 0),
        ("remote-map", "torchtune_pipe-shape", 1),  # benchmarks.memory_tree's fixed shape
    ],
)
def test_every_shape_contender_delivers_every_row_once(scenario, tool, workers):
    spec = dict(_peers_shape.SCENARIOS[scenario], rows=96, wait_s=0.0005 if workers else 0.0,
                tool=tool, workers=workers)  # fmt: skip
    epochs, stop = _mapstyle_fns.build(spec)
    try:
        for epoch in range(2):
            labels = torch.cat([y for _, y in epochs(epoch)])
            assert sorted(labels.tolist()) == list(range(96))
    finally:
        if stop is not None:
            stop()


def test_shape_contenders_sweep_every_peer_and_the_common_guess():
    labels = [c.label for c in peers.contenders("remote-map", 2, quick=False, spdl=True)]
    assert [f"dataloader-w{w}" for w in (0, 2, 4, 8, 16, 32)] == labels[:6]
    assert {"nodes-thread-w64", "nodes-process-w8", "spdl-w64", "torchtune_pipe-auto"} <= set(
        labels
    )
    fusion = {c.label: c for c in peers.contenders("fusion", 3, quick=True, spdl=False)}
    assert "dataloader-w3" in fusion  # the common guess is workers = cores, swept or not
    assert {"torchtune_pipe-intune", "torchtune_pipe-intune-fused"} <= set(fusion)
    assert all(c.module == _peers_shape.MODULE for c in fusion.values())


def test_rounds_combine_into_median_spread_startup_and_peak():
    def run(rate, startup, pss, crash=None):
        return {"label": "x", "tool": "dataloader", "samples_per_s": rate, "startup_s": startup,
                "peak_pss_mib": pss, "crash": crash}  # fmt: skip

    row = _peers_shape.combine_rounds(
        [run(300.0, 0.3, 100.0), run(0.0, None, 90.0, "boom"), run(100.0, 0.1, 120.0),
         run(200.0, 0.2, 110.0)]
    )  # fmt: skip
    assert row["samples_per_s"] == 200.0  # the crashed round is not a rate
    assert row["spread"] == "100-300"
    assert row["startup_s"] == 0.2
    assert row["peak_pss_mib"] == 120.0
    assert row["crashes"] == 1
    assert row["runs_samples_per_s"] == [300.0, 0.0, 100.0, 200.0]


def test_targets_compare_ours_with_every_peers_best_the_guess_startup_and_nodes_pss():
    def row(label, tool, rate, pss, startup=0.1):
        return {"label": label, "tool": tool, "samples_per_s": rate, "peak_pss_mib": pss,
                "startup_s": startup, "crash": None}  # fmt: skip

    rows = [
        row("dataloader-w2", "dataloader", 100.0, 200.0),
        row("dataloader-w16", "dataloader", 400.0, 500.0),
        row("nodes-thread-w16", "nodes-thread", 300.0, 200.0),
        row("nodes-process-w2", "nodes-process", 50.0, 300.0),
        row("torchtune_pipe-auto", "torchtune_pipe", 360.0, 250.0, startup=1.2),
    ]
    peers.add_ratios(rows, "torchtune_pipe-auto")
    head = peers.headline(rows, cores=2, ours="torchtune_pipe-auto")
    assert head["nodes_best"]["label"] == "nodes-thread-w16"  # threads and processes: one peer
    t = peers.target_row("remote-map", head)
    checked = t["checked"]
    assert checked["vs_every_best"]["value"] == pytest.approx(0.9)  # against DataLoader's best
    assert checked["vs_every_best"]["met"] is False
    assert checked["vs_dataloader_guess"]["value"] == pytest.approx(3.6)
    assert checked["vs_dataloader_guess"]["met"] is True
    assert checked["startup_s"] == {"value": 1.2, "aim": 1.0, "met": False}  # the drop-in's aim
    assert checked["pss_vs_nodes"]["value"] == pytest.approx(1.25)
    assert rows[1]["ours_vs_this"] == pytest.approx(0.9)
    assert peers.target_row("udf", head)["checked"]["startup_s"]["aim"] == 1.5  # a Pipeline's


@pytest.mark.slow
@pytest.mark.timeout(300)  # ~1 min on an idle machine
def test_quick_shape_scenarios_write_rows_and_targets(tmp_path):
    out, md = tmp_path / "peers.json", tmp_path / "peers.md"
    ours = ["torchtune_pipe-auto", "torchtune_pipe-intune"]
    peers.main(
        ["--quick", "--scenarios", "remote-map", "cheap-map", "fusion", "--duration", "1",
         "--out", str(out), "--no-plots", "--markdown", str(md),
         "--contenders", "dataloader-w2", "nodes-thread-w0", "nodes-thread-w16", *ours]
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert data["not_run"]["tf.data"].startswith("not run")
    want = {
        "remote-map": {"dataloader-w2", "nodes-thread-w16", "torchtune_pipe-auto"},
        "cheap-map": {"dataloader-w2", "nodes-thread-w0", "torchtune_pipe-auto"},
        "fusion": {"dataloader-w2", "nodes-thread-w0", *ours},
    }
    for scenario, labels in want.items():
        rows = data["scenarios"][scenario]
        assert {r["label"] for r in rows} == labels
        for r in rows:
            assert set(peers.SHAPE_COLUMNS) <= set(r), scenario
            assert r["crashes"] == 0, r["crash"]
            assert r["samples_per_s"] > 0 and r["peak_pss_mib"] > 0 and r["startup_s"] > 0
        head = data["headlines"][scenario]
        assert head["ours"] == _peers_shape.OURS[scenario]
        assert head["dataloader_guess"]["label"] == "dataloader-w2"
        checked = data["targets"][scenario]["checked"]
        assert set(checked) == {"vs_every_best", "vs_dataloader_guess", "startup_s",
                                "pss_vs_nodes"}  # fmt: skip
        assert all(c["value"] is not None for c in checked.values())
    assert "**fusion**" in md.read_text() and "**targets**" in md.read_text()
