"""Thread workers in the simulator (sim/threads.py): one interpreter lock shared by every thread
worker and the consumer caps the Python they run; what releases the lock runs as fast as
processes and holds less memory; the kind rule and the oracle pick the kind that pays."""

from __future__ import annotations

import dataclasses

import pytest

from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload
from torchtune_pipe.sim.workloads import (
    PRESETS,
    THREAD_PRESETS,
    generate,
    images_threads_like,
    text_like,
)
from torchtune_pipe.tuning.base import Allocation, MiB, Observation
from torchtune_pipe.tuning.baselines import StaticTuner
from torchtune_pipe.tuning.loop import run_episode
from torchtune_pipe.tuning.oracle import best_static

US = 1e-6
BUF = (16 * MiB,) * 3
UDF_S = 200 * US


def _workload(gil_share=1.0, **kw) -> Workload:
    return Workload(
        "threads",
        (
            StageModel("read", "source", 5 * US, bytes_per_item=300),
            StageModel(
                "udf", "map", UDF_S, bytes_per_item=300, gil_share=gil_share, threadable=True,
                worker_bytes=40 * MiB,
            ),
            StageModel("out", "map", 2 * US, bytes_per_item=300),
        ),
        **kw,
    )  # fmt: skip


def _sim(wl=None, cpus=8, **kw) -> SimPipeline:
    return SimPipeline(wl or _workload(), cpus=cpus, memory_limit_bytes=64 << 30, noise=0, **kw)


def _run(sim: SimPipeline, alloc: Allocation, steps: int = 3) -> Observation:
    for _ in range(steps):
        sim.apply(alloc)
        obs = sim.observe()
    return obs


def _lock_s_per_s(sim: SimPipeline, obs: Observation) -> float:
    """The lock-holding CPU of the thread workers and the consumer, per second."""
    wl = sim.workload
    held = sum(
        s.items_per_s * s.cpu_s_per_item * sm.gil_share * s.threads / max(1, s.workers)
        for s, sm in zip(obs.stages, wl.stages, strict=True)
    )
    return held + obs.throughput * wl.consumer_gil_s_per_item


def test_the_lock_caps_pure_python_thread_workers():
    sim = _sim()
    one = Allocation((1, 1, 1), BUF)
    assert sim.evaluate(one.replace(threads=(0, 1, 0))) == pytest.approx(sim.evaluate(one))
    for k in (2, 4, 6):
        # Explicit kinds: an allocation that leaves them open keeps the kinds that run now.
        procs = Allocation((1, k, 1), BUF, threads=(0, 0, 0))
        threads = procs.replace(threads=(0, k, 0))
        assert sim.evaluate(procs) == pytest.approx(k / UDF_S, rel=0.02)
        # One lock: k threads of Python run one at a time.
        assert sim.evaluate(threads) == pytest.approx(1 / UDF_S, rel=0.02)
        obs = _run(sim, threads)
        assert obs.stages[1].threads == k
        assert _lock_s_per_s(sim, obs) <= 1.0 + 1e-6
        # Waiting for the lock is time in the function without a CPU: past half, a wait.
        assert obs.stages[1].busy > 0.99 and obs.stages[1].io_bound == (k > 2)


def test_the_consumer_shares_the_lock_and_is_slowed_by_it():
    cg = 100 * US
    sim = _sim(_workload(consumer_gil_s_per_item=cg, consumer_step_s=150 * US))
    threads = sim.evaluate(Allocation((1, 4, 1), BUF, threads=(0, 4, 0)))
    assert threads == pytest.approx(1 / (UDF_S + cg), rel=0.02)
    # With processes only the consumer holds it: its step is the bound.
    assert sim.evaluate(Allocation((1, 4, 1), BUF)) == pytest.approx(1 / 150e-6, rel=0.02)


def test_gil_releasing_thread_workers_match_processes_and_hold_less():
    sim = _sim(_workload(gil_share=0.15))
    procs = Allocation((1, 4, 1), BUF)
    threads = procs.replace(threads=(0, 4, 0))
    assert sim.evaluate(threads) == pytest.approx(sim.evaluate(procs), rel=1e-9)
    p_obs = _run(sim, procs)
    t_obs = _run(sim, threads)
    assert t_obs.throughput == pytest.approx(p_obs.throughput, rel=1e-9)
    rss = sim.workload.worker_rss_bytes
    assert p_obs.memory_used_bytes - t_obs.memory_used_bytes == pytest.approx(4 * rss, rel=1e-6)
    # Their caches stay, in the consumer's process: in the total, in no stage's workers.
    assert t_obs.stages[1].memory_bytes == 0
    assert p_obs.stages[1].memory_bytes == 4 * (rss + 40 * MiB)
    # They take cores as processes do: on 2 cores both kinds share them alike.
    small = _sim(_workload(gil_share=0.15), cpus=2)
    assert small.evaluate(threads) == pytest.approx(small.evaluate(procs), rel=1e-9)


def test_the_last_stages_thread_workers_hand_their_items_over_without_a_hop():
    """Live, a thread worker's frames for the consumer are handed over as objects
    (multiproc.arena.keep): the last stage's thread workers pay no hop, and report none."""
    big = StageModel("decode", "map", 100 * US, bytes_per_item=4 << 20, gil_share=0.1,
                     threadable=True)  # fmt: skip
    wl = Workload("big", (StageModel("read", "source", 5 * US, bytes_per_item=300), big),
                  hop_s_per_item=20 * US)  # fmt: skip
    sim = _sim(wl, cpus=2)
    buf = (64 * MiB, 64 * MiB)
    procs = Allocation((1, 2), buf, threads=(0, 0))
    threads = procs.replace(threads=(0, 2))
    both = procs.replace(threads=(0, 1))
    assert sim.evaluate(threads) > sim.evaluate(both) > sim.evaluate(procs)
    p_obs, t_obs = _run(sim, procs), _run(sim, threads)
    assert p_obs.stages[1].hop_s_per_item > 0 and t_obs.stages[1].hop_s_per_item == 0
    assert t_obs.stages[1].cpu_s_per_item == pytest.approx(100 * US)  # its function alone
    assert p_obs.stages[1].cpu_s_per_item > 100 * US
    # The stage before keeps its hop: its frames go to a worker, not to the consumer.
    assert t_obs.stages[0].hop_s_per_item == p_obs.stages[0].hop_s_per_item > 0


def test_free_threaded_interpreter_removes_the_cap():
    sim = _sim(_workload(gil=False, consumer_gil_s_per_item=100 * US))
    procs = Allocation((1, 6, 1), BUF)
    assert sim.evaluate(procs.replace(threads=(0, 6, 0))) == pytest.approx(sim.evaluate(procs))


def test_a_stage_of_both_kinds_lies_between_them():
    sim = _sim()
    rates = [sim.evaluate(Allocation((1, 4, 1), BUF, threads=(0, t, 0))) for t in range(5)]
    assert rates == sorted(rates, reverse=True)
    assert rates[0] > rates[2] > rates[4]
    # Two processes and two threads: the processes' two cores and the lock's last one.
    assert rates[2] == pytest.approx(3 / UDF_S, rel=0.05)


def test_one_stage_of_remote_process_and_thread_workers():
    sim = _sim(cluster_cpus=8)
    alloc = Allocation((1, 7, 1), BUF, remote=(0, 3, 0), threads=(0, 2, 0))
    obs = _run(sim, alloc)
    udf = obs.stages[1]
    assert (udf.workers, udf.remote_workers, udf.threads) == (7, 3, 2)
    assert udf.memory_bytes == 2 * (sim.workload.worker_rss_bytes + 40 * MiB)
    assert 0 < udf.remote_items_per_s < udf.items_per_s
    local = udf.items_per_s - udf.remote_items_per_s
    # The lock lets the two thread workers make at most one worker's worth of items.
    assert local <= 3 / UDF_S * 1.02
    without = sim.evaluate(alloc.replace(threads=(0, 0, 0)))
    assert obs.throughput < without


def test_kind_rule_keeps_threads_where_the_lock_is_released_and_processes_where_not():
    def settle(wl: Workload, workers) -> Observation:
        sim = SimPipeline(wl, cpus=8, memory_limit_bytes=32 << 30, seed=2)
        return run_episode(sim, StaticTuner(workers, 16 * MiB), 30)[-1]

    images = settle(images_threads_like(0), (4, 6, 2, 1, 1))
    decode = images.stages[1]
    assert decode.name == "decode" and decode.threadable
    assert decode.threads == decode.workers == 6
    text = settle(text_like(0), (1, 4, 1))
    tokenize = text.stages[1]
    assert tokenize.name == "tokenize" and tokenize.threadable
    assert tokenize.workers == 4 and tokenize.threads == 0


def test_free_threaded_kind_rule_starts_on_threads():
    sim = SimPipeline(dataclasses.replace(text_like(0), gil=False), cpus=8,
                      memory_limit_bytes=32 << 30, seed=2)  # fmt: skip
    trace = run_episode(sim, StaticTuner((1, 4, 1), 16 * MiB), 30)
    assert trace[1].stages[1].threads == 4 and trace[-1].stages[1].threads == 4


def test_allocation_threads_are_honoured_within_each_stages_kind():
    wl = _workload()
    sim = _sim(wl, initial=Allocation((1, 1, 2), BUF, threads=(0, 0, 2)))  # "out": a thread stage
    obs = _run(sim, Allocation((2, 3, 4), BUF, threads=(2, 9, 0)))
    assert [s.threadable for s in obs.stages] == [False, True, False]
    # Not threadable: the source keeps its processes, "out" all threads as it grows; the udf
    # runs at most its local workers as threads.
    assert [s.threads for s in obs.stages] == [0, 3, 4]
    assert sim.allocation.threads == (0, 3, 4)
    obs = _run(sim, Allocation((2, 5, 4), BUF))  # threads left open: the rule's, kind kept
    assert obs.stages[1].threads in (0, 5)


def test_observation_fields_mean_what_the_seam_says():
    sim = _sim(_workload(gil_share=0.5))
    obs = _run(sim, Allocation((2, 5, 1), BUF, threads=(0, 3, 0)))
    rss = sim.workload.worker_rss_bytes
    udf = obs.stages[1]
    assert udf.workers == 5 and udf.threads == 3 and udf.remote_workers == 0
    assert udf.memory_bytes == 2 * (rss + 40 * MiB)  # the process workers'
    # The total holds every process worker's, the thread workers' caches and the buffers.
    held = 2 * rss + 2 * (rss + 40 * MiB) + 1 * rss + 3 * 40 * MiB
    buffered = sum(s.buffer_bytes * s.buffer_fill for s in obs.stages)
    assert obs.memory_used_bytes == pytest.approx(held + buffered, rel=1e-3)
    # Fused, a stage runs no workers of its own: not threadable, no threads.
    fused = _run(sim, Allocation((2, 5, 1), BUF, fused=(False, True, False)))
    assert not fused.stages[1].threadable and fused.stages[1].threads == 0


def test_copy_carries_the_kind_rules_state():
    sim = SimPipeline(text_like(0), cpus=8, memory_limit_bytes=32 << 30, seed=4)
    alloc = Allocation((1, 4, 1), (16 * MiB,) * 3)
    for _ in range(7):  # past SETTLE + PROBE: a trial on threads has begun
        sim.apply(alloc)
        sim.observe()
    twin = sim.copy()
    for _ in range(8):
        sim.apply(alloc)
        twin.apply(alloc)
        assert sim.observe() == twin.observe()
    assert sim._kinds.decisions == twin._kinds.decisions
    assert any(d[0] == "undo" for d in sim._kinds.decisions)


def test_oracle_searches_the_kind_of_threadable_stages():
    sim = _sim(text_like(0))
    best, value = best_static(sim.evaluate, 3, 8, 8, threadable=sim.threadable())
    assert best.threads[1] == 0  # pure Python: processes
    assert value == pytest.approx(best_static(sim.evaluate, 3, 8, 8)[1])
    # Where memory holds few processes, threads that release the lock go further.
    wl = _workload(gil_share=0.1)
    tight = SimPipeline(wl, cpus=8, memory_limit_bytes=1 << 30, noise=0)
    procs = best_static(tight.evaluate, 3, 8, 8)
    kinds = best_static(tight.evaluate, 3, 8, 8, threadable=tight.threadable())
    assert kinds[0].threads[1] == kinds[0].workers[1] > procs[0].workers[1]
    assert kinds[1] > 1.3 * procs[1]


def test_existing_workloads_run_no_threads():
    for wl in [build(0) for build in PRESETS.values()] + [generate(5, 3)]:
        assert not any(s.threadable for s in wl.stages)
        obs = _run(_sim(wl), Allocation((2,) * len(wl.stages), (8 * MiB,) * len(wl.stages)))
        assert all(s.threads == 0 and not s.threadable for s in obs.stages)
    for build in THREAD_PRESETS.values():
        assert any(s.threadable for s in build(0).stages)
