"""`torchtune-pipe report`: the demo's tuning log as a PNG naming every stage."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402  (matplotlib's own dependency)

from torchtune_pipe import demo, report  # noqa: E402


def test_report_png_from_the_demo_names_every_stage(tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo.main(["--time-budget-s", "3", "--rows", "3000", "--val-rows", "500",
                      "--interval-s", "0.2", "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "held-out AUROC" in text and "torchtune-pipe report" in text
    log = out / "tuning.jsonl"
    assert report.main([str(log), "-o", str(tmp_path / "tuning.png")]) == 0
    png = tmp_path / "tuning.png"
    assert png.stat().st_size > 10_000
    with Image.open(png) as im:
        assert im.size == (1000, 800)
        assert im.text["Stages"] == "fetch,collate"  # every stage has a line in the panels
    drawn = report.plot(log, tmp_path / "again.png")
    assert drawn.stages == ("fetch", "collate") and drawn.decisions >= 3


def test_report_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    log = tmp_path / "tuning.jsonl"
    log.write_text('{"t": 0, "obs": {}}\n')
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    assert report.main([str(log)]) == 2
    assert "pip install 'torchtune-pipe[plot]'" in capsys.readouterr().err


def test_report_of_a_log_without_decisions(tmp_path, capsys):
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    assert report.main([str(log)]) == 2
    assert "holds no tuning decision" in capsys.readouterr().err
