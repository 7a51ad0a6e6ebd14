"""The simulator's fusion benchmark: a ``--quick`` run's table and JSON structure."""

from __future__ import annotations

import json

from benchmarks import sim_fusion


def test_quick_run_compares_every_contender_fused_and_unfused(tmp_path, capsys):
    out = tmp_path / "fusion.json"
    sim_fusion.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert {r["tuner"] for r in data["rows"]} == {"intune", "autotune", "plumber", "oracle"}
    for r in data["rows"]:
        assert r["unfused"] > 0 and r["fused"] > 0
        # Nothing beats the best static allocation over fusion shapes.
        assert r["fused/oracle"] <= 1.0 + 1e-9 and r["unfused/oracle"] <= 1.0 + 1e-9
    oracle = next(r for r in data["rows"] if r["tuner"] == "oracle")
    assert oracle["fused"] >= oracle["unfused"]
    assert "fused/unfused" in capsys.readouterr().out
