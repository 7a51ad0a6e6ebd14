"""A ``worker_type="auto"`` stage on a live pipeline: the kind rule moves its workers to
threads and judges them, every item arrives once, and the observations say which kind ran."""

from __future__ import annotations

import time

import pytest

from torchtune_pipe import Pipeline


def _wait(x):
    time.sleep(0.002)  # releases the GIL, as a read or a decode in C does
    return x


@pytest.mark.parametrize("ordered", [False, True])
def test_an_auto_stage_is_tried_on_threads_and_every_item_arrives_once(ordered):
    pipe = Pipeline.from_source(list(range(2500))).map(_wait, workers=2, worker_type="auto")
    threads_seen = set()
    with pipe.loader(tuning_interval_s=0.1, ordered=ordered) as loader:
        got = []
        for x in loader:
            got.append(x)
            obs = loader.tunable.meter.last if loader.tunable is not None else None
            if obs is not None:
                threads_seen.add(obs.stages[1].threads)
                assert obs.stages[1].threadable and not obs.stages[0].threadable
        rule = loader._kinds
    assert got == list(range(2500)) if ordered else sorted(got) == list(range(2500))
    assert [d[0] for d in rule.decisions][:1] == ["try"], rule.decisions
    assert 2 in threads_seen  # an observation saw both workers on threads
    assert 0 in threads_seen


def test_a_stage_of_another_worker_type_keeps_its_kind():
    pipe = Pipeline.from_source(list(range(800))).map(_wait, workers=2)
    with pipe.loader(tuning_interval_s=0.05) as loader:
        assert sorted(loader) == list(range(800))
        assert loader._kinds.decisions == []
        assert loader._tuning is None  # no tuner, no "auto" stage: no loop at all
