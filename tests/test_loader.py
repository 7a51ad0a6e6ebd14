"""The Loader: epochs, determinism, exact resume under any allocation, tuning hooks, cleanup."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from torchtune_pipe import Loader, LoaderTimeoutError, Pipeline, StateError, transfer
from torchtune_pipe.tuning.base import Allocation


class Ids:
    """Units are ranges of ids: any number of workers can share it."""

    def __init__(self, n_units=6, per_unit=5):
        self.n_units, self.per_unit = n_units, per_unit

    def __len__(self):
        return self.n_units * self.per_unit

    def units(self, epoch=0):
        return list(range(self.n_units))

    def read(self, unit):
        base = unit * self.per_unit
        return range(base, base + self.per_unit)


def _plus_one(x):
    return x + 1


def _flat(batches):
    return [x for b in batches for x in (b if isinstance(b, list) else [b])]


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_ordered_loader_matches_inline_and_is_reiterable():
    pipe = Pipeline.from_source(Ids(), workers=2).map(_plus_one, workers=2).batch(4, collate=None)
    with pipe.loader(inline=True) as ref_loader:
        ref = list(ref_loader)
    with pipe.loader(ordered=True) as loader:
        assert list(loader) == ref
        assert list(loader) == ref  # second epoch reuses the workers
        assert loader.epoch == 2
        assert len(loader) == 8
    assert _flat(ref) == list(range(1, 31))


def test_seeded_shuffle_is_deterministic_per_epoch_and_differs_across_epochs():
    pipe = Pipeline.from_source(Ids()).shuffle(8, seed=3).batch(5, collate=None)
    with pipe.loader(ordered=True) as loader:
        loader.set_epoch(4)
        a = list(loader)
        loader.set_epoch(4)
        b = list(loader)
        c = list(loader)  # epoch 5
    assert a == b
    assert a != c
    assert sorted(_flat(a)) == list(range(30))


@pytest.mark.parametrize("workers", [1, 2])
def test_mid_epoch_resume_yields_exactly_the_rest(workers):
    pipe = Pipeline.from_source(Ids(), workers=workers, max_workers=4).map(
        _plus_one, workers=workers
    )
    with pipe.loader(inline=True) as loader:  # the ordered output (first test)
        full = list(loader)
    with pipe.loader(ordered=True) as loader:
        it = iter(loader)
        head = _take(it, 13)
        state = loader.state_dict()
    with pipe.loader(ordered=True) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert head + rest == full


def test_resume_after_the_allocation_changed_between_save_and_load():
    pipe = (
        Pipeline.from_source(Ids(), workers=1, max_workers=4)
        .map(_plus_one, max_workers=4)
        .batch(3, collate=None)
    )
    with pipe.loader(inline=True) as loader:
        full = list(loader)
    with pipe.loader(ordered=True) as loader:
        it = iter(loader)
        head = _take(it, 4)
        loader.tunable.apply(Allocation((3, 2, 1), (1 << 20, 1 << 20, 1 << 20)))
        head += _take(it, 1)
        state = loader.state_dict()
        assert loader.tunable.allocation().workers[2] == 1  # ordered: one batcher
    wider = (
        Pipeline.from_source(Ids(), workers=2, max_workers=4)
        .map(_plus_one, workers=2)
        .batch(3, collate=None)
    )
    with wider.loader(ordered=True, tuner="unoptimized") as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert head + rest == full


def test_unordered_resume_with_shuffle_delivers_the_missing_items_exactly_once():
    pipe = Pipeline.from_source(Ids()).shuffle(4).map(_plus_one, workers=2).batch(4, collate=None)
    with pipe.loader() as loader:
        it = iter(loader)
        head = _flat(_take(it, 3))
        state = loader.state_dict()
    with pipe.loader() as loader:
        loader.load_state_dict(state)
        rest = _flat(list(loader))
    assert sorted(head + rest) == list(range(1, 31))


def test_state_after_a_finished_epoch_starts_the_next_epoch():
    pipe = Pipeline.from_source(Ids(2, 2))
    with pipe.loader(inline=True) as loader:
        list(loader)
        state = loader.state_dict()
        assert state["finished"] and state["epoch"] == 0
        loader.load_state_dict(state)
        assert list(loader) == [0, 1, 2, 3]
        assert loader.epoch == 2
    with pytest.raises(StateError):
        pipe.loader(inline=True).load_state_dict({"version": 99})


class _Shrink:
    """A tuner that gives every stage one worker (within any CPU limit)."""

    def __init__(self):
        self.steps = 0

    def reset(self, obs, start=None):
        return self.step(obs)

    def step(self, obs):
        self.steps += 1
        return Allocation((1, 1), tuple(s.buffer_bytes for s in obs.stages))


def test_a_tuner_steers_the_running_pipeline():
    pipe = Pipeline.from_source(Ids(), max_workers=2).map(_plus_one, workers=2, max_workers=2)
    tuner = _Shrink()
    with pipe.loader(
        tuner=tuner, ordered=True, tuning_interval_s=0.05, persistent_workers=True
    ) as loader:
        out = list(loader)
        assert tuner.steps >= 1  # the loop's first decision runs before the loop stops
        deadline = time.monotonic() + 10
        while loader.tunable.executor.snapshot().stages[1].workers != 1:
            assert time.monotonic() < deadline, "the tuner's allocation was never applied"
            time.sleep(0.01)  # polling with a deadline: resizes have no completion event
        obs = loader.observe()
    assert out == list(range(1, 31))
    assert [s.name for s in obs.stages] == ["source", "_plus_one"]


class _Boom(Exception):
    pass


def test_cleanup_on_break_exception_close_and_gc():
    pipe = Pipeline.from_source(Ids()).map(_plus_one)
    loader = pipe.loader()
    for _ in loader:
        break
    assert loader._executor is None  # a broken-off epoch stops its workers
    with pytest.raises(_Boom):
        for _ in loader:
            raise _Boom
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(RuntimeError, match="after close"):
        iter(loader)
    loader = pipe.loader()
    next(iter(loader))
    del loader
    gc.collect()  # the conftest fixture checks that no worker or segment is left


def _explode(x):
    if x == 7:
        raise KeyError("item 7")
    return x


def test_stage_exception_reaches_the_consumer_with_its_type():
    pipe = Pipeline.from_source(Ids()).map(_explode)
    with pipe.loader() as loader, pytest.raises(KeyError, match="item 7"):
        list(loader)
    with pipe.loader(inline=True) as loader, pytest.raises(KeyError):
        list(loader)
    skipping = Pipeline.from_source(Ids()).map(_explode, on_error="skip")
    with skipping.loader(inline=True) as loader:
        assert 7 not in list(loader)


class _Gate:
    def __init__(self, event):
        self.event = event

    def units(self, epoch=0):
        return [0]

    def read(self, unit):
        yield 1
        self.event.wait(10)
        yield 2


def test_timeout_raises_when_no_item_arrives():
    gate = threading.Event()
    loader = Loader(Pipeline.from_source(_Gate(gate)), inline=True, timeout_s=0.2)
    it = iter(loader)
    assert next(it) == 1
    with pytest.raises(LoaderTimeoutError, match="timeout_s=0.2"):
        next(it)
    gate.set()
    loader.close()


def test_prefetch_moves_nested_tensors():
    class Nt(tuple):
        pass

    from collections import namedtuple

    from tensordict import TensorDict

    P = namedtuple("P", "a b")
    batch = {"x": [torch.ones(2), (torch.zeros(1), "s")], "p": P(torch.ones(1), 3)}
    out = transfer(batch, pin_memory=False, device="cpu")
    assert torch.equal(out["x"][0], torch.ones(2)) and out["x"][1][1] == "s"
    assert isinstance(out["p"], P)
    td = TensorDict({"a": torch.ones(3)}, batch_size=[3])
    assert transfer(td, device="cpu")["a"].device.type == "cpu"
    pipe = (
        Pipeline.from_source(Ids(2, 3))
        .map(torch.tensor, worker_type="thread")
        .prefetch(2, device="cpu")
    )
    with pipe.loader(ordered=True) as loader:
        got = list(loader)
    assert [int(t) for t in got] == list(range(6))


def test_len_needs_a_length_when_the_source_has_none():
    with pytest.raises(TypeError, match="length="):
        len(Pipeline.from_source(_Gate(threading.Event())).loader(inline=True))
    assert len(Pipeline.from_source(_Gate(None)).loader(inline=True, length=2)) == 2
    assert (
        len(Pipeline.from_source(Ids()).batch(4, drop_last=True, collate=None).loader(inline=True))
        == 7
    )


def test_progress_display_runs_beside_the_epoch_and_stops_with_it():
    pipe = Pipeline.from_source(Ids()).map(_plus_one)
    with pipe.loader(ordered=True, progress=True) as loader:
        assert list(loader) == list(range(1, 31))
    assert not [t for t in threading.enumerate() if t.name == "ttp-watch"]


def test_fresh_workers_each_epoch_keep_the_allocation_the_tuner_reached():
    # persistent_workers=False (the default): the workers of an epoch stop at its end; the
    # next epoch's start from a new snapshot with the allocation the tuner left.
    pipe = Pipeline.from_source(Ids(), max_workers=2).map(_plus_one, workers=2, max_workers=2)
    tuner = _Shrink()
    with pipe.loader(tuner=tuner, ordered=True, tuning_interval_s=0.02) as loader:
        it = iter(loader)
        out = [next(it)]
        deadline = time.monotonic() + 10
        while loader.tunable.executor.snapshot().stages[1].workers != 1:
            assert time.monotonic() < deadline, "the tuner's allocation was never applied"
            time.sleep(0.01)  # polling with a deadline: resizes have no completion event
        out += list(it)
        first = loader._executor
        assert first is None  # stopped with its epoch
        assert loader.observe().stages[1].workers == 1  # the last epoch's, as it stopped
        it = iter(loader)
        out += [next(it)]
        assert loader.tunable.executor.spec.stages[1].workers == 1  # started as it was left
        out += list(it)
    assert out == list(range(1, 31)) * 2


def test_stopping_at_len_completes_the_epoch_and_keeps_the_workers():
    """Lightning stops after len(loader) batches without asking for the end of the stream."""
    pipe = Pipeline.from_source(Ids(), workers=2).map(_plus_one).batch(4, collate=None)
    with pipe.loader(ordered=True, persistent_workers=True) as loader:
        it = iter(loader)
        first = _take(it, len(loader))
        executor = loader._executor
        it.close()
        assert loader.epoch == 1 and loader._executor is executor
        second = list(loader)
        assert loader._executor is executor
    assert sorted(_flat(first)) == sorted(_flat(second)) == list(range(1, 31))


class _Movable:
    """Stands for batch types that pin and move themselves (TorchRec's Batch)."""

    def __init__(self, pinned=False, device=None):
        self.pinned, self.device = pinned, device

    def pin_memory(self):
        return _Movable(True, self.device)

    def to(self, device, non_blocking=False):
        return _Movable(self.pinned, device)


def test_transfer_uses_an_objects_own_pin_memory_and_to():
    out = transfer({"b": _Movable()}, pin_memory=True, device="cpu")
    assert out["b"].pinned and out["b"].device == "cpu"
