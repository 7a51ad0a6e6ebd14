"""The kind rule: a threadable stage's workers tried on the other kind, kept where measured
no slower (threads) or clearly faster (processes), without processes or a clock."""

from __future__ import annotations

from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats
from torchtune_pipe.tuning.worker_kind import (
    PROBE,
    SETTLE,
    KindRule,
    start_on_threads,
    start_settled,
)


def _obs(threads: tuple[int, ...], rate: float, threadable=(False, True), cpus=8.0):
    stages = tuple(
        StageStats(f"s{i}", workers=4, min_workers=1, max_workers=8, items_per_s=rate,
                   busy=0.9, blocked_in=0.0, blocked_out=0.0, buffer_bytes=64 * MiB,
                   buffer_fill=0.5, cpu_s_per_item=0.001, threads=t, threadable=ok)
        for i, (t, ok) in enumerate(zip(threads, threadable, strict=True))
    )  # fmt: skip
    return Observation(stages, rate, cpus, 8 << 30, 1 << 30)


def _run(rule: KindRule, speed, steps: int, workers=(4, 4), moves_at=None, cpus=8.0):
    """Drive ``rule`` as a pipeline would: what it plans runs in the next interval, which
    delivers ``speed(threads of stage 1)``."""
    threads = (0, 0)
    seen = []
    for step in range(steps):
        w = workers if moves_at is None or step < moves_at else (workers[0], workers[1] - 1)
        obs = _obs(threads, speed(threads[1]), cpus=cpus)
        plan = rule.plan(obs, Allocation(w, (64 * MiB,) * 2))
        threads = plan.threads
        seen.append(threads)
    return seen


def test_threads_that_deliver_as_much_stay():
    rule = KindRule(threads_first=False)
    seen = _run(rule, lambda t: 1000.0, steps=4 * (SETTLE + PROBE))
    assert seen[0] == (0, 0)  # it starts on processes
    assert seen[-1] == (0, 4)  # all four of stage 1's workers, stage 0 not threadable
    assert [d[0] for d in rule.decisions] == ["try", "keep"]


def test_threads_clearly_slower_go_back_to_processes_and_stay_there():
    rule = KindRule(threads_first=False)
    seen = _run(rule, lambda t: 600.0 if t else 1000.0, steps=6 * (SETTLE + PROBE))
    assert (0, 4) in seen  # tried
    assert seen[-1] == (0, 0)
    what, stage, threads, ratio = rule.decisions[-1]
    assert (what, stage, threads) == ("undo", 1, True) and abs(ratio - 0.6) < 1e-9
    assert len(rule.decisions) == 2  # not tried again at the same CPUs


def test_a_free_threaded_interpreter_starts_on_threads_and_keeps_them_unless_beaten():
    rule = KindRule(threads_first=True)
    seen = _run(rule, lambda t: 1000.0, steps=4 * (SETTLE + PROBE))
    assert seen[0] == (0, 4)
    assert seen[-1] == (0, 4)  # processes as fast: not clearly faster, threads stay
    rule = KindRule(threads_first=True)
    seen = _run(rule, lambda t: 500.0 if t else 1000.0, steps=4 * (SETTLE + PROBE))
    assert seen[-1] == (0, 0)


def test_a_trial_the_tuner_interrupts_is_undone_and_tried_again():
    rule = KindRule(threads_first=False)
    # The tuner takes a worker away while the trial measures.
    _run(rule, lambda t: 1000.0, steps=SETTLE + PROBE + 3, moves_at=SETTLE + PROBE + 2)
    assert [d[0] for d in rule.decisions] == ["try", "abort"]
    assert rule.kind[1] is False and 1 not in rule.tried


def test_an_allocation_that_sets_threads_and_stages_not_threadable_keep_theirs():
    rule = KindRule(threads_first=True)
    obs = _obs((2, 0), 1000.0, threadable=(False, True))
    given = Allocation((4, 4), (64 * MiB,) * 2, threads=(1, 3))
    assert rule.plan(obs, given) is given
    planned = rule.plan(obs, Allocation((4, 4), (64 * MiB,) * 2))
    assert planned.threads == (2, 4)  # stage 0 as it runs; stage 1 the rule's (threads first)


def test_the_guard_keeps_a_stage_that_is_not_threadable_on_its_kind():
    from torchtune_pipe.tuning.safety import kinds

    obs = _obs((1, 0), 1000.0, threadable=(False, True))
    asked = Allocation((4, 2), (64 * MiB,) * 2, threads=(4, 9))
    assert kinds(asked, obs).threads == (1, 2)  # stage 0 as it runs; stage 1 at most its 2
    # A stage all of whose workers are threads (worker_type="thread") keeps them all.
    all_threads = _obs((4, 0), 1000.0, threadable=(False, True))
    assert kinds(Allocation((6, 2), (64 * MiB,) * 2, threads=(0, 0)), all_threads).threads == (6, 0)
    open_ = Allocation((4, 2), (64 * MiB,) * 2)
    assert kinds(open_, obs) is open_


def test_reads_that_keep_up_with_processes_on_threads_start_there():
    # (k reads at once on threads, k processes each as fast as one read alone plus its hop)
    assert start_on_threads(190.0, 200.0, threads_first=False)  # reads that release the lock
    assert start_on_threads(390.0, 400.0, threads_first=False)
    assert not start_on_threads(120.0, 200.0, threads_first=False)  # reads that hold it
    # decodes that release the lock for most of a read: 0.92x of the processes, which the
    # trial would not keep on threads either (TOLERANCE)
    assert not start_on_threads(368.0, 400.0, threads_first=False)
    # without a GIL threads are the first candidate: a little slower by the measure, they
    # start, and the rule tries processes while running
    assert start_on_threads(368.0, 400.0, threads_first=True)
    assert start_on_threads(310.0, 400.0, threads_first=True)
    assert not start_on_threads(250.0, 400.0, threads_first=True)
    # 8 MiB items: two reads at once make 1.3x one alone, but a process's hop into fresh
    # shared memory costs as much as its read (processes: 2 x 0.5x of one alone)
    assert start_on_threads(130.0, 100.0)
    assert not start_on_threads(0.0, 0.0)  # not measured: processes
    assert not start_on_threads(0.0, 0.0, threads_first=True)


def test_reads_that_compute_start_on_threads_only_where_clearly_faster_there():
    # A PIL decode reads 0.98x of the processes at the start and 0.86x running: reads that
    # compute (wall ~ CPU) get no more CPU on threads; a tie within the noise starts on
    # processes and is not settled (the trial measures threads on the running pipeline).
    computes, waits = 1.0, 5.8
    assert not start_on_threads(392.0, 400.0, threads_first=False, wait_ratio=computes)
    assert not start_settled(392.0, 400.0, wait_ratio=computes)
    assert start_on_threads(392.0, 400.0, threads_first=False, wait_ratio=waits)
    assert start_settled(392.0, 400.0, wait_ratio=waits)
    # a hop the threads skip (8 MB items): clearly faster, they start there and it settles
    assert start_on_threads(560.0, 400.0, threads_first=False, wait_ratio=computes)
    assert start_settled(560.0, 400.0, wait_ratio=computes)
    # far slower still settles processes; without a GIL threads stay the first candidate
    assert start_settled(200.0, 400.0, wait_ratio=computes)
    assert start_on_threads(320.0, 400.0, threads_first=True, wait_ratio=computes)


def test_a_kind_measured_at_the_start_holds_until_the_cpus_change():
    rule = KindRule(threads_first=False)
    rule.start([1], threads=True, cpus=8.0)
    seen = _run(rule, lambda t: 100.0, SETTLE + PROBE + 4)
    assert all(t == (0, 4) for t in seen), seen  # on threads from the first plan, no trial
    assert [d[0] for d in rule.decisions] == ["start"]
    seen = _run(rule, lambda t: 100.0, SETTLE + PROBE + 2, cpus=4.0)
    assert ("try", 1, False, 0.0) in rule.decisions  # other CPUs: measured again


def test_a_kind_started_without_a_measure_of_the_cpus_is_tried():
    rule = KindRule(threads_first=False)
    rule.start([1], threads=True, cpus=None)  # measured on fewer threads than the CPUs
    _run(rule, lambda t: 100.0, SETTLE + PROBE + 2)
    assert [d[0] for d in rule.decisions] == ["start", "try"]


def test_a_stage_whose_reads_failed_on_threads_is_never_tried_there():
    rule = KindRule(threads_first=True)
    rule.bar([1])
    seen = _run(rule, lambda t: 100.0, SETTLE + PROBE + 4)
    seen += _run(rule, lambda t: 100.0, SETTLE + PROBE + 4, cpus=4.0)  # not at other CPUs either
    assert all(t == (0, 0) for t in seen), seen
    assert [d[0] for d in rule.decisions] == ["bar"]


def test_a_start_measure_settles_the_kind_only_where_clear():
    assert start_settled(195.0, 200.0)  # threads as fast as processes: settled
    assert start_settled(130.0, 100.0)
    assert start_settled(110.0, 200.0)  # 0.55x of the processes: processes, settled
    assert not start_settled(170.0, 200.0)  # processes chosen, threads may hold as much
    assert not start_settled(140.0, 200.0)
    assert not start_settled(0.0, 0.0)
