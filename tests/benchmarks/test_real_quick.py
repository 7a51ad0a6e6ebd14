"""Smoke tests of the real-pipeline benchmarks: ``--quick`` runs and the shape of their JSON.

Each script runs in its own interpreter (its stage workers need an importable ``__main__``),
so its worker processes end with it. Speed is never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_tuners_real_quick(tmp_path: Path) -> None:
    result = _run("tuners_real.py", tmp_path / "tuners.json")
    assert result["config"]["quick"] is True
    (name, pipe), *_ = result["pipelines"].items()
    assert pipe["stages"] == ["source", "parse", "udf"]
    search = pipe["oracle_search"]
    assert len(search["scores"]) >= 2
    assert search["best"] in search["scores"]
    assert search["best"]["throughput"] == max(s["throughput"] for s in search["scores"])
    assert pipe["oracle_steady"] > 0
    rows = {r["tuner"]: r for r in pipe["summary"]}
    assert set(rows) == set(pipe["runs"]) >= {"unoptimized", "oracle"}
    assert rows["oracle"]["steady_vs_oracle"] == pytest.approx(1.0)
    assert rows["unoptimized"]["steady_vs_unoptimized"] == pytest.approx(1.0)
    for run in pipe["runs"].values():
        assert run["samples"] > 0
        assert run["trace"], f"{name}/{run['tuner']}: no throughput bins"
        times = [b["t"] for b in run["trace"]]
        assert times == sorted(times)
        for b in run["trace"]:
            assert b["throughput"] >= 0
            assert len(b["workers"]) == 3 and min(b["workers"]) >= 1
    # The oracle run is a static pipeline at the allocation the grid search chose.
    oracle_trace = pipe["runs"]["oracle"]["trace"]
    assert oracle_trace[-1]["workers"] == search["best"]["workers"]
    # The unoptimized tuner decides one worker per stage at every step.
    decisions = pipe["runs"]["unoptimized"]["decisions"]
    assert decisions and all(d["workers"] == [1, 1, 1] for d in decisions)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sim_validate_quick(tmp_path: Path) -> None:
    result = _run("sim_validate.py", tmp_path / "sim.json")
    (name, res), *_ = result["pipelines"].items()
    *per_stage, others = res["fitted"]
    assert [f["stage"] for f in per_stage] == ["source", "parse", "udf", "main"]
    assert others["stage"] == "other_load" and others["cores"] >= 0
    assert res["sim_cpus"] == pytest.approx(max(0.5, res["cpus"] - others["cores"]))
    for f in per_stage:
        assert f["cpu_ms"] >= 0 and f.get("io_ms", 0.0) >= 0
    # The remote-read source waits far longer than it computes: the fit must see I/O there.
    source = res["fitted"][0]
    assert source["io_ms"] > source["cpu_ms"], f"{name}: {source}"
    assert len(res["rows"]) >= 2
    for row in res["rows"]:
        assert row["measured"] > 0 and row["simulated"] > 0
        assert row["ape"] == pytest.approx(
            abs(row["simulated"] - row["measured"]) / row["measured"]
        )
    apes = sorted(r["ape"] for r in res["rows"])
    assert min(apes) <= res["mdape"] <= max(apes)
    assert result["mdape"] == pytest.approx(res["mdape"])
