"""Calls in flight per worker: the rule, the simulator and a live pipeline agree on it."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from torchtune_pipe import DataLoader, Pipeline
from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload
from torchtune_pipe.tuning import make_tuner
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats
from torchtune_pipe.tuning.calls_in_flight import next_concurrency, plan_concurrency, wait_ratio

from ..multiproc._fns import burn_2ms  # noqa: F401  (imports the module workers load)
from ..test_faststart import _wait_for_workers


def _stage(busy=0.9, items_per_s=100.0, cpu_s_per_item=0.001, workers=1, c=1, max_c=32):
    return StageStats(
        "fetch", workers, items_per_s=items_per_s, busy=busy, cpu_s_per_item=cpu_s_per_item,
        concurrency=c, max_concurrency=max_c,
    )  # fmt: skip


def test_a_waiting_stage_gets_more_calls_in_flight_step_by_step():
    st = _stage()  # 9 ms of wall per item for 1 ms of CPU
    assert wait_ratio(st) == pytest.approx(9.0)
    assert next_concurrency(st) == 8  # ceil(9 / 1.25), at most 8x per decision
    # Four in flight: 2.25 ms of wall per item for 1 ms of CPU -> ceil(4 * 2.25 / 1.25).
    assert next_concurrency(_stage(c=4, busy=0.9, items_per_s=400.0)) == 8


def test_computing_starved_or_fixed_stages_keep_their_concurrency():
    assert next_concurrency(_stage(cpu_s_per_item=0.0085)) == 1  # computes
    assert next_concurrency(_stage(busy=0.1, items_per_s=11.0)) == 1  # starved: input is late
    assert next_concurrency(_stage(max_c=1)) == 1  # the stage has no knob
    assert next_concurrency(_stage(c=8, cpu_s_per_item=0.0095)) == 4  # threads only contend


def test_waiting_for_a_cpu_is_not_a_wait_threads_could_fill():
    # A JPEG decode on 2 busy cores: 94% busy, 69 points of it runnable but waiting for a
    # core. Counted as waiting, the rule raised its calls in flight from 1 to 64.
    contended = StageStats(
        "fetch", 2, items_per_s=12.4, busy=0.94, cpu_s_per_item=0.0336, runqueue=0.69,
        concurrency=1, max_concurrency=64,
    )  # fmt: skip
    assert wait_ratio(contended) == pytest.approx(1.2, abs=0.01)
    assert next_concurrency(contended) == 1
    # The same wall time, without a run queue, is a wait.
    assert next_concurrency(dataclasses.replace(contended, runqueue=0.0)) > 1


def test_a_tuners_concurrency_is_kept_within_bounds():
    obs = Observation((_stage(), _stage(max_c=1)), 100.0, 2.0, 1 << 30, 0)
    a = plan_concurrency(obs, Allocation((1, 1), (MiB, MiB), (50, 3)))
    assert a.concurrency == (32, 1)
    assert plan_concurrency(obs, Allocation((1, 1), (MiB, MiB))).concurrency == (8, 1)


def _sim(max_c: int) -> SimPipeline:
    wl = Workload(
        "remote",
        (
            StageModel("fetch", "source", 0.0005, io_s_per_item=0.005, max_concurrency=max_c),
            StageModel("collate", "map", 0.0002),
        ),
    )
    return SimPipeline(wl, cpus=2, memory_limit_bytes=8 << 30, noise=0.0)


def test_the_simulator_overlaps_waits_and_follows_the_same_rule():
    sim = _sim(32)
    tuner = make_tuner("unoptimized")
    obs = sim.observe()
    assert obs.stages[0].concurrency == 1
    sim.apply(tuner.reset(obs))
    seen = []
    for _ in range(8):
        obs = sim.observe()
        seen.append(obs.stages[0].concurrency)
        sim.apply(tuner.step(obs))
    assert seen == sorted(seen) and seen[-1] > 4, seen
    base = _sim(1)
    for _ in range(8):
        base.apply(Allocation((1, 1), (MiB, MiB)))
        slow = base.observe()
    assert obs.throughput > 3 * slow.throughput
    # What the rule saw: the simulator reports the wait ratio a worker would measure.
    assert wait_ratio(slow.stages[0]) == pytest.approx(5.5 / 0.5, rel=0.05)


class Remote(torch.utils.data.Dataset):
    """Each row waits 4 ms (a remote read) and costs ~0.2 ms of CPU."""

    def __init__(self, n=640):
        self.x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(0.004)
        end = time.thread_time_ns() + 200_000
        while time.thread_time_ns() < end:
            pass
        return self.x[i], i


def test_a_live_loader_raises_concurrency_for_waiting_reads_and_keeps_torchs_batches():
    ds = Remote()
    g = torch.Generator().manual_seed(1)
    expected = list(torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, generator=g))
    g = torch.Generator().manual_seed(1)
    seen = []
    with DataLoader(
        ds, batch_size=16, shuffle=True, generator=g, num_workers="auto", tuning_interval_s=0.25
    ) as loader:
        it = iter(loader)
        got = [next(it)]  # read in this process while the workers start (fast start)
        _wait_for_workers(loader)
        for b in it:
            got.append(b)
            seen.append(loader.loader.tunable.executor.concurrency("fetch"))
    assert len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert max(seen) > 1, f"fetch concurrency stayed at {seen}"
    assert not loader.loader.inline  # waiting reads stay on workers


def test_pipeline_stages_get_calls_in_flight_only_when_their_author_allows_it():
    from torchtune_pipe.errors import PipelineError

    pipe = Pipeline.from_source(list(range(8))).map(abs, name="plain")
    pipe = pipe.map(abs, name="io", concurrency=2, max_concurrency=16)
    plain, io = pipe.stages[1], pipe.stages[2]
    assert (plain.concurrency, plain.max_concurrency) == (1, 1)  # fixed unless allowed
    assert (io.concurrency, io.max_concurrency) == (2, 16)
    spec = pipe.spec(True)
    assert spec.stages[2].max_concurrency == 16 and spec.stages[1].max_concurrency == 1
    with pytest.raises(PipelineError, match=r"map\('x'\): concurrency \(4\) must be <= max"):
        pipe.map(abs, name="x", concurrency=4, max_concurrency=2)
    with DataLoader(list(range(4)), batch_size=2, num_workers="auto", max_concurrency=1) as dl:
        assert dl.pipeline.stages[0].max_concurrency == 1
        assert sorted(int(x) for b in dl for x in b) == [0, 1, 2, 3]


def test_a_stage_whose_first_reads_wait_starts_with_calls_in_flight():
    from torchtune_pipe.tuning.calls_in_flight import WAIT_RATIO_TARGET, start_concurrency

    assert start_concurrency(None, 32) == 1  # not measured
    assert start_concurrency(1.2, 32) == 1  # the reads compute
    assert start_concurrency(10.0, 32) == math.ceil(10.0 / WAIT_RATIO_TARGET)
    assert start_concurrency(500.0, 32) == 32  # at most its bound
    assert start_concurrency(10.0, 1) == 1  # a stage without the knob
