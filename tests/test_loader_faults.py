"""The Loader under faults and misuse: forked children, a new iter() mid-epoch, two threads,
dropped loaders, failing items, bad state dicts, a stuck stage."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from torchtune_pipe import Loader, LoaderTimeoutError, Pipeline, StateError

from .test_loader import Ids, _explode, _flat, _Gate, _plus_one, _take

_FORKED_GC = """
import gc, multiprocessing, sys, torch
from torchtune_pipe import Pipeline

def collect(*_):
    gc.collect()  # meets the dropped loader below, in the forked child
    return 0

class Collect(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return collect() + i

if __name__ == "__main__":
    pipe = Pipeline.from_source(list(range(400))).map(abs)
    gc.disable()  # keep the dropped loader for the forked children's collector
    dropped = pipe.loader()
    assert len(list(dropped)) == 400  # its executor stays up for the next epoch
    dropped.cycle = dropped
    del dropped
    live = pipe.loader()
    it = iter(live)
    got = [next(it)]
    # A torch DataLoader (two forked workers), then a user's multiprocessing forks.
    dl = torch.utils.data.DataLoader(Collect(), num_workers=2, batch_size=2)
    assert sorted(x for b in dl for x in b.tolist()) == [0, 1, 2, 3]
    for rep in range({reps} - 2):
        p = multiprocessing.get_context("fork").Process(target=collect)
        p.start()
        p.join(20)
        if p.exitcode != 0:
            sys.exit(f"forked child {{rep}}: exit code {{p.exitcode}} (None: hung)")
        got.append(next(it))
    got.extend(it)
    assert sorted(got) == list(range(400)), len(got)
    gc.enable()
    gc.collect()
    live.close()
    print("OK")
"""


def test_forked_children_never_run_the_loaders_finalizers():
    """Twenty forked children (two torch DataLoader workers, then multiprocessing forks)
    collect a dropped loader: no hang, no traceback, and a live loader iterating meanwhile
    still delivers every item exactly once."""
    from . import _subproc

    r = _subproc.run(_FORKED_GC.format(reps=20), timeout_s=120)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]


def test_a_new_iter_starts_a_new_epoch_and_the_old_iterator_says_so():
    pipe = Pipeline.from_source(Ids(), workers=2).map(_plus_one)
    with pipe.loader() as loader:
        first = iter(loader)
        _take(first, 3)
        peek = next(iter(loader))  # a peek at a batch, as users do
        assert peek in range(1, 31)
        with pytest.raises(RuntimeError, match="ended by a new iter"):
            next(first)
        assert sorted(loader) == list(range(1, 31))  # a fresh, complete epoch


class _Entered(_Gate):
    """Says when a reader waits at the gate."""

    def __init__(self, event):
        super().__init__(event)
        self.entered = threading.Event()

    def read(self, unit):
        yield 1
        self.entered.set()
        self.event.wait(10)
        yield 2


def test_two_threads_on_one_loader_get_a_clear_error():
    gate = threading.Event()
    source = _Entered(gate)
    loader = Loader(Pipeline.from_source(source), inline=True)
    it = iter(loader)
    assert next(it) == 1
    got = []
    t = threading.Thread(target=lambda: got.append(next(it)))
    t.start()
    assert source.entered.wait(10)  # the other thread is inside next(), at the gate
    try:
        with pytest.raises(RuntimeError, match="two threads"):
            next(it)
        with pytest.raises(RuntimeError, match="another thread"):
            iter(loader)
    finally:
        gate.set()
        t.join(10)
    assert got == [2]
    loader.close()


def test_an_unreferenced_loader_stops_its_workers_without_the_collector():
    import psutil

    from . import _subproc

    loader = Pipeline.from_source(Ids(), workers=2).map(_plus_one).loader(persistent_workers=True)
    assert sorted(loader) == list(range(1, 31))  # the workers stay up for the next epoch
    snap = loader._executor.snapshot(per_worker=True)
    procs = _subproc.processes(w.pid for s in snap.stages for w in s.per_worker)
    gc.disable()
    try:
        del loader, snap
        _, alive = psutil.wait_procs(procs, timeout=5)
        assert not alive, f"workers of a dropped loader still run: {alive}"
    finally:
        gc.enable()


_NO_CLOSE = """
from torchtune_pipe import Pipeline

pipe = Pipeline.from_source(list(range(300)), workers=2).map(abs, workers=2)
kept = pipe.loader()
assert sorted(kept) == list(range(300))  # workers kept for the next epoch
half = pipe.loader()
it = iter(half)
next(it)  # an epoch left half-way
print("done", flush=True)
"""


def test_a_script_that_never_closes_exits_silently_and_cleanly():
    from . import _subproc

    code, err, left, segs = _subproc.leftovers(_NO_CLOSE, "done")
    assert code == 0 and err == "", err
    assert not left and not segs, (left, segs)


class _BadAt:
    """Items ``0..n-1`` of one unit per ``n``; reading item ``bad`` raises (a corrupt record)."""

    def __init__(self, n_units=2, per_unit=200, bad=(100,)):
        self.n_units, self.per_unit, self.bad = n_units, per_unit, set(bad)

    def __len__(self):
        return self.n_units * self.per_unit

    def units(self, epoch=0):
        return list(range(self.n_units))

    def read(self, unit):
        for i in range(unit * self.per_unit, (unit + 1) * self.per_unit):
            if i in self.bad:
                raise ValueError(f"corrupt record {i}")
            yield i


class _BadAtIndexed(_BadAt):
    """The same, read by position: skipped positions are never produced (as a map-style
    dataset's indices)."""

    def read_from(self, unit, skip):
        for i in range(unit * self.per_unit, (unit + 1) * self.per_unit):
            k = i - unit * self.per_unit
            if k in skip:
                continue
            if i in self.bad:
                raise ValueError(f"corrupt record {i}")
            yield k, i


@pytest.mark.parametrize("inline", [False, True])
def test_a_failing_source_item_is_skipped_exactly(inline, caplog):
    bad = (100, 250, 251)
    pipe = Pipeline.from_source(_BadAtIndexed(bad=bad), on_error="skip")
    with pipe.loader(inline=inline, persistent_workers=not inline) as loader:
        assert sorted(loader) == [i for i in range(400) if i not in bad]
        if not inline:
            assert loader._executor.snapshot().stages[0].errors == 3
    assert "skipped an item" in caplog.text and "corrupt record 100" in caplog.text
    # A generator cannot go on after raising: what it made stays, the rest of its unit goes.
    plain = Pipeline.from_source(_BadAt(bad=bad), on_error="skip")
    with plain.loader(inline=inline) as loader:
        assert sorted(loader) == list(range(100)) + list(range(200, 250))
    assert "the rest of the unit" in caplog.text


@pytest.mark.parametrize("inline", [False, True])
def test_skips_past_max_errors_raise_with_counts(inline):
    from multiproc import TooManyErrorsError

    bad = range(0, 400, 3)  # a third of the items
    pipe = Pipeline.from_source(_BadAtIndexed(bad=bad), on_error="skip", max_errors=0.1)
    with pipe.loader(inline=inline) as loader, pytest.raises(TooManyErrorsError) as e:
        list(loader)
    assert "items skipped of" in str(e.value) and "corrupt record" in str(e.value)


def test_load_state_dict_checks_fields_and_the_pipeline_that_saved_it():
    pipe = Pipeline.from_source(Ids(n_units=5, per_unit=10)).batch(4, collate=None)
    with pipe.loader(ordered=True) as loader:
        it = iter(loader)
        _take(it, 3)
        state = loader.state_dict()
    other = Pipeline.from_source(Ids(n_units=5, per_unit=7)).batch(
        4, collate=None
    )  # same unit count
    with other.loader() as loader, pytest.raises(StateError, match="fingerprint"):
        loader.load_state_dict(state)
    for field, value, match in [
        ("epoch", -1, r"state\['epoch'\]"),
        ("finished", "no", r"state\['finished'\]"),
        ("done", [0, "x"], r"state\['done'\]"),
        ("partial", [1, 2], r"state\['partial'\]"),
        ("partial", {"u": [1]}, r"state\['partial'\] has a key"),
        ("partial", {4: [1, -2]}, r"state\['partial'\]\[4\]"),
        ("delivered", 1.5, r"state\['delivered'\]"),
    ]:
        with pipe.loader() as loader, pytest.raises(StateError, match=match):
            loader.load_state_dict({**state, field: value})
    with pipe.loader() as loader:  # positions past a unit's end: found when it is read
        loader.load_state_dict({**state, "partial": {3: range(1000)}})
        with pytest.raises(StateError, match="position 999 of a unit of 10"):
            list(loader)
    with pipe.loader(ordered=True) as loader:  # the state as JSON gives it back still loads
        import json

        loader.load_state_dict(json.loads(json.dumps(state)))
        assert len(_flat(list(loader))) == 50 - 12


def test_observe_after_close_or_a_failed_epoch_says_why():
    pipe = Pipeline.from_source(Ids()).map(_explode)
    loader = pipe.loader()
    with pytest.raises(KeyError):
        list(loader)
    with pytest.raises(RuntimeError, match="ended early with KeyError"):
        loader.observe()
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        loader.observe()


def _stuck_on_3(x):
    if x == 3:
        time.sleep(30)
    return x


def test_timeout_names_the_stuck_stage_worker_and_item():
    pipe = Pipeline.from_source(Ids(n_units=1, per_unit=8)).map(_stuck_on_3, name="udf")
    with pipe.loader(timeout_s=1.0) as loader, pytest.raises(LoaderTimeoutError) as e:
        list(loader)
    msg = str(e.value)
    assert "stage 'udf' worker" in msg and "in its function for" in msg and "item 3 of frame" in msg
    assert e.value.stuck and e.value.stuck[0].stage == "udf"


@pytest.mark.slow
def test_resizing_every_stage_while_frames_are_let_go_of_early_frees_each_block_once():
    # A worker may let go of a frame's memory (its items copied out, e.g. into a batch) and
    # say so before it reports the frame done; a worker retired or started meanwhile must not
    # free that block a second time: a block freed twice is reused under a frame still in
    # flight (its reader saw zeros, or the producer's allocator failed). The walk over
    # allocations is the live oracle search's (benchmarks/tuners_real.py).
    import itertools

    from benchmarks import _real_fns

    recipe = _real_fns.recipes(scale=0.2)["batch_heavy"]
    with recipe.build((1, 1, 1)).loader(timeout_s=60.0) as loader:
        it = iter(loader)
        next(it)
        ex = loader.tunable.executor
        for alloc in itertools.product(range(1, 4), repeat=3):
            for i, w in enumerate(alloc):
                ex.resize(i, w)
            end = time.monotonic() + 0.2
            for batch in it:
                assert batch.shape[0] == 64  # a batch of 64 items, whole and readable
                if time.monotonic() > end:
                    break
        del it
