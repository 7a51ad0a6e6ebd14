"""benchmarks/readahead.py: fixed shapes with batches read side by side, one at a time, and
the next one started only after the one before is committed."""

from __future__ import annotations

import json

import pytest

from benchmarks import readahead


@pytest.mark.slow
def test_a_short_run_compares_every_shape_every_way(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(readahead, "SHAPES", ((1, 0),))  # the collate fused
    out = tmp_path / "readahead.json"
    assert readahead.main(["--rounds", "1", "--duration", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    labels = {"fetch1-collate0", "fetch1-collate0-one", "fetch1-collate0-after"}
    assert set(result["runs"]) == labels
    assert all(len(v) == 1 and v[0] > 0 for v in result["runs"].values())
    side, one, after = result["table"]
    assert side["side_by_side_vs_this"] is None
    for row in (one, after):
        assert row["side_by_side_vs_this"] == side["rows_per_s"] / row["rows_per_s"]
    assert "side_by_side_vs_this" in capsys.readouterr().out
