"""Fast start: the first batches come from the calling process while the workers start."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from torchtune_pipe import DataLoader
from torchtune_pipe.loader.shape import ShapeProbe
from torchtune_pipe.tuning.loop import read_log

from ._compare import assert_same


class WhereAndNoise(Dataset):
    """Returns the pid that fetched each sample and random draws of all three generators."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return {
            "i": i,
            "pid": os.getpid(),
            "torch": torch.rand(2),
            "numpy": np.random.rand(2),
        }


def _wait_for_workers(dl, deadline_s=60.0):
    """Until every worker of the loader's executor has started (poll with a deadline)."""
    end = time.monotonic() + deadline_s
    while True:
        ex = dl.loader.tunable.executor if dl.loader.tunable is not None else None
        if ex is not None:
            if ex.started():
                return
        assert time.monotonic() < end, "the workers never started"
        time.sleep(0.02)


def _batches(workers, fast: bool, seed=5):
    g = torch.Generator().manual_seed(seed)
    dl = DataLoader(WhereAndNoise(), batch_size=8, shuffle=True, generator=g, num_workers=workers)
    dl.loader.strategy = dataclasses.replace(dl.loader.strategy, fast_start=fast)
    with dl:
        it = iter(dl)
        out = [next(it)]
        _wait_for_workers(dl)
        return out + list(it)


@pytest.mark.parametrize("workers", [2, "auto"])
def test_first_batches_come_from_this_process_and_equal_a_run_on_workers(workers):
    fast = _batches(workers, True)
    slow = _batches(workers, False)
    assert fast[0]["pid"].tolist() == [os.getpid()] * 8  # fetched inline, at once
    assert (slow[0]["pid"] != os.getpid()).all()
    assert (fast[-1]["pid"] != os.getpid()).all()  # the workers took over
    for a, b in zip(fast, slow, strict=True):
        del a["pid"], b["pid"]
        assert_same(a, b)


def test_inline_reads_leave_the_callers_random_generators_alone():
    torch.manual_seed(123)
    np.random.seed(123)
    want_t, want_n = torch.rand(3), np.random.rand(3)
    torch.manual_seed(123)
    np.random.seed(123)
    g = torch.Generator().manual_seed(1)
    with DataLoader(WhereAndNoise(), batch_size=8, generator=g, num_workers=2) as dl:
        first = next(iter(dl))
        assert first["pid"][0] == os.getpid()
        assert torch.equal(torch.rand(3), want_t) and np.array_equal(np.random.rand(3), want_n)


def test_stopping_during_the_inline_phase_leaves_nothing_behind():
    with DataLoader(WhereAndNoise(), batch_size=8, num_workers=2) as dl:
        it = iter(dl)
        assert next(it)["pid"][0] == os.getpid()
        it.close()  # the executor still starting is closed, not leaked (see the fixture)
    with DataLoader(WhereAndNoise(), batch_size=8, num_workers=2) as dl:
        next(iter(dl))
    # dropped without close(): the fixture checks processes and segments


def test_resume_from_a_state_saved_during_the_inline_phase():
    g = torch.Generator().manual_seed(2)
    with DataLoader(WhereAndNoise(), batch_size=8, shuffle=True, generator=g, num_workers=2) as dl:
        it = iter(dl)
        head = [next(it), next(it)]
        state = dl.state_dict()
    g = torch.Generator().manual_seed(2)
    with DataLoader(WhereAndNoise(), batch_size=8, shuffle=True, generator=g, num_workers=2) as dl:
        dl.load_state_dict(state)
        tail = list(dl)
    ids = [int(i) for b in head + tail for i in b["i"]]
    assert sorted(ids) == list(range(96)) and len(tail) == 10


class Broken(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == 3:
            raise IndexError(f"record {i} is corrupt")
        return i


def test_an_error_in_an_inline_read_reaches_the_caller_with_its_type():
    with DataLoader(Broken(), batch_size=4, num_workers=2) as dl:
        with pytest.raises(IndexError, match="record 3 is corrupt"):
            list(dl)


class Cheap(Dataset):
    """Rows that cost far less than a hop between processes: torch's best is num_workers=0."""

    def __init__(self, n=60_000):
        self.x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i


@pytest.mark.slow
def test_going_inline_mid_epoch_keeps_torchs_batches_exactly_once(tmp_path, monkeypatch):
    """The switch itself, made certain: inline reads measured as free beat any workers, so the
    loader closes its workers at the first windows after the tuner settled, mid-epoch, and
    reads the rest inline. (Which shape wins on real costs is measured by
    ``benchmarks/peers.py --scenarios cheap-map``, not asserted here; epochs read inline whole
    when they measure sooner so, not here.)"""
    monkeypatch.setattr(ShapeProbe, "inline_sooner", lambda self, units: False)
    ds = Cheap()
    g = torch.Generator().manual_seed(3)
    want = list(torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, generator=g))
    g = torch.Generator().manual_seed(3)
    log = tmp_path / "tuning.jsonl"
    with DataLoader(ds, batch_size=64, shuffle=True, generator=g, num_workers="auto",
                    tuning_interval_s=0.1, tuning_log=str(log)) as dl:  # fmt: skip
        dl.loader._shape_probe = ShapeProbe(inline_items=10**12)  # inline reads cost ~0
        for epoch in range(12):  # the choice waits for the tuner to settle (over 1 s)
            got = list(dl)
            if epoch == 0:
                for a, b in zip(want, got, strict=True):
                    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert sorted(int(i) for b in got for i in b[1]) == list(range(len(ds)))
            if dl.loader.inline:
                break
        assert dl.loader.inline, f"the loader kept its workers: {dl.loader._shape_probe}"
        assert dl.loader.tunable is None  # the workers are gone
        assert sorted(int(i) for b in dl for i in b[1]) == list(range(len(ds)))  # next epoch
    # The tuning log says where the tuning went: the kind its workers started on, its
    # decisions, then the switch.
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[0]["event"] == "kind" and "start on" in events[0]["message"]
    assert events[-1]["event"] == "inline"
    assert "reads in the calling process" in events[-1]["message"]
    assert len(read_log(log)) == len(events) - 2


def test_a_shape_window_goes_on_across_epochs_shorter_than_it(monkeypatch):
    """Epochs of a few batches, each restarting the workers, end long before one measurement
    window (the tuner's interval): the window goes on in the next epoch, so the choice is
    made (free inline reads: inline) rather than never. (Epochs that end before the workers
    serve are read inline whole: not here.)"""
    monkeypatch.setattr(ShapeProbe, "inline_sooner", lambda self, units: False)
    ds = Cheap(n=640)
    with DataLoader(ds, batch_size=64, num_workers="auto", tuning_interval_s=0.1) as dl:
        # Inline reads that cost ~0 and do not wait.
        probe = ShapeProbe(inline_s=10.0, inline_cpu_s=10.0, inline_items=10**12)
        dl.loader._shape_probe = probe
        for _ in range(200):
            assert sorted(int(i) for b in dl for i in b[1]) == list(range(len(ds)))
            if dl.loader.inline:
                break
        assert dl.loader.inline and probe.decided == "inline", probe
        assert probe.windows >= 2


class Levels(WhereAndNoise):
    """WhereAndNoise, with the value of an attribute the caller sets before each epoch."""

    level = 0

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return {**super().__getitem__(i), "level": self.level}


def _epochs_with_levels(workers, probe=None):
    ds = Levels()
    g = torch.Generator().manual_seed(3)
    with DataLoader(ds, batch_size=8, shuffle=True, generator=g, num_workers=workers) as dl:
        if probe is not None:
            dl.loader._shape_probe = probe
        return [list(dl) for epoch in range(3) if setattr(ds, "level", epoch) is None]


def test_an_epoch_read_before_the_workers_would_serve_builds_none(monkeypatch):
    """An "auto" loader whose epoch, read inline as fast as its reads alone so far, ends
    before an executor as quick to serve as its last would (a small validation set) builds
    none: no fork, every batch read in the calling process, the batches (and their seeded
    draws) those of workers, and the dataset as it was at each ``iter()``."""
    import torchtune_pipe.loader.core as core

    probe = ShapeProbe(serving_s=30.0, alone_s=0.01, alone_units=1)
    taken = []
    monkeypatch.setattr(core, "take_snapshot", lambda *a, **k: taken.append(a))  # no fork
    got = _epochs_with_levels("auto", probe)
    assert not taken
    monkeypatch.undo()
    want = _epochs_with_levels(2)
    for epoch, (g, w) in enumerate(zip(got, want, strict=True)):
        assert {int(p) for b in g for p in b["pid"]} == {os.getpid()}
        assert {int(v) for b in g for v in b["level"]} == {epoch}
        strip = [{k: v for k, v in b.items() if k != "pid"} for b in g]
        assert_same(strip, [{k: v for k, v in b.items() if k != "pid"} for b in w])
    assert probe.decided is None and probe.alone_units > 1  # measured on, epoch by epoch


def test_inline_is_sooner_by_the_reads_alone_against_what_workers_measured():
    """An epoch is read inline whole where its units, each as long as the reads alone so far,
    end before an executor would serve, or take less than the consumer waited per unit over
    the last warm epoch on workers; never before reads alone were measured."""
    assert not ShapeProbe(serving_s=9.0, workers_s=9.0, workers_units=1).inline_sooner(1)
    alone = {"alone_s": 0.010, "alone_units": 10}  # 1 ms a unit
    assert ShapeProbe(serving_s=0.101, **alone).inline_sooner(100)
    assert not ShapeProbe(serving_s=0.099, **alone).inline_sooner(100)
    assert ShapeProbe(workers_s=0.4, workers_units=200, **alone).inline_sooner(100)
    assert not ShapeProbe(workers_s=0.1, workers_units=200, **alone).inline_sooner(100)


def test_the_consumers_wait_is_measured_on_warm_epochs_only(monkeypatch):
    """The first executor (a kind probe, a cold start) is not what later epochs' workers
    cost; the next epoch read whole on workers is, its units with it."""
    monkeypatch.setattr(ShapeProbe, "inline_sooner", lambda self, units: False)
    ds = Cheap(n=640)
    with DataLoader(ds, batch_size=64, num_workers="auto") as dl:
        probe = dl.loader._shape_probe
        list(dl)
        assert probe.workers_units == 0 and probe.serving_s is not None
        list(dl)
        assert probe.workers_units == 10 and probe.workers_s > 0


def test_reads_that_wait_are_never_chosen_inline():
    """Inline reads whose wall time is well past their CPU time cannot overlap their waits."""
    probe = ShapeProbe(inline_s=1.0, inline_cpu_s=0.1, inline_items=100)
    ds = Cheap(n=2_000)
    with DataLoader(ds, batch_size=64, num_workers="auto", tuning_interval_s=0.1) as dl:
        dl.loader._shape_probe = probe
        list(dl)
        list(dl)
        assert probe.decided == "workers" and not dl.loader.inline


class SlowPid(Dataset):
    """Samples of ~60 ms that say which process read them."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        time.sleep(0.06)
        return {"i": i, "pid": os.getpid()}


def test_workers_that_restart_sooner_than_a_unit_reads_read_the_first_unit():
    """Non-persistent workers restart every epoch: once an executor was seen to serve sooner
    than a unit reads inline (~0.5 s here), an epoch's first unit waits for the workers
    rather than keep them idle while this process reads it."""
    g = torch.Generator().manual_seed(1)
    firsts, seen = [], []
    with DataLoader(SlowPid(), batch_size=8, shuffle=True, generator=g, num_workers=2) as dl:
        for _ in range(3):
            batches = list(dl)
            firsts.append(int(batches[0]["pid"][0]))
            seen.append(sorted(int(i) for b in batches for i in b["i"]))
    assert firsts[0] == os.getpid()  # the first epoch's: read here while the workers start
    assert firsts[2] != os.getpid()  # by then: the restarted workers read it
    assert seen == [list(range(32))] * 3  # every sample once per epoch


class BusyPid(SlowPid):
    """48 samples of ~50 ms of pure Python (they hold the interpreter lock: a kind probe puts
    them on processes)."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        return {"i": i, "pid": os.getpid()}


def test_after_a_kind_probe_restarted_workers_still_read_the_first_unit():
    """The first epoch of ``"auto"`` probes the kind before its workers start (~0.8 s: two
    units); what the next epochs expect of their workers' start is the start alone (~0.1 s),
    not the probe too, so their first unit (~0.4 s) is the workers' to read."""
    g = torch.Generator().manual_seed(1)
    firsts, seen = [], []
    with DataLoader(BusyPid(), batch_size=8, shuffle=True, generator=g, num_workers="auto") as dl:
        for _ in range(3):
            batches = list(dl)
            firsts.append(int(batches[0]["pid"][0]))
            seen.append(sorted(int(i) for b in batches for i in b["i"]))
        assert dl.loader._kinds.kind  # the probe placed the stages
    assert firsts[0] == os.getpid()
    assert firsts[1] != os.getpid() and firsts[2] != os.getpid()
    assert seen == [list(range(48))] * 3


class Threads(Dataset):
    """32 samples of ~20 ms (waits) saying in which process they were read and with how many
    torch intra-op threads."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        time.sleep(0.02)
        return {"i": i, "pid": os.getpid(), "threads": torch.get_num_threads()}


def test_an_inline_read_runs_on_a_workers_intraop_threads():
    """A unit read inline stands in for a worker's read: one torch intra-op thread, as a
    worker process has (the consumer's count, spinning against the workers' kernels, was
    measured to make a 65 ms unit take 0.5 s); the consumer's own count is put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(2)
        with DataLoader(Threads(), batch_size=8, shuffle=True, generator=g, num_workers=2) as dl:
            batches = list(dl)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    g = torch.Generator().manual_seed(2)
    order = torch.utils.data.DataLoader(range(32), batch_size=8, shuffle=True, generator=g)
    assert [b["i"].tolist() for b in batches] == [b.tolist() for b in order]
    assert int(batches[0]["pid"][0]) == os.getpid()  # read inline
    assert all(b["threads"].tolist() == [1] * 8 for b in batches)


class Sleepy(Dataset):
    """Samples of ~2 ms."""

    def __init__(self, n=96):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(0.002)
        return i


class Watching:
    """The heuristic tuner, keeping the throughput of every observation it steps on."""

    def __init__(self):
        from torchtune_pipe.tuning.baselines import HeuristicTuner

        self.inner, self.stepped_on = HeuristicTuner(), []

    def reset(self, obs, start=None):
        return self.inner.reset(obs, start)

    def step(self, obs):
        self.stepped_on.append(obs.throughput)
        return self.inner.step(obs)


@pytest.mark.parametrize("n, interval_s", [(96, 1.0), (480, 0.05)])
def test_restarted_workers_are_tuned_on_measured_intervals_only(n, interval_s):
    """Non-persistent workers start anew every epoch. The tuner continued there is never
    stepped on the new workers' first milliseconds (no batch measured: once 7 workers on 2
    cores): after epochs shorter than the interval, on the last epoch's final observation;
    after longer ones, from the new epoch's first whole interval."""
    tuner = Watching()
    with DataLoader(
        Sleepy(n), batch_size=8, num_workers=2, tuner=tuner, tuning_interval_s=interval_s
    ) as dl:
        for _ in range(4):
            assert sorted(int(i) for b in dl for i in b) == list(range(n))
    assert tuner.stepped_on and all(x > 0 for x in tuner.stepped_on), tuner.stepped_on


class BusyTimed(Dataset):
    """40 samples of ~80 ms of pure Python (a kind probe puts them on processes), each saying
    which process read it and when (the monotonic clock, shared by the processes)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        t0 = time.monotonic()
        end = time.thread_time() + 0.08
        while time.thread_time() < end:
            pass
        return {"i": i, "pid": os.getpid(), "t0": t0, "t1": time.monotonic()}


def test_workers_that_serve_during_an_inline_read_take_the_units_after_it():
    """After the kind probe (units 0 and 1), the consumer reads unit 2 inline while the
    workers start (~0.6 s a unit here); once they serve they read unit 3 on, while unit 2 is
    still being read, rather than idle until its read ends."""
    with DataLoader(BusyTimed(), batch_size=8, num_workers="auto") as dl:
        batches = list(dl)
        assert dl.loader._kinds.kind  # the probe placed the stage
    assert sorted(int(i) for b in batches for i in b["i"]) == list(range(40))
    here = [k for k, b in enumerate(batches) if int(b["pid"][0]) == os.getpid()]
    last_inline = max(here)
    assert 0 < last_inline < len(batches) - 1, here
    after = batches[last_inline + 1]
    assert int(after["pid"][0]) != os.getpid()
    # The workers began the next unit before the inline read of this one ended.
    assert float(after["t0"].min()) < float(batches[last_inline]["t1"].max())
