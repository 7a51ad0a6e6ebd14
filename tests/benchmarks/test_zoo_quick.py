"""The dataset zoo: every member's dataset yields batches, the targets read the rows as the
issue says, and a ``--quick`` run writes its table and JSON with ours' batches equal to
torch's (no speed is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import _zoo_child, _zoo_data, zoo
from benchmarks._zoo_datasets import make
from benchmarks._zoo_members import MEMBERS


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo_data"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(MEMBERS))
def test_every_member_yields_the_same_batches_twice(name, data_dir):
    m = MEMBERS[name]
    folder = _zoo_data.ensure(data_dir, name, m.quick_items)
    ds, collate = make(name, folder, m.quick_items)
    shuffle = None if m.iterable else True

    def first_batches() -> list[str]:
        g = torch.Generator().manual_seed(0)
        loader = torch.utils.data.DataLoader(ds, batch_size=m.batch_size, shuffle=shuffle,
                                             collate_fn=collate, generator=g)  # fmt: skip
        return [_zoo_child.digest(b) for b, _ in zip(loader, range(2), strict=False)]

    batches = first_batches()
    assert len(batches) >= 1 and batches == first_batches()
    assert _zoo_child.rows_of(next(iter(torch.utils.data.DataLoader(
        ds, batch_size=m.batch_size, collate_fn=collate)))) == min(m.batch_size, m.quick_items)  # fmt: skip


def test_the_harness_maps_no_library_of_its_contenders():
    code = "import sys, benchmarks.zoo\nprint(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=zoo.REPO, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(zoo.REPO)))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _row(label, rate, runs, pss=100.0, first=0.2, same=None):
    return {"label": label, "tool": label.split("-")[0], "samples_per_s": rate,
            "runs_samples_per_s": runs, "rounds": len(runs), "peak_pss_mib": pss,
            "first_batch_s": first, "crashes": 0, "crash": None, "same_batches": same}  # fmt: skip


def test_targets_count_095_only_where_the_spreads_overlap():
    member = MEMBERS["images"]
    rows = {"torch-w2": _row("torch-w2", 500.0, [480.0, 500.0, 520.0]),
            "torch-w1": _row("torch-w1", 2000.0, [2000.0]),  # one lucky round: not the best
            "torch-w3-p": _row("torch-w3-p", 1000.0, [950.0, 1000.0, 1100.0], pss=200.0),
            "ours-auto": _row("ours-auto", 960.0, [900.0, 960.0, 990.0], pss=230.0, first=0.28,
                              same=True)}  # fmt: skip
    t = zoo.member_targets(rows, member, cores=2)
    assert t["torch_best"] == "torch-w3-p"
    assert t["vs_best"] == {"value": pytest.approx(0.96), "aim": 0.95, "met": True}
    assert t["vs_guess"]["value"] == pytest.approx(1.92)
    assert t["first_batch_s"]["value"] == pytest.approx(0.08) and t["first_batch_s"]["met"]
    assert t["pss_vs_best"]["value"] == pytest.approx(1.15) and t["pss_vs_best"]["met"]
    assert t["same_batches"]["met"]
    rows["ours-auto"]["runs_samples_per_s"] = [900.0, 940.0, 945.0]  # below torch's lowest
    assert zoo.member_targets(rows, member, cores=2)["vs_best"]["met"] is False


def test_the_later_rounds_keep_ours_the_guess_and_each_tools_fastest():
    first = {label: {"samples_per_s": rate, "crash": None} for label, rate in
             [("torch-w0", 5.0), ("torch-w2", 3.0), ("torch-w4-p", 9.0), ("nodes-thread-w4", 4.0),
              ("nodes-process-w2", 6.0), ("ours-auto", 1.0), ("ours-w2", 2.0)]}  # fmt: skip
    first["torch-w3"] = {"samples_per_s": 0.0, "crash": "boom"}
    assert zoo.finalists(first, cores=2) == {"ours-auto", "ours-w2", "torch-w2", "torch-w4-p",
                                            "torch-w0", "nodes-process-w2"}  # fmt: skip


def _leaked_segments(before: set[str]) -> list[str]:
    """Segments named after a process that has ended, made since ``before``."""
    leaked = []
    for name in set(os.listdir("/dev/shm")) - before:
        parts = name.split("_")
        if name.startswith("ttp_") and len(parts) > 2 and parts[1].isdigit():
            if not os.path.exists(f"/proc/{parts[1]}"):
                leaked.append(name)
    return leaked


@pytest.mark.slow
@pytest.mark.timeout(240)  # ~30 s on an idle machine; a loaded shared one is far slower
def test_quick_run_writes_the_table_and_json_with_torchs_batches(tmp_path, data_dir, capsys):
    shm_before = set(os.listdir("/dev/shm"))
    out, md = tmp_path / "zoo.json", tmp_path / "zoo.md"
    zoo.main(["--quick", "--members", "tsv-shards,memmap", "--out", str(out), "--data-dir",
              data_dir, "--markdown", str(md)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "== tsv-shards" in printed and "== targets" in printed
    data = json.loads(out.read_text())
    cores = zoo.usable_cores()
    assert set(data["members"]) == {"tsv-shards", "memmap"}
    for name, m in data["members"].items():
        rows = {r["label"]: r for r in m["rows"]}
        assert set(rows) == {f"torch-w{cores}", "ours-auto", f"ours-w{cores}"}
        for r in rows.values():
            assert r["crashes"] == 0, (name, r["crash"])
            assert r["samples_per_s"] > 0 and r["peak_pss_mib"] > 0 and r["digests"][0]
        assert rows["ours-auto"]["same_batches"] is True, name
        assert rows[f"ours-w{cores}"]["same_batches"] is True, name
        assert m["targets"]["same_batches"]["met"] is True
    assert "median_vs_guess" in data["zoo"]
    assert "| tsv-shards |" in md.read_text()
    assert _leaked_segments(shm_before) == []
