"""Fusion on a live pipeline: the seam reports it, allocations switch it, nothing is lost."""

from __future__ import annotations

import time

import pytest

from torchtune_pipe import DataLoader, Pipeline
from torchtune_pipe.tuning.base import Allocation

from .test_loader import Ids, _take

MiB = 1 << 20


def _double(x):
    return 2 * x


def _minus_one(x):
    return x - 1


def _pipe(fused: bool, per_unit: int = 200) -> Pipeline:
    return (
        Pipeline.from_source(Ids(n_units=20, per_unit=per_unit), max_workers=4)
        .map(_double, max_workers=4)
        .map(_minus_one, max_workers=4, fused=fused)
    )


def _observe_until(loader, cond, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        obs = loader.observe()
        if obs is not None and cond(obs):
            return obs
        assert time.monotonic() < deadline, obs
        time.sleep(0.05)


def test_the_observation_reports_a_fused_stage_and_an_allocation_splits_it():
    want = sorted(2 * x - 1 for x in range(20 * 200))
    with _pipe(fused=True).loader(persistent_workers=True) as loader:
        it = iter(loader)
        got = _take(it, 500)
        obs = _observe_until(loader, lambda o: o.stages[2].workers == 0)
        assert [s.fused for s in obs.stages] == [False, False, True]
        assert obs.stages[2].fusable and not obs.stages[0].fusable
        assert obs.allocation().fused == (False, False, True)
        split = Allocation((1, 1, 2), (MiB,) * 3, fused=(False, False, False))
        loader.tunable.apply(split)
        got += _take(it, 500)
        obs = _observe_until(loader, lambda o: o.stages[2].workers == 2)
        assert not obs.stages[2].fused
        loader.tunable.apply(split.replace(fused=(False, True, True)))  # all in the source
        got += list(it)
        assert loader.tunable.executor.fused() == (False, True, True)
    assert sorted(got) == want


def test_a_tuner_that_starts_fused_gets_its_shape_from_the_first_worker_on(monkeypatch):
    # No worker is started for a stage only to be fused away by the tuner's first step.
    from multiproc.lifecycle import WorkerPool

    spawned: list[int] = []
    spawn = WorkerPool.spawn

    def counting(self, stage, *args, **kwargs):
        spawned.append(stage)
        return spawn(self, stage, *args, **kwargs)

    monkeypatch.setattr(WorkerPool, "spawn", counting)
    want = sorted(2 * x - 1 for x in range(20 * 200))
    with _pipe(fused=False).loader(tuner="intune") as loader:
        it = iter(loader)
        got = _take(it, 10)
        assert loader.tunable.executor.fused() == (False, True, True)
        got += list(it)
    assert sorted(got) == want
    assert spawned and set(spawned) == {0}, spawned


def test_a_fused_stages_time_is_its_own_and_a_share_of_its_hosts_workers():
    with _pipe(fused=True, per_unit=2000).loader() as loader:
        it = iter(loader)
        _take(it, 10_000)
        obs = _observe_until(loader, lambda o: o.stages[2].items_per_s > 0)
        s = obs.stages[2]
        assert s.workers == 0 and 0 < s.busy <= 1 and s.cpu_s_per_item > 0
        list(it)


@pytest.mark.parametrize("fused_before, fused_after", [(True, False), (False, True)])
def test_resume_across_a_fusion_change(fused_before, fused_after):
    with _pipe(fused=False).loader(ordered=True, inline=True) as loader:
        full = list(loader)
    with _pipe(fused=fused_before).loader(ordered=True) as loader:
        it = iter(loader)
        head = _take(it, 1_234)
        state = loader.state_dict()
    with _pipe(fused=fused_after).loader(ordered=True) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert head + rest == full


def test_dataloader_auto_starts_with_collate_in_the_fetch_workers():
    import torch

    data = torch.arange(4_000)
    with DataLoader(data, batch_size=16, num_workers="auto") as dl:
        assert [(s.name, s.fused) for s in dl.pipeline.stages] == [
            ("fetch", False),
            ("collate", True),
        ]
        assert torch.equal(torch.cat(list(dl)), data)
