"""The executor benchmark in its smoke size: it runs end to end and writes every section.

Speed is never asserted here (benchmarks measure it); only shape and sanity.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import _common
from benchmarks import executor as bench


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench_executor.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_json_has_every_section_with_target_and_verdict(result):
    assert set(result["sections"]) == set(bench.SECTIONS)
    for name, sec in result["sections"].items():
        assert sec["name"] == name
        assert sec["target"] == bench.TARGETS[name]
        assert isinstance(sec["pass"], bool)
        assert isinstance(sec["measured"], (int, float)) and sec["measured"] > 0, name
        assert sec["rows"], name
    assert [s["section"] for s in result["summary"]] == list(bench.SECTIONS)
    assert result["machine"]["usable_cores"] >= 1
    assert result["config"]["repeats"] == 1


def test_sections_report_their_measurements(result):
    s = result["sections"]
    bw = s["bandwidth"]
    assert set(bw["medians"]) == set(bench.BW_VARIANTS)
    assert all(m["gbps"] > 0 for m in bw["medians"].values())
    tiny = s["tiny_items"]
    assert all(v > 0 for v in tiny["median_items_per_s"].values())
    assert math.isclose(
        tiny["measured"], min(tiny["ratio_vs_parallel_mapper"], tiny["ratio_vs_dataloader"])
    )
    cpu = s["cpu_efficiency"]
    assert sum(cpu["workers"]) == max(cpu["cores"], 3)
    assert 0 < cpu["medians"]["useful_cpu_fraction"] <= 1.5
    lat = s["start_latency"]
    for mode in ("idle", "loaded"):
        assert len(lat[mode]["runs"][0]["latencies_ms"]) == result["config"]["start_workers"]
        assert lat[mode]["p50_ms"] <= lat[mode]["p95_ms"]


@pytest.mark.parametrize(
    ("costs", "cores", "want"),
    [
        ((1.0, 1.0, 1.0), 2, (1, 1, 1)),  # fewer cores than stages: one each
        ((1.0, 2.0, 1.0), 16, (4, 8, 4)),
        ((0.1, 0.3, 0.6), 10, (1, 3, 6)),
        ((1.0, 1.0, 1.0), 16, (6, 5, 5)),
    ],
)
def test_allocate_workers_is_proportional_and_sums_to_cores(costs, cores, want):
    got = bench.allocate_workers(costs, cores)
    assert got == want
    assert sum(got) == max(cores, len(costs))


def test_allocate_workers_rejects_bad_input():
    with pytest.raises(ValueError, match="positive costs"):
        bench.allocate_workers((1.0, 0.0), 4)


def test_common_helpers(tmp_path):
    lines = []
    text = _common.print_table(
        [{"name": "a", "x": 1.23456}, {"name": "bb", "x": 12345.6}],
        ["name", "x", "missing"],
        title="t",
        print_fn=lines.append,
    )
    assert lines == [text]
    assert "1.23" in text and "12,346" in text and "-" in text.splitlines()[-1]
    p = _common.write_json(tmp_path / "sub" / "r.json", {"v": float("nan"), "t": (1, 2)})
    assert json.loads(p.read_text()) == {"v": None, "t": [1, 2]}
    assert _common.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isnan(_common.median([]))
    clock = _common.SteadyClock(10)
    for _ in range(10):
        clock.tick()
    assert clock.rate() > 0
