import pytest

from torchtune_pipe.tuning import Allocation, MiB, OracleTuner, oracle_search, run_episode
from torchtune_pipe.tuning.oracle import candidate_workers, count_allocations, iter_allocations
from torchtune_pipe.tuning.testing import LinearTunable


def test_count_matches_enumeration():
    for hi, total in (((3, 3, 3), 6), ((5, 2), 6), ((4, 4, 4, 4), 9)):
        tuples = list(iter_allocations(hi, total))
        assert len(tuples) == count_allocations(hi, total) == len(set(tuples))
        assert all(
            sum(t) <= total and all(1 <= x <= h for x, h in zip(t, hi, strict=True)) for t in tuples
        )


def _evaluator(cost):
    calls = []

    def evaluate(a: Allocation) -> float:
        calls.append(a)
        return min(w / c for w, c in zip(a.workers, cost, strict=True))

    return evaluate, calls


def test_exhaustive_finds_the_known_optimum():
    evaluate, calls = _evaluator((1.0, 2.0, 3.0))
    alloc, value = oracle_search(evaluate, 3, cpus=6, max_workers=6)
    assert alloc.workers == (1, 2, 3) and value == pytest.approx(1.0)
    assert len(calls) == count_allocations((6, 6, 6), 6)


def test_coordinate_search_on_a_large_space():
    evaluate, calls = _evaluator((1.0, 2.0, 3.0, 2.0))
    alloc, value = oracle_search(evaluate, 4, cpus=64, max_workers=64, exhaustive_limit=100)
    assert value == pytest.approx(8.0)  # (8, 16, 24, 16) is optimal
    assert alloc.workers == (8, 16, 24, 16)
    assert len(calls) < count_allocations((64,) * 4, 64) / 50


def test_buffer_choices_and_validation():
    def evaluate(a):
        return min(a.workers) * (2.0 if a.buffer_bytes[0] == 4 * MiB else 1.0)

    alloc, value = oracle_search(evaluate, 2, 4, 4, buffer_choices=(MiB, 4 * MiB))
    assert alloc == Allocation((2, 2), (4 * MiB, 4 * MiB)) and value == 4.0
    with pytest.raises(ValueError, match="need cpus >= n_stages"):
        oracle_search(evaluate, 3, 2, 4)
    with pytest.raises(ValueError, match="max_workers must be 2"):
        oracle_search(evaluate, 2, 4, (1, 2, 3))


def test_candidates_use_all_cpus_or_a_grid():
    cands = candidate_workers(3, 6, 6)
    assert len(cands) == 10 and all(sum(c) == 6 for c in cands)  # C(5, 2)
    grid = candidate_workers(3, 64, 64, max_candidates=48)
    assert 1 < len(grid) <= 48 and all(sum(c) == 64 for c in grid)


def test_oracle_tuner_settles_on_the_best_candidate():
    pipe = LinearTunable((0.01, 0.02, 0.03), cpus=6)
    tuner = OracleTuner(trial_steps=2, warmup_steps=1)
    trace = run_episode(pipe, tuner, steps=10 * 2 + 3)
    assert not tuner.searching and len(tuner.scores) == 10
    assert tuner.best.workers == (1, 2, 3)
    assert trace[-1].workers == (1, 2, 3) and trace[-1].throughput == pytest.approx(100.0)


def test_oracle_tuner_given_candidates_and_validation():
    pipe = LinearTunable((0.01, 0.02), cpus=4)
    tuner = OracleTuner(candidates=[(2, 2), (1, 3), (3, 1)], trial_steps=1, warmup_steps=0)
    run_episode(pipe, tuner, steps=4)
    assert tuner.best.workers == (2, 2)
    assert tuner.scores == pytest.approx([100.0, 100.0, 50.0])
    with pytest.raises(ValueError, match="trial_steps > warmup_steps"):
        OracleTuner(trial_steps=1, warmup_steps=1)
    with pytest.raises(ValueError, match="every candidate needs 2 entries"):
        OracleTuner(candidates=[(1, 1, 1)]).reset(pipe.observe())
