"""The memory-drift benchmark: its tracking measure, and a ``--quick`` run's JSON structure."""

from __future__ import annotations

import json

import pytest

from benchmarks import memory_drift


def test_tracking_pairs_each_report_with_the_nearest_measurement():
    samples = [(10.0, 100), (10.5, 200), (11.0, 300)]
    reported = [(10.4, 220, [1, 1], False), (11.0, 270, [1, 1], False), (30.0, 1, [1], False),
                ("probe", 3, 0.01)]  # fmt: skip
    t = memory_drift._tracking(reported, samples)
    assert t["track_pairs"] == 2  # the report at 30 s has no measurement near it
    assert t["track_err_median"] == pytest.approx(0.1)
    assert t["track_bias_median"] == pytest.approx(0.0)


def test_growing_cache_grows_to_its_cap_per_copy():
    import pickle

    udf = memory_drift.GrowingCache(grow_bytes=1024, cap_bytes=4096, work_s=0.0)
    for i in range(10):
        udf(i)
    assert udf._held == 4096 and len(udf._cache) == 4
    assert pickle.loads(pickle.dumps(udf))._held == 0  # a worker's copy starts empty


@pytest.mark.slow
def test_quick_run_writes_table_rows_for_every_contender(tmp_path, capsys):
    out = tmp_path / "md.json"
    assert memory_drift.main(["--quick", "--duration", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    labels = {r["label"] for r in data["summary"]}
    assert labels == {"torchtune_pipe-intune", "torchtune_pipe-autotune", "dataloader-w4"}
    for r in data["runs"]:
        assert {"batches_per_s", "kills", "peak_mib", "round"} <= set(r)
    assert "track_err" in capsys.readouterr().out
