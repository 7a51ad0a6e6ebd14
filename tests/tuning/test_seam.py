"""The Tunable/Tuner seam: every tuner runs on the simulator and on a real pipeline, and every
Observation field is set and means the same on both sides (units and ranges as base.py
documents them; live-only and simulator-only fields carry their "not measured" default)."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from torchtune_pipe import Pipeline
from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload
from torchtune_pipe.sim.workloads import generate
from torchtune_pipe.tuning import TUNERS, make_tuner, run_episode
from torchtune_pipe.tuning.base import (
    Allocation,
    MiB,
    Observation,
    StageStats,
    Tuner,
    running_workers,
)
from torchtune_pipe.tuning.safety import MAX_OVERSUBSCRIBE

STEPS = 3
# Fields measured on one side only, with the default the other side reports (base.py).
LIVE_ONLY = {"items_in_per_s": 0.0, "runqueue": None, "idle": False}
# The network's fields are measured live from remote calls only: a local pipeline reports
# their default (tests/test_remote_mixed.py checks them on a cluster).
SIM_ONLY = {"latency_s": 0.0, "network_bytes_per_s": 0.0, "rpc_s": 0.0}
SIM_ONLY_STAGE = {"hop_cpu_s_per_item": 0.0}


class Ids:
    """Units are ranges of ids; enough of them for every tuner's short episode."""

    def __len__(self):
        return 4000 * 4

    def units(self, epoch=0):
        return list(range(4000))

    def read(self, unit):
        return range(unit * 4, unit * 4 + 4)


def _work(x):
    return sum(range(3000)) * 0 + x  # a little CPU per item, so every stage is measured


def _tuner(name: str) -> Tuner:
    kw = {"workers": (1, 2, 1)} if name == "static" else {}
    if name == "oracle":
        kw = {"trial_steps": 2, "max_candidates": 2}
    return make_tuner(name, **kw)


def _check_stage(st: StageStats, side: str) -> None:
    where = f"{side} stage {st.name!r}"
    assert st.name, where
    if st.fused:  # runs in the previous stage's workers: none of its own, nothing blocks it
        assert st.fusable and 0 <= st.workers <= st.max_workers, where
        # Live, its own workers finish what was queued for them before they retire.
        if side == "sim":
            assert st.workers == 0 and st.blocked_in == st.blocked_out == 0, where
    else:
        assert 1 <= st.min_workers <= st.workers <= st.max_workers, where
    assert 1 <= st.concurrency <= max(1, st.max_concurrency), where
    assert st.items_per_s >= 0.0 and math.isfinite(st.items_per_s), where
    assert st.items_in_per_s >= 0.0, where
    for frac in ("busy", "blocked_in", "blocked_out", "buffer_fill"):
        assert 0.0 <= getattr(st, frac) <= 1.0, (where, frac)
    assert st.runqueue is None or 0.0 <= st.runqueue <= 1.0, where
    # Budgets are at least the hard limits' minimum (1 MiB) once a guarded decision ran.
    assert st.buffer_bytes >= MiB, where
    assert st.cpu_s_per_item >= 0.0 and math.isfinite(st.cpu_s_per_item), where
    assert st.cpu_s_per_item < 1.0, where  # seconds per item, not nanoseconds
    assert 0.0 <= st.hop_s_per_item < 1.0, where  # seconds per item
    if st.fused and side == "sim":  # live, also once its own workers finished their queue
        assert st.hop_s_per_item == 0.0, where  # its items cross no channel
    assert isinstance(st.io_bound, bool) and isinstance(st.idle, bool), where
    assert st.memory_bytes >= 0, where
    # Two budgets: remote workers are some of the workers, with their items and costs.
    assert 0 <= st.remote_workers <= st.workers and isinstance(st.remotable, bool), where
    assert 0.0 <= st.remote_items_per_s <= st.items_per_s * 1.5 + 1e-9, where
    if st.remote_workers == 0:
        assert st.remote_items_per_s == st.net_s_per_item == st.hop_cpu_s_per_item == 0.0
    # Seconds, not nanoseconds; a remote item's wait includes its actor's wait for a CPU,
    # which on a loaded 2-core machine running its actors too can pass a second.
    assert 0.0 <= st.net_s_per_item < 60.0 and 0.0 <= st.hop_cpu_s_per_item < 1.0, where
    assert st.bytes_per_item >= 0.0 and st.items_per_call >= 1.0, where


def _check(obs: Observation, side: str, flowing: bool) -> None:
    assert obs.cpus > 0 and obs.memory_limit_bytes > 0, side
    # Live, 0 until the memory probe's first reading of running workers (memory.py).
    assert obs.memory_used_bytes > 0 if side == "sim" else obs.memory_used_bytes >= 0, side
    assert obs.throughput >= 0.0 and obs.t > 0.0, side
    assert obs.consumer_step_s >= 0.0 and obs.dram_gbps >= 0.0 and obs.cpu_ghz >= 0.0, side
    local = sum(obs.workers) - sum(obs.remote_workers)
    assert local <= max(len(obs.stages), MAX_OVERSUBSCRIBE * obs.cpus + 1), side
    assert obs.cluster_cpus >= 0.0 and obs.network_bytes_per_s >= 0.0 and obs.rpc_s >= 0.0
    remote = sum(s.remote_workers for s in obs.stages if s.remotable)
    assert remote <= obs.cluster_cpus, side
    for st in obs.stages:
        _check_stage(st, side)
    assert not obs.stages[0].fused and not obs.stages[0].fusable, side
    if side == "sim":  # live, a wait is counted when it ends: short intervals may pass 1
        for i, st in enumerate(obs.stages):
            # A group's workers (a host's and the stages fused into it) are busy in one of its
            # stages or wait: the shares of their wall time add up to 1.
            if not st.fused:
                group = [st]
                while i + len(group) < len(obs.stages) and obs.stages[i + len(group)].fused:
                    group.append(obs.stages[i + len(group)])
                total = sum(s.busy for s in group) + st.blocked_in + st.blocked_out
                assert total == pytest.approx(1.0), (side, st.name)
    if flowing:
        assert obs.throughput > 0.0, side
        assert all(st.items_per_s > 0.0 and st.cpu_s_per_item > 0.0 for st in obs.stages), side
        assert all(st.hop_s_per_item > 0.0 for st in obs.stages if not st.fused), side


def _defaults(obs: Observation) -> dict[str, set[object]]:
    seen: dict[str, set[object]] = {k: set() for k in LIVE_ONLY}
    for st in obs.stages:
        for k in LIVE_ONLY:
            seen[k].add(getattr(st, k))
    return seen


@pytest.mark.parametrize("cluster", [0, 16])
@pytest.mark.parametrize("name", TUNERS)
def test_every_tuner_runs_on_the_simulator(name, cluster):
    sim = SimPipeline(
        generate(3, 7), cpus=8, memory_limit_bytes=16 << 30, seed=1, cluster_cpus=cluster
    )
    ran = []

    def in_force(obs: Observation) -> None:  # before the tuner steps on the interval
        ran.append((obs, sim.allocation))

    trace = run_episode(sim, _tuner(name), STEPS, on_step=in_force)
    assert len(trace) == STEPS
    for obs in trace:
        _check(obs, "sim", flowing=True)
        assert obs.latency_s > 0.0 and obs.rpc_s > 0.0 and obs.network_bytes_per_s > 0.0
        assert obs.cluster_cpus == cluster
        assert all(s.bytes_per_item > 0 for s in obs.stages)  # known to the simulator
        for k, default in LIVE_ONLY.items():
            assert _defaults(obs)[k] == {default}, k
    # Every interval reports exactly what the guard applied for it.
    for obs, alloc in ran:
        assert obs.workers == running_workers(alloc)
        assert obs.remote_workers == (alloc.remote or (0,) * 3)


def test_remote_fields_are_set_on_the_simulator():
    wl = Workload(
        "remote",
        (StageModel("source", "source", 20e-6), StageModel("_work", "map", 400e-6)),
    )
    start = Allocation((1, 6), (MiB,) * 2, remote=(0, 4))
    sim = SimPipeline(
        wl, cpus=2, memory_limit_bytes=16 << 30, initial=start, seed=1, cluster_cpus=8
    )
    for obs in run_episode(sim, make_tuner("static", workers=(1, 6)), STEPS)[1:]:
        _check(obs, "sim", flowing=True)
        st = obs.stages[1]
        assert st.remotable and not obs.stages[0].remotable
        assert st.remote_workers == 4 and 0 < st.remote_items_per_s < st.items_per_s
        assert st.net_s_per_item > 0 and st.hop_cpu_s_per_item > 0
        assert obs.allocation().remote == (0, 4)


def test_every_tuner_runs_on_a_real_pipeline_and_the_fields_mean_the_same():
    pipe = (
        Pipeline.from_source(Ids(), workers=1, max_workers=2)
        .map(_work, workers=1, max_workers=2)
        .batch(4, collate=None)
    )
    with pipe.loader(ordered=True) as loader:
        it = iter(loader)
        next(it)  # workers are up once the first item arrives
        live = loader.tunable
        live.observe()
        seen: list[Observation] = []
        for name in TUNERS:
            trace = run_episode(
                live, _tuner(name), STEPS, on_step=lambda o, epoch=it: _consume(epoch)
            )
            assert len(trace) == STEPS, name
            seen += trace
            for obs in trace:
                _check(obs, f"live/{name}", flowing=False)
                for k, default in SIM_ONLY.items():
                    assert getattr(obs, k) == default, k
                for st in obs.stages:
                    for k, default in SIM_ONLY_STAGE.items():
                        assert getattr(st, k) == default, k
                    # Local stages: no remote workers, none movable (only a placement="auto"
                    # stage connected to Ray is); no cluster.
                    assert st.remote_workers == 0 and not st.remotable
                assert obs.cluster_cpus == 0.0
        deadline = time.monotonic() + 10
        while (obs := live.observe()).memory_used_bytes <= 0:  # the probe reads every 0.5 s
            assert time.monotonic() < deadline, "the pipeline's memory was never measured"
            _consume(it)
        del it
    _check(obs, "live", flowing=False)
    assert [s.name for s in obs.stages] == ["source", "_work", "batch"]
    # Live-only fields are measured: items flow into every stage after the source, and every
    # stage runs (busy and CPU time as on the simulator's side).
    for i in range(1, 3):
        assert any(o.stages[i].items_in_per_s > 0.0 for o in seen), i
    for i in range(3):
        assert any(o.stages[i].busy > 0.0 and o.stages[i].cpu_s_per_item > 0.0 for o in seen)
    # The batch stage's outputs are measured (several items per output); its frames too.
    assert any(o.stages[2].bytes_per_item > 0.0 for o in seen)
    assert any(o.stages[1].items_per_call > 1.0 for o in seen)
    fields = {f.name for f in dataclasses.fields(StageStats)}
    assert set(LIVE_ONLY) <= fields


def _consume(it, n: int = 25) -> None:
    for _ in range(n):
        next(it)


def _check_fused(obs: Observation, side: str) -> None:
    """Stage 2 runs in stage 1's workers: the same fields, the same meaning on both sides."""
    _check(obs, side, flowing=False)
    host, st = obs.stages[1], obs.stages[2]
    assert [s.fused for s in obs.stages] == [False, False, True], side
    assert st.fusable and st.workers == 0 and host.workers >= 1, side
    assert obs.allocation().fused == (False, False, True), side
    # Its own items, time and CPU; its time a share of the host's workers' wall time.
    assert st.items_per_s > 0.0 and 0.0 < st.busy <= 1.0 and st.cpu_s_per_item > 0.0, side
    assert host.busy + st.busy <= 1.0 + 1e-6, side
    assert st.blocked_in == st.blocked_out == 0.0, side
    assert st.memory_bytes == 0, side  # no processes of its own


def test_a_fused_stage_means_the_same_on_both_sides():
    wl = Workload(
        "fused",
        (
            StageModel("source", "source", 20e-6),
            StageModel("_work", "map", 20e-6),
            StageModel("_again", "map", 20e-6),
        ),
    )
    start = Allocation((1, 2, 2), (MiB,) * 3, fused=(False, False, True))
    sim = SimPipeline(wl, cpus=4, memory_limit_bytes=16 << 30, initial=start, seed=1)
    for obs in run_episode(sim, _tuner("static"), STEPS):
        _check_fused(obs, "sim")
    pipe = (
        Pipeline.from_source(Ids(), workers=1, max_workers=2)
        .map(_work, workers=2, max_workers=2)
        .map(_again, workers=2, max_workers=2, fused=True)
    )
    with pipe.loader(ordered=True) as loader:
        it = iter(loader)
        next(it)
        deadline = time.monotonic() + 30
        while True:  # the fused stage's own workers retire once nothing is queued there
            _consume(it, 200)
            obs = loader.tunable.observe()
            if obs.stages[2].workers == 0 and obs.stages[2].items_per_s > 0:
                break
            assert time.monotonic() < deadline, obs
        _check_fused(obs, "live")
        del it


def _again(x):
    return _work(x)


def test_consumer_cpus_means_the_same_on_both_sides():
    """``consumer_cpus``: cores the consumer's process used besides the stages. The simulated
    consumer uses none of the pipeline's CPUs; a live consumer that computes between batches
    uses its share, one that only waits almost none."""
    sim = SimPipeline(generate(3, 7), cpus=8, memory_limit_bytes=16 << 30, seed=1)
    for obs in run_episode(sim, make_tuner("static", workers=(1, 1, 1)), STEPS):
        assert obs.consumer_cpus == 0.0
    pipe = Pipeline.from_source(Ids(), workers=1).map(_work, workers=1)
    with pipe.loader(ordered=True, tuner=None) as loader:
        it = iter(loader)
        next(it)
        live = loader.tunable

        def run(it, compute: bool) -> tuple[float, float]:
            live.observe()
            cpu0, wall0 = time.process_time(), time.monotonic()
            end = wall0 + 0.6
            while time.monotonic() < end:
                next(it)
                t = time.process_time() + 0.002
                if compute:  # the training step: 2 ms of this process's CPU per item
                    while time.process_time() < t:
                        pass
                else:  # a step that waits (an accelerator's): no CPU
                    time.sleep(0.002)
            used = (time.process_time() - cpu0) / (time.monotonic() - wall0)
            return live.observe().consumer_cpus, used

        (computing, used), (waiting, _) = run(it, True), run(it, False)
        del it
    # What the process's own clock says it used (on a loaded machine the busy step gets less
    # of a core: the measure must follow it, not a fixed share).
    assert abs(computing - used) <= 0.25 and 0.25 < computing <= 1.1, (computing, used)
    assert waiting < 0.4 * computing, (waiting, computing)
