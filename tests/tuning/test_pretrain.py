"""Pre-training in the simulator: held-out seeds, a short run that helps, the CLI, evaluation."""

from __future__ import annotations

import random

import pytest

from torchtune_pipe.sim.model import SimPipeline
from torchtune_pipe.sim.workloads import generate
from torchtune_pipe.tuning.base import Allocation, MiB
from torchtune_pipe.tuning.intune.agent import InTuneTuner, weights_path
from torchtune_pipe.tuning.intune.pretrain import (
    HELDOUT_SEED,
    Episode,
    evaluate_agent,
    main,
    pretrain,
    sample_episode,
    simulate,
)
from torchtune_pipe.tuning.loop import run_episode


def test_training_episodes_never_use_heldout_seeds():
    rng = random.Random(0)
    train = [sample_episode(4, rng, 50) for _ in range(200)]
    assert all(ep.seed < HELDOUT_SEED for ep in train)
    assert all(8 <= c <= 128 for ep in train for _, c in ep.cpus)
    assert any(len(ep.cpus) > 1 for ep in train), "some episodes must rescale"
    held = [sample_episode(4, rng, 50, heldout=True) for _ in range(20)]
    assert all(ep.seed >= HELDOUT_SEED for ep in held)


@pytest.mark.slow
def test_short_training_run_improves_a_bad_allocation(one_thread):
    state, stats = pretrain(2, episodes=12, seed=0, steps=40, cpu_choices=(8, 16))
    assert stats["steps"] == 12 * 40 and stats["ooms"] == 0
    wl = generate(2, HELDOUT_SEED + 7)
    probe = SimPipeline(wl, 16, 64 << 30, seed=1)
    for workers in ((1, 15), (15, 1)):
        bad = Allocation(workers, (64 * MiB,) * 2)
        allocs: list[Allocation] = []
        sim = simulate(Episode(wl, ((0.0, 16.0),), 64 << 30, 40, 1))
        run_episode(
            sim,
            InTuneTuner(state),
            40,
            start=bad,
            on_step=lambda o, a=allocs, s=sim: a.append(s.allocation),
        )
        assert probe.evaluate(allocs[-1]) > 1.3 * probe.evaluate(bad), (workers, allocs[-1])


def test_main_writes_loadable_weights(tmp_path, capsys):
    assert main(["--stages", "3", "--episodes", "1", "--steps", "5", "--out", str(tmp_path),
                 "--jobs", "1"]) == 0  # fmt: skip
    assert "3 stages:" in capsys.readouterr().out
    tuner = InTuneTuner(tmp_path)
    sim = SimPipeline(generate(3, HELDOUT_SEED), 16, 64 << 30)
    assert len(tuner.reset(sim.observe()).workers) == 3
    assert weights_path(3, tmp_path).is_file()


def test_main_rejects_lengths_outside_2_to_8(tmp_path):
    with pytest.raises(SystemExit):
        main(["--stages", "9", "--out", str(tmp_path)])


def test_main_no_train_needs_weights(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--stages", "3", "--no-train", "--out", str(tmp_path)])
    assert "no weight files" in capsys.readouterr().err
    assert not weights_path(3, tmp_path).exists()  # nothing was trained


@pytest.mark.slow
def test_evaluate_agent_reports_against_oracle_and_baselines():
    report = evaluate_agent(InTuneTuner, stages=[3], runs=1, steps=30, baselines=("heuristic",))
    summary = report.summary()
    assert report.ooms == 0
    assert len(report.steady_ratio) == 1 and 0.0 < report.steady_ratio[0] <= 1.5
    assert len(report.recovery_steps) == 2
    assert set(summary) >= {"steady_vs_oracle_median", "vs_heuristic_median", "ooms"}
    # The shipped agent beats the even split it starts from.
    assert report.vs["heuristic"][0] > 1.0
