"""benchmarks/memory_tree.py: the contenders' trees at their peak, process by process."""

from __future__ import annotations

import json

import pytest

from benchmarks import memory_tree


@pytest.mark.slow
def test_a_short_run_reports_every_role_of_our_tree_and_the_ratio(tmp_path, capsys):
    out = tmp_path / "tree.json"
    assert memory_tree.main(["--scenarios", "cheap-map", "--rounds", "1", "--duration", "3",
                             "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())["scenarios"]["cheap-map"]
    ours = result["contenders"]["torchtune_pipe-auto"]
    nodes = result["contenders"]["nodes-thread-w0"]
    assert {"consumer", "fork server", "worker"} <= set(ours["by_role"])
    assert set(nodes["by_role"]) == {"consumer"}  # threads: one process
    total = sum(r["pss"] for r in ours["by_role"].values()) / 2**20
    assert abs(total - ours["peak_pss_mib"]) < 1
    assert result["pss_vs_nodes"] == ours["peak_pss_mib"] / nodes["peak_pss_mib"]
    assert "ours / nodes" in capsys.readouterr().out
    m = result["at_nodes_rate"]
    if m is not None:  # the cheapest of ours that makes nodes' rows/s
        picked = result["contenders"][m["label"]]
        assert picked["samples_per_s"] >= nodes["samples_per_s"]
        assert m["pss_vs_nodes"] == picked["peak_pss_mib"] / nodes["peak_pss_mib"]
        fast = [c for c in result["contenders"].values()
                if c is not nodes and c["samples_per_s"] >= nodes["samples_per_s"]]  # fmt: skip
        assert picked["peak_pss_mib"] == min(c["peak_pss_mib"] for c in fast)
