"""The two-budget study: a ``--quick`` run's table and JSON structure."""

from __future__ import annotations

import json

import pytest

from benchmarks import cluster_sim


@pytest.mark.slow
def test_quick_run_splits_stages_between_host_and_cluster(tmp_path, capsys):
    out = tmp_path / "cluster.json"
    cluster_sim.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    tuners = {"intune", "planner", "plumber", "autotune", "oracle"}
    for cluster in (0, 32):
        rows = [r for r in data["rows"] if r["cluster"] == cluster]
        names = {r["tuner"] for r in rows}
        assert names == (tuners | {"all-remote"} if cluster else tuners), cluster
        for r in rows:
            assert r["rows/s"] > 0 and r["cpus paid"] > 0
            assert (r["eff/all-remote"] is None) == (cluster == 0)
    for run in data["runs"]:
        assert 0 <= run["remote"] <= run["cluster"], run  # cluster CPUs held
        placed = [p.split("+") for p in run["placement"].split() if p != "f"]
        assert sum(int(r) for _, r in placed) >= run["remote"], run
    # AUTOTUNE has no cluster: it never moves a worker.
    assert not any(r["remote"] for r in data["runs"] if r["tuner"] == "autotune")
    assert set(data["targets"]) == {"intune", "planner", "plumber"}
    assert "eff/all-remote" in capsys.readouterr().out
