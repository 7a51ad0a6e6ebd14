"""The paper's studies on tiny settings, with trivial tuners."""

from __future__ import annotations

import json

import pytest

from torchtune_pipe.sim.model import SimPipeline
from torchtune_pipe.sim.studies import main, run_studies
from torchtune_pipe.sim.workloads import netflix_like
from torchtune_pipe.tuning.base import Allocation, MiB, Observation
from torchtune_pipe.tuning.loop import run_episode


class OneEach:
    """One worker per stage, 1 MiB buffers: the unoptimized pipeline."""

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        return Allocation((1,) * len(obs.stages), (1 * MiB,) * len(obs.stages))

    def step(self, obs: Observation) -> Allocation:
        return obs.allocation()


class EvenSplit:
    """CPUs split evenly across stages, re-split whenever the CPU count changes."""

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        return self.step(obs)

    def step(self, obs: Observation) -> Allocation:
        n = len(obs.stages)
        w = tuple(min(s.max_workers, max(1, int(obs.cpus) // n)) for s in obs.stages)
        return Allocation(w, (16 * MiB,) * n)


class Hog:
    """Three workers per CPU on every stage: runs out of memory under pressure."""

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        return self.step(obs)

    def step(self, obs: Observation) -> Allocation:
        n = len(obs.stages)
        return Allocation((int(obs.cpus) * 3,) * n, (256 * MiB,) * n)


def test_run_episode_drives_the_tuner():
    sim = SimPipeline(netflix_like(0), [(0, 8), (5, 32)], 48 * 1024 * MiB)
    seen = run_episode(sim, EvenSplit(), 10)
    assert len(seen) == 10
    assert seen[2].workers == (1, 1, 1, 1, 1)  # 8 CPUs // 5 stages
    assert seen[-1].workers == (6, 4, 6, 6, 4)  # re-split after the CPU count grew


def test_quick_studies_write_results(tmp_path):
    tuners = {"unoptimized": OneEach, "even": EvenSplit, "hog": Hog}
    res = run_studies(tuners, tmp_path, quick=True)
    assert res["baseline"] == "unoptimized"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["complexity"] == res["complexity"]
    # Study 1: the unoptimized pipeline is its own reference (~1x, up to noise).
    for preset in ("netflix_like", "criteo_like"):
        r = res["schedule"][preset]["tuners"]
        assert r["unoptimized"]["mean"] == pytest.approx(1.0, rel=0.05)
        assert r["even"]["mean"] > 2.0
        assert len(r["even"]["normalised"]) == 50
    # Study 2: gains are relative to the baseline.
    assert set(res["complexity"]) == {"3", "5", "8"}
    assert all(g["unoptimized"] == pytest.approx(1.0) for g in res["complexity"].values())
    # Study 3: more CPUs help an even split, not one worker per stage.
    cp = res["cpus"]["netflix_like"]
    assert cp["128"]["throughput"]["even"] > 4 * cp["8"]["throughput"]["even"]
    assert cp["128"]["throughput"]["unoptimized"] == pytest.approx(
        cp["8"]["throughput"]["unoptimized"], rel=0.1
    )
    # Study 4: items per second reported per batch size.
    assert set(res["batch"]) == {"256", "1024", "4096"}
    # Study 5: decisions pass the hard limits (safety.Guarded) as they do live: even the
    # memory hog's workers and buffers are fitted to memory, and no episode runs out of it.
    assert res["oom"]["episodes"] == 2
    assert res["oom"]["oom"]["hog"] == res["oom"]["oom"]["unoptimized"] == 0
    for name in ("schedule", "complexity", "cpus", "batch", "oom"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_run_studies_needs_tuners(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        run_studies({}, tmp_path)


def test_main_uses_the_tuner_registry(tmp_path, monkeypatch):
    import torchtune_pipe.tuning as tuning

    registry = {"unoptimized": OneEach, "even": EvenSplit}
    monkeypatch.setattr(tuning, "make_tuner", lambda name: registry[name](), raising=False)
    assert main(["--out", str(tmp_path), "--quick", "--tuners", "unoptimized,even"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["oom"]["oom"]) == {"unoptimized", "even"}
