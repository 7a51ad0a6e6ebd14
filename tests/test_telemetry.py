"""Telemetry: snapshot rates, machine facts (cgroup, memory, DRAM cache), the live table."""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import time

import pytest

from multiproc import Snapshot, StageSnapshot
from torchtune_pipe import DataLoader
from torchtune_pipe.telemetry import measure as telemetry
from torchtune_pipe.telemetry.measure import Bounds, ConsumerClock, Machine, Meter, observe
from torchtune_pipe.telemetry.memory import MemoryReading
from torchtune_pipe.tools.watch import render, watch


def _stage(name, workers, items_out, busy_ns, cpu_ns, blocked_in=0, used=0, budget=1 << 20):
    return StageSnapshot(
        name=name, workers=workers, items_in=items_out, items_out=items_out, busy_ns=busy_ns,
        blocked_in_ns=blocked_in, blocked_out_ns=0, worker_ns=0, cpu_ns=cpu_ns, bytes_out=0,
        errors=0, spilled=0, restarts=0, buffer_budget_bytes=budget, buffer_used_bytes=used,
        buffer_items=0, queued_frames=0,
    )  # fmt: skip


MACHINE = Machine(cpus=4.0, memory_available_bytes=1 << 30, dram_gbps=10.0, cpu_ghz=2.5)


def test_observe_turns_two_snapshots_into_rates():
    a = Snapshot(0, (_stage("read", 2, 0, 0, 0), _stage("udf", 1, 0, 0, 0)), 0, 0)
    b = Snapshot(
        2_000_000_000,
        (
            _stage("read", 2, 400, 2_000_000_000, 200_000_000, used=1 << 19),
            _stage("udf", 1, 400, 1_500_000_000, 1_500_000_000, blocked_in=500_000_000),
        ),
        380,
        10,
    )
    obs = observe(a, b, MACHINE, bounds=[Bounds(1, 8), Bounds(1, 4)], consumer_step_s=0.01, t=3.0)
    read, udf = obs.stages
    assert read.items_per_s == 200 and udf.items_per_s == 200
    assert read.busy == 0.5 and udf.busy == 0.75 and udf.blocked_in == 0.25
    assert read.io_bound and not udf.io_bound  # read burns 10% CPU of its busy time
    assert read.buffer_fill == 0.5 and read.max_workers == 8
    assert abs(udf.cpu_s_per_item - 1.5 / 400) < 1e-12
    assert obs.throughput == 190 and obs.cpus == 4.0 and obs.dram_gbps == 10.0
    assert obs.memory_used_bytes == 1 << 19
    # No probe: only the buffers are counted; the limit is that plus what is available.
    assert obs.memory_limit_bytes == (1 << 19) + (1 << 30) and not obs.oom
    assert obs.workers == (2, 1) and obs.t == 3.0


def test_memory_reading_gives_the_memory_fields_and_a_kernel_kill_is_an_oom():
    a = Snapshot(0, (_stage("read", 1, 0, 0, 0), _stage("udf", 2, 0, 0, 0)), 0, 0)
    b = Snapshot(10**9, (_stage("read", 1, 10, 0, 0), _stage("udf", 2, 10, 0, 0)), 10, 1)
    before = MemoryReading(300, 100, 200, 0, {"read": 50, "udf": 150}, oom_kills=0)
    now = MemoryReading(400, 100, 300, 0, {"read": 50, "udf": 250}, oom_kills=0)
    obs = observe(a, b, MACHINE, memory=now, memory_before=before, memory_limit_bytes=1000)
    assert obs.memory_used_bytes == 400 and obs.memory_limit_bytes == 1000 and not obs.oom
    assert [s.memory_bytes for s in obs.stages] == [50, 250]
    assert observe(a, b, MACHINE, memory=now, memory_limit_bytes=399).oom  # past the limit
    # A worker died and the cgroup's OOM killer acted in the same interval.
    died = dataclasses.replace(b.stages[1], restarts=1)
    b2 = dataclasses.replace(b, stages=(b.stages[0], died))
    killed = dataclasses.replace(now, oom_kills=1)
    assert observe(a, b2, MACHINE, memory=killed, memory_before=before, memory_limit_bytes=1000).oom
    # A death without an OOM kill (a crash, a signal from elsewhere) is not one.
    assert not observe(
        a, b2, MACHINE, memory=now, memory_before=before, memory_limit_bytes=1000
    ).oom


def test_cgroup_quota_caps_cpus_and_memory(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "memory.max").write_text(str(300 << 20))
    (tmp_path / "memory.current").write_text(str(100 << 20))
    assert telemetry.cpus_available(tmp_path) == min(1.5, len(os.sched_getaffinity(0)))
    assert telemetry.memory_available_bytes(tmp_path) <= 200 << 20
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "memory.max").write_text("max\n")
    assert telemetry.cpus_available(tmp_path) == len(os.sched_getaffinity(0))
    assert telemetry.memory_available_bytes(tmp_path) > 0


def test_dram_bandwidth_is_measured_once_and_cached(tmp_path):
    calls = []

    def fake():
        calls.append(1)
        return 12.5

    assert telemetry.dram_gbps(tmp_path, fake) == 12.5
    assert telemetry.dram_gbps(tmp_path, fake) == 12.5
    assert calls == [1]
    assert (tmp_path / "dram.json").exists()
    assert telemetry.measure_dram_gbps(size_bytes=1 << 20, repeats=2) > 0


def test_resident_memory_and_clock():
    assert telemetry.resident_bytes([os.getpid(), -1]) > 10 << 20
    assert telemetry.cpu_ghz() >= 0.0


def test_consumer_clock_measures_the_gap_between_next_calls():
    clock = ConsumerClock(alpha=1.0)
    clock.asked()
    clock.took()
    clock._handed_at -= 0.25  # as if the model step took 250 ms
    clock.asked()
    assert clock.items == 1 and 0.25 <= clock.step_s < 1.0
    clock.pause()
    clock.asked()
    assert clock.step_s < 1.0


def test_consumer_clock_sums_the_waits_for_data_and_the_steps(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: now[0])
    clock = ConsumerClock()
    start = clock.totals()
    clock.asked()
    now[0] = 0.3  # 300 ms inside next(): waiting for the pipeline
    clock.took()
    now[0] = 0.4  # a 100 ms step
    clock.asked()
    assert clock.totals() == pytest.approx((0.3, 0.1))
    assert telemetry.wait_share(start, clock.totals()) == pytest.approx(0.75)
    now[0] = 1.4  # still waiting: a stall counts up to now
    assert telemetry.wait_share(start, clock.totals()) == pytest.approx(1.3 / 1.4)
    clock.took()
    clock.pause()  # between epochs: neither a wait nor a step
    idle = clock.totals()
    now[0] = 9.0
    assert clock.totals() == idle and telemetry.wait_share(idle, clock.totals()) is None


class _Slow:
    """Rows that take ``step_s`` each to read."""

    def __init__(self, step_s: float):
        self.step_s = step_s

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        time.sleep(self.step_s)  # a read that takes its time
        return i


@pytest.mark.parametrize("read_s, step_s, stalled", [(0.02, 0.0, True), (0.0, 0.05, False)])
def test_a_loader_measures_the_share_of_its_consumers_time_spent_waiting(read_s, step_s, stalled):
    # Reads of 20 ms a row against a consumer that does nothing: training waits on data.
    # A 50 ms step against reads that take nothing: the data is there before it is asked for.
    # Without a fast start (seed_each_batch=False): the batches come from the workers.
    with DataLoader(_Slow(read_s), batch_size=2, num_workers=1, seed_each_batch=False) as loader:
        it = iter(loader)
        next(it)
        loader.loader.observe()  # the interval starts after the workers are up
        for _ in range(12):
            next(it)
            time.sleep(step_s)  # the training step
        share = loader.loader.observe().data_wait_share
        list(it)
    assert share is not None and (share > 0.5) == stalled, share


def test_meter_reports_each_interval_once():
    snaps = iter(
        [
            Snapshot(0, (_stage("s", 1, 0, 0, 0),), 0, 0),
            Snapshot(10**9, (_stage("s", 1, 50, 0, 0),), 50, 1),
            Snapshot(2 * 10**9, (_stage("s", 1, 60, 0, 0),), 60, 2),
        ]
    )
    meter = Meter(lambda: next(snaps), lambda: MACHINE)
    assert meter.observe().stages[0].items_per_s == 50
    assert meter.observe().stages[0].items_per_s == 10


def test_live_table_renders_and_watch_stops_on_its_event():
    from rich.console import Console

    a = Snapshot(0, (_stage("read", 2, 0, 0, 0),), 0, 0)
    b = Snapshot(10**9, (_stage("read", 2, 100, 10**9, 10**9),), 100, 1)
    obs = observe(a, b, MACHINE, consumer_cpus=0.25)
    out = io.StringIO()
    console = Console(file=out, width=150)
    console.print(render(obs))
    text = out.getvalue()
    assert "read" in text and "100" in text and "50%" in text
    assert "4 CPUs (0.25 used by the" in text  # the caption wraps
    stop = threading.Event()
    seen = []

    def observe_twice():
        seen.append(1)
        if len(seen) >= 2:
            stop.set()
        return obs

    assert (
        watch(observe_twice, interval_s=0.01, stop=stop, console=Console(file=io.StringIO())) >= 1
    )


class _Ints:
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> int:
        return i


def _plus_one(x: int) -> int:
    return x + 1


def test_stage_counters_count_the_users_items_not_the_units_end_marks():
    # A unit's end travels through every stage like an item; the counters (and the items per
    # second the tuners read) leave it out: 1000 samples in units of 64, batches of 100.
    from torchtune_pipe import DataLoader, Pipeline

    loader = (
        Pipeline.from_source(_Ints(), workers=2)
        .map(_plus_one, name="fused", fused=True)
        .map(_plus_one, name="own")
        .batch(100)
        .loader(tuner=None, batch_at_source=False, persistent_workers=True)  # a sample per item
    )
    with loader:
        assert sum(len(b) for b in loader) == 1000
        snap = loader.tunable.executor.snapshot()
    counts = {s.name: (s.items_in, s.items_out) for s in snap.stages}
    assert counts == {
        "source": (1000, 1000), "fused": (1000, 1000), "own": (1000, 1000), "batch": (1000, 10)
    }  # fmt: skip
    # The drop-in reads a batch per unit: its fetch stage makes one item per batch, not two.
    # (A worker_init_fn keeps every batch on the workers: no inline fast start.)
    dl = DataLoader(
        _Ints(), batch_size=100, num_workers=2, worker_init_fn=_no_init, persistent_workers=True
    )
    with dl:
        assert len(list(dl)) == 10
        fetch = dl.loader.tunable.executor.snapshot().stages[0]
    assert (fetch.items_in, fetch.items_out) == (10, 10)


def _no_init(worker_id: int) -> None:
    pass


def test_waiting_for_a_cpu_is_not_waiting_on_io_and_a_fused_group_shares_its_wait():
    # Three stages, the last two fused into the first: each spent 0.6 s in its function of
    # which 0.2 s on a CPU; the host's worker was runnable but waiting for a CPU 1.2 s of it
    # (a busy machine). Less that wait, each computed 0.2 s of 0.2 s: not I/O-bound.
    def stage(name, workers, runq_ns, fused):
        s = _stage(name, workers, 100, 600_000_000, 200_000_000)
        return dataclasses.replace(s, runq_ns=runq_ns, fused=fused)

    cur = Snapshot(
        1_000_000_000,
        (stage("src", 1, 1_200_000_000, False), stage("a", 0, 0, True), stage("b", 0, 0, True)),
        100,
        0,
    )
    zero = Snapshot(
        0, tuple(dataclasses.replace(s, items_out=0, items_in=0, busy_ns=0, cpu_ns=0, runq_ns=0)
                 for s in cur.stages), 0, 0,
    )  # fmt: skip
    obs = observe(zero, cur, MACHINE)
    assert not any(s.io_bound for s in obs.stages)
    assert all(abs(s.runqueue - 0.4) < 1e-9 for s in obs.stages)  # 1.2 s shared by busy time
    # The same time spent off the CPU and not runnable is a wait on I/O.
    idle = dataclasses.replace(cur, stages=tuple(
        dataclasses.replace(s, runq_ns=0) for s in cur.stages))  # fmt: skip
    assert all(s.io_bound for s in observe(zero, idle, MACHINE).stages)


def test_consumer_cpus_leaves_out_the_cpu_of_stages_run_by_its_threads():
    import time

    t0 = time.perf_counter_ns()
    snaps = [Snapshot(t0, (_stage("p", 1, 0, 0, 0), _stage("t", 1, 0, 0, 0)), 0, 0)]
    meter = Meter(lambda: snaps[-1], lambda: MACHINE, in_process=["t"])
    c0 = time.process_time()
    while time.process_time() < c0 + 0.3:
        pass
    spent = time.process_time() - c0
    now = time.perf_counter_ns()
    # "t" runs on threads of this process (0.1 s of what it spent is the stage's); "p" in
    # worker processes, whose CPU is not this process's at all.
    snaps.append(Snapshot(now, (_stage("p", 1, 10, 0, 5 * 10**9), _stage("t", 1, 10, 0, 10**8)),
                          10, 1))  # fmt: skip
    obs = meter.observe()
    dt = (now - t0) / 1e9
    assert abs(obs.consumer_cpus - (spent - 0.1) / dt) < 0.15
    assert observe(snaps[0], snaps[1], MACHINE).consumer_cpus == 0.0  # not measured
