"""benchmarks/readahead.py: fixed shapes with batches read side by side and one at a time."""

from __future__ import annotations

import json

from benchmarks import readahead


def test_a_short_run_compares_every_shape_both_ways(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(readahead, "SHAPES", ((1, 1),))
    out = tmp_path / "readahead.json"
    assert readahead.main(["--rounds", "1", "--duration", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"fetch1-collate1", "fetch1-collate1-one"}
    assert all(len(v) == 1 and v[0] > 0 for v in result["runs"].values())
    side, one = result["table"]
    assert one["side_by_side_vs_one"] == side["rows_per_s"] / one["rows_per_s"]
    assert "side_by_side_vs_one" in capsys.readouterr().out
