"""The generalization battery: its seeds are none that pre-training or any evaluation used, and a
``--quick`` run prints its tables and writes its JSON (no speed or quality asserted)."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks import generalize
from benchmarks._generalize_cases import BATTERY_SEED, FAMILIES, battery
from torchtune_pipe.sim import studies
from torchtune_pipe.tuning.intune import pretrain


def test_the_battery_draws_no_seed_that_pretraining_or_an_evaluation_used():
    cases = battery()
    seeds = [c.seed for c in cases]
    assert len(set(seeds)) == len(seeds)
    # Pre-training draws below HELDOUT_SEED, its held-out evaluation and the studies from
    # there up to twice it: the battery starts above both.
    rng = random.Random(0)
    drawn = [pretrain.sample_episode(n, rng, 10, heldout=h).seed
             for n in range(2, 9) for h in (False, True) for _ in range(200)]  # fmt: skip
    assert max(drawn) < 2 * pretrain.HELDOUT_SEED <= BATTERY_SEED <= min(seeds)
    assert studies.HELD_OUT_SEED == pretrain.HELDOUT_SEED
    assert len([c for c in cases if c.family == "generated"]) >= 300
    assert {c.family for c in cases} == set(FAMILIES)
    levels = [c for case in cases for c in case.levels]
    assert min(levels) >= 8 and max(levels) <= 128
    assert any(case.levels == (24, 96, 48) for case in cases)


def test_churn_counts_the_workers_started_or_stopped_once_a_level_settled():
    from types import SimpleNamespace as NS

    def obs(*workers):
        return NS(stages=[NS(workers=w) for w in workers])

    # Two levels of 4 intervals: those ending at observations 2-3 and 6-7 (their second
    # halves) are counted; 0->1 (4 started) and 3->4 (4 stopped) are not.
    trace = [obs(1, 1), obs(5, 1), obs(5, 2), obs(5, 2), obs(1, 2), obs(1, 2), obs(1, 4),
             obs(3, 1)]  # fmt: skip
    # Counted: 1->2 (1), 2->3 (0), 5->6 (2), 6->7 (2 + 3): 8 over 4 intervals.
    assert generalize.settled_churn(trace, 4) == 8 / 4
    assert generalize.settled_churn(trace[:1], 4) == 0.0


@pytest.mark.slow
def test_quick_run_prints_every_family_and_the_targets(tmp_path, capsys):
    out = tmp_path / "generalize.json"
    generalize.main(["--quick", "--jobs", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["family"] for r in rows} == set(FAMILIES)
    assert {r["tuner"] for r in rows} == set(generalize.CONTENDERS)
    assert {(m["family"], m["tuner"]) for m in data["met"]} == {
        (f, t) for f in FAMILIES for t in ("intune", "planner")
    }
    for case in data["cases"]:
        for result in case["tuners"].values():
            assert len(result["steady"]) == len(case["levels"])
            assert result["churn"] >= 0.0
    assert all(r["churn"] >= 0.0 for r in rows)
    printed = capsys.readouterr().out
    assert "steady min" in printed and "targets" in printed
