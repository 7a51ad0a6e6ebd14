"""The live pipeline's memory: cgroup limits from fixture directories, a worker's memory read
from /proc, and the same memory fields on a live and a simulated pipeline of one shape."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from torchtune_pipe import Pipeline
from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload
from torchtune_pipe.telemetry import measure as telemetry
from torchtune_pipe.telemetry.memory import (
    CgroupMemory,
    MemoryProbe,
    cgroup_memory,
    memory_available_bytes,
    process_bytes,
)
from torchtune_pipe.tuning.base import Allocation, MiB
from torchtune_pipe.tuning.safety import memory_parts

DEADLINE_S = 60.0
_HELD: list = []


def _write(d, **files):
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text)


def test_cgroup_v2_limit_is_the_tightest_of_max_and_high_up_the_tree(tmp_path):
    own = tmp_path / "self_cgroup"
    own.write_text("0::/job/step\n")
    _write(tmp_path / "job", memory_max=str(1 << 30), memory_high="max")
    _write(
        tmp_path / "job" / "step",
        memory_max="max",
        memory_high=str(512 * MiB),
        memory_current=str(300 * MiB),
        memory_stat=f"anon {150 * MiB}\ninactive_file {100 * MiB}\n",
        memory_events="low 0\nhigh 4\nmax 1\noom 2\noom_kill 2\n",
    )
    cg = cgroup_memory(tmp_path, own)
    assert cg == CgroupMemory(512 * MiB, 200 * MiB, 2)
    assert cg.available_bytes == 312 * MiB
    assert memory_available_bytes(tmp_path, own) <= 312 * MiB


def test_cgroup_v1_limit_usage_and_oom_kills(tmp_path):
    own = tmp_path / "self_cgroup"
    own.write_text("5:cpu,cpuacct:/x\n4:memory:/x/y\n0::/\n")
    unlimited = "9223372036854771712"
    _write(tmp_path / "memory", memory_limit_in_bytes=unlimited)
    _write(tmp_path / "memory" / "x", memory_limit_in_bytes=unlimited)
    _write(
        tmp_path / "memory" / "x" / "y",
        memory_limit_in_bytes=str(400 * MiB),
        memory_usage_in_bytes=str(150 * MiB),
        memory_stat=f"cache 1\ntotal_inactive_file {50 * MiB}\n",
        memory_oom_control="oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
    )
    assert cgroup_memory(tmp_path, own) == CgroupMemory(400 * MiB, 100 * MiB, 1)


def test_cgroup_namespace_and_no_limit(tmp_path):
    own = tmp_path / "self_cgroup"
    own.write_text("0::/\n")
    _write(tmp_path, memory_max="max", memory_current=str(10 * MiB))
    cg = cgroup_memory(tmp_path, own)
    assert cg.limit_bytes is None and cg.available_bytes is None and cg.oom_kills is None
    assert cgroup_memory(tmp_path / "missing", own) is None
    # A path that does not exist under the mount (a namespace shows the container's root).
    own.write_text("0::/elsewhere\n")
    _write(tmp_path, memory_max=str(64 * MiB))
    assert cgroup_memory(tmp_path, own).limit_bytes == 64 * MiB


class _Hold:
    """Worker init: a ``udf`` worker holds (and touches) ``mb`` MB for its lifetime."""

    def __init__(self, mb: int):
        self.mb = mb

    def __call__(self, stage: str, index: int) -> None:
        if stage == "udf":
            _HELD.append(np.ones(self.mb << 20, np.uint8))


def _same(x):
    return x


class _Ids:
    def __len__(self):
        return 10_000

    def units(self, epoch=0):
        return list(range(100))

    def read(self, unit):
        return range(unit * 100, unit * 100 + 100)


def _held_pipeline(udf_workers: int, mb: int) -> Pipeline:
    return Pipeline.from_source(_Ids(), buffer_bytes=1 << 20).map(
        _same, name="udf", workers=udf_workers, max_workers=udf_workers, init=_Hold(mb),
        buffer_bytes=1 << 20,
    )  # fmt: skip


def _observe_until_held(loader, hold_bytes: int, workers: int):
    """Observe the running loader until every ``udf`` worker reports ``hold_bytes``."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        obs = loader.observe()
        reading = loader.tunable.meter.memory.last
        pids = [w.pid for w in loader.tunable.executor.snapshot(True).stage("udf").per_worker]
        held = [reading.worker_bytes.get(p, 0) for p in pids]
        if len(held) == workers and all(h >= hold_bytes for h in held):
            return obs, reading, held
        assert time.monotonic() < deadline, f"udf workers report {held}, want {hold_bytes} each"
        time.sleep(0.1)  # polling with a deadline: a worker's init has no completion event


def test_a_worker_holding_200_mb_is_reported():
    with _held_pipeline(2, 200).loader() as loader:
        it = iter(loader)
        next(it)
        obs, reading, held = _observe_until_held(loader, 200 * MiB, 2)
        udf = obs.stages[1]
        assert udf.memory_bytes >= 2 * 200 * MiB
        assert obs.memory_used_bytes >= udf.memory_bytes + obs.stages[0].memory_bytes
        assert obs.memory_used_bytes == reading.used_bytes
        assert reading.processes_bytes >= sum(held) and reading.buffers_bytes >= 0
        assert obs.memory_limit_bytes > obs.memory_used_bytes and not obs.oom
        assert loader.tunable.meter.memory.reads >= 1
        it.close()


def _in_a_fresh_interpreter(check: str) -> None:
    """Run this module's ``check()`` in a new interpreter. Workers fork from a snapshot of
    the process that iterates (as torch's do), so each worker's proportional set size
    includes its share of that process's pages: the test session's, hundreds of MB after a
    suite's worth of imports, where these checks measure a worker's own memory."""
    from . import _subproc

    done = _subproc.run(f"from tests.test_memory import {check}; {check}()", timeout_s=120)
    assert done.returncode == 0, done.stderr[-4000:]


def test_live_and_simulated_pipelines_report_memory_alike():
    _in_a_fresh_interpreter("_live_and_simulated_alike")


def _live_and_simulated_alike():
    """One shape, both sides of the seam: a source worker and two UDF workers that hold
    100 MB each. The live pipeline is read from /proc; the simulator is given the source
    worker's measured size as its worker RSS and the UDF cache as what each UDF worker holds.
    Memory splits the same way on both, and a limit below the usage is an OOM on both."""
    hold = 100 * MiB
    with _held_pipeline(2, 100).loader() as loader:
        it = iter(loader)
        next(it)
        live, _, held = _observe_until_held(loader, hold, 2)
        it.close()
    base = live.stages[0].memory_bytes  # one worker that holds nothing of its own
    wl = Workload(
        "held",
        (StageModel("source", "source", 1e-4), StageModel("udf", "map", 1e-4, worker_bytes=hold)),
        worker_rss_bytes=base,
        initial_buffer_bytes=1 << 20,
    )  # fmt: skip
    sim = SimPipeline(wl, cpus=2, memory_limit_bytes=live.memory_limit_bytes, noise=0.0)
    sim.apply(Allocation((1, 2), (1 << 20, 1 << 20)))
    simulated = sim.observe()
    for obs in (live, simulated):
        parts = memory_parts(obs)
        held_by_workers = sum(s.memory_bytes for s in obs.stages)
        assert parts.buffered_bytes + held_by_workers <= obs.memory_used_bytes + 1  # int()
        assert obs.memory_used_bytes <= obs.memory_limit_bytes and not obs.oom
        assert parts.per_worker_bytes[1] >= hold > parts.per_worker_bytes[0]
    # The UDF stage's workers hold the same on both sides (the simulator's is exact: the
    # source worker's size plus the cache; the live one is read per process).
    assert live.stages[1].memory_bytes == pytest.approx(simulated.stages[1].memory_bytes, rel=0.15)
    # What no worker holds: the fork server live (tens of MB), nothing in the simulator.
    assert memory_parts(simulated).fixed_bytes == 0
    assert memory_parts(live).fixed_bytes < 0.25 * live.memory_used_bytes
    # A limit below the usage means an OOM on both sides.
    tight = int(0.5 * live.memory_used_bytes)
    with _held_pipeline(2, 100).loader(memory_limit_bytes=tight) as loader:
        it = iter(loader)
        next(it)
        over, _, _ = _observe_until_held(loader, hold, 2)
        it.close()
    sim = SimPipeline(wl, cpus=2, memory_limit_bytes=tight, noise=0.0)
    sim.apply(Allocation((1, 2), (1 << 20, 1 << 20)))
    assert over.oom and over.memory_limit_bytes == tight and sim.observe().oom


def test_probe_reads_at_most_once_per_interval_and_counts_its_cost():
    from multiproc import Snapshot

    held = [123]
    probe = MemoryProbe(lambda: held[0], min_interval_s=60.0)
    empty = Snapshot(0, (), 0, 0)
    first = probe.read(empty)
    assert probe.read(empty) is first and probe.reads == 1
    assert first.consumer_bytes == 123 and first.used_bytes == 123
    assert probe.mean_read_s == first.read_s > 0
    # Stale: a fresh reading, at once (the memory of now, not of the last reading's time).
    probe.min_interval_s, held[0] = 0.0, 456
    fresh = probe.read(empty)
    assert fresh.used_bytes == 456 and probe.last is fresh and probe.reads == 2


def _hold_from_first_item(x):
    """A ``udf`` that holds (and touches) 100 MB from its first item on."""
    if not _HELD:
        _HELD.append(np.ones(100 << 20, np.uint8))
    return x


def test_an_observation_reads_the_memory_of_when_it_is_made():
    pipe = Pipeline.from_source(_Ids(), buffer_bytes=1 << 20).map(
        _hold_from_first_item, name="udf", workers=1, max_workers=1, buffer_bytes=1 << 20
    )
    with pipe.loader() as loader:
        it = iter(loader)
        next(it)  # the udf worker made it: it holds its 100 MB now
        # Its reading at the start is too old to report now, however little time has passed.
        loader.tunable.meter.memory.min_interval_s = 0.0
        obs = loader.observe()
        assert obs.stages[1].memory_bytes >= 100 * MiB
        it.close()


def test_process_memory_counts_this_process_and_skips_gone_ones():
    assert process_bytes(os.getpid()) > 10 * MiB
    assert telemetry.resident_bytes([os.getpid(), -1]) == pytest.approx(
        process_bytes(os.getpid()), rel=0.2
    )


class _Table:
    """A map holding a 64 MiB array, as a map-style dataset holds its tensors."""

    def __init__(self):
        self.table = np.ones(64 * MiB, dtype=np.uint8)

    def __call__(self, x):
        return x + int(self.table[x % 1000])


def _read_range(unit):
    yield from range(unit * 100, unit * 100 + 100)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_the_large_arrays_workers_share_count_once_as_their_memory_not_as_buffers(method):
    _in_a_fresh_interpreter(f"_large_arrays_count_once_{method}")


def _large_arrays_count_once_spawn():
    _large_arrays_count_once("spawn")


def _large_arrays_count_once_fork():
    _large_arrays_count_once("fork")


def _large_arrays_count_once(method):
    from multiproc import Executor, ExecutorSpec, StageSpec

    spec = ExecutorSpec(
        (
            StageSpec("read", "source", _read_range, buffer_bytes=1 << 20),
            StageSpec("udf", "map", _Table(), workers=2, buffer_bytes=1 << 20),
        ),
        start_method=method,
    )
    probe = MemoryProbe(min_interval_s=0.0)
    with Executor(spec) as ex:
        assert len(list(ex.run(range(4)))) == 400
        reading = probe.read(ex.snapshot(per_worker=True))
        pids = {w.pid for s in ex.snapshot(per_worker=True).stages for w in s.per_worker}
    assert set(reading.worker_bytes) <= pids
    assert reading.buffers_bytes < 64 * MiB  # the channels' arenas alone (1 MiB budgets)
    if method == "spawn":
        # Pickled: the table goes to the stage file, which no worker holds a copy of
        # (tests/multiproc/test_buffers.py); the probe counts it once, with the processes.
        assert reading.processes_bytes >= 64 * MiB + sum(reading.worker_bytes.values())
    else:
        # Inherited from the snapshot: its pages are shared with this process, as a forked
        # DataLoader worker's are, so no worker counts a whole copy.
        assert all(b < 64 * MiB for b in reading.worker_bytes.values()), reading.worker_bytes
