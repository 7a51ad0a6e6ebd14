"""The Pipeline builder: validation at build time, stage order, spec translation."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from torchtune_pipe import Pipeline, PipelineError
from torchtune_pipe.loader.inline import run_inline
from torchtune_pipe.loader.tagging import Work


def _double(x):
    return x * 2


def _base():
    return Pipeline.from_source(list(range(10)))


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: _base().map(_double, name="m", workers=0), ["map('m')", "workers", "0"]),
        (
            lambda: _base().map(_double, name="m", workers=5, max_workers=2),
            ["map('m')", "max_workers"],
        ),
        (lambda: _base().map(_double, name="m", buffer_bytes=10), ["map('m')", "buffer_bytes"]),
        (lambda: _base().map(42, name="m"), ["map('m')", "fn", "callable"]),
        (lambda: _base().map(_double, name="m", worker_type="gpu"), ["map('m')", "worker_type"]),
        (lambda: _base().map(_double, name="m", on_error="ignore"), ["map('m')", "on_error"]),
        (lambda: _base().map(_double, name="source"), ["'source'", "already used"]),
        (lambda: _base().batch(0), ["batch('batch')", "size", "0"]),
        (lambda: _base().batch(4, collate=3), ["batch('batch')", "collate"]),
        (lambda: _base().batch(4, drop_last="yes", collate=None), ["batch('batch')", "drop_last"]),
        (lambda: _base().shuffle(-1), ["shuffle('shuffle')", "buffer"]),
        (lambda: _base().shuffle(8, seed=1.5), ["shuffle('shuffle')", "seed"]),
        (lambda: _base().prefetch(0), ["prefetch()", "depth"]),
        (
            lambda: _base().prefetch(2).map(_double, name="late"),
            ["map('late')", "prefetch() must be the last"],
        ),
        (lambda: _base().prefetch(2).prefetch(2), ["prefetch()", "already"]),
        (lambda: Pipeline.from_source(object()), ["from_source()", "source"]),
        (lambda: Pipeline.from_source([1], workers=-1), ["from_source()", "workers"]),
    ],
)
def test_bad_arguments_fail_at_build_time_naming_stage_and_argument(build, words):
    with pytest.raises(PipelineError) as info:
        build()
    for w in words:
        assert w in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unpicklable_function_fails_at_build_for_process_workers_only():
    lock = threading.Lock()

    def uses_lock(x):
        with lock:
            return x

    with pytest.raises(PipelineError, match="map\\('locked'\\): fn does not pickle"):
        _base().map(uses_lock, name="locked")
    pipe = _base().map(uses_lock, name="locked", worker_type="thread")
    assert pipe.stages[-1].worker_type == "thread"


def test_builder_is_immutable_and_names_default_from_function():
    base = _base()
    a = base.map(_double)
    b = a.map(_double)
    assert [s.name for s in base.stages] == ["source"]
    assert [s.name for s in b.stages] == ["source", "_double", "_double_1"]
    assert repr(b.batch(2, collate=None).prefetch(3)).endswith("batch('batch') -> prefetch(3))")


def test_spec_maps_stages_and_bounds_stateful_stages_in_ordered_mode():
    pipe = (
        _base().map(_double, workers=3, max_workers=8).shuffle(4).batch(2, workers=2, collate=None)
    )
    kinds = [s.kind for s in pipe.spec().stages]
    assert kinds == ["source", "map", "stateful", "stateful"]
    ordered = pipe.spec(ordered=True)
    assert ordered.ordered
    assert [s.max_workers for s in ordered.stages] == [64, 8, 1, 1]
    assert [s.workers for s in ordered.stages] == [1, 3, 1, 1]
    assert [s.max_workers for s in pipe.spec().stages][3] == 64


def _run(pipe, epoch=0):
    works = [Work(i, u) for i, u in enumerate(pipe.source.units(epoch))]
    out = []
    for u, k, x in run_inline(pipe, works, epoch):
        if u >= 0 and k < 0:
            continue
        out.append(x)
    return out


def test_papers_order_and_common_order_both_run():
    # load -> batch -> shuffle -> UDF (on whole batches); load -> shuffle -> UDF -> batch
    paper = _base().batch(3, collate=None).shuffle(2, seed=1).map(sum, name="udf")
    common = _base().shuffle(4, seed=1).map(_double).batch(3, collate=tuple)
    sums = _run(paper)
    assert sorted(sums) == sorted([0 + 1 + 2, 3 + 4 + 5, 6 + 7 + 8, 9])
    batches = _run(common)
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert Counter(x for b in batches for x in b) == Counter(2 * i for i in range(10))


def test_drop_last_and_seeded_shuffle_are_deterministic_per_epoch():
    pipe = _base().shuffle(5, seed=7).batch(4, drop_last=True, collate=None)
    a, b, c = _run(pipe, 0), _run(pipe, 0), _run(pipe, 1)
    assert a == b
    assert [len(x) for x in a] == [4, 4]
    assert a != c or len(a) == 0


def _sample(i):
    return {"x": torch.full((2,), float(i)), "label": i}


def test_batch_collates_like_torch_by_default_and_collate_none_keeps_the_list():
    samples = [_sample(i) for i in range(10)]
    pipe = Pipeline.from_source(samples).batch(4)
    expected = list(torch.utils.data.DataLoader(samples, batch_size=4))
    with pipe.loader(ordered=True) as loader:  # collated in a worker process
        workers = list(loader)
    with pipe.loader(inline=True) as loader:
        inline = list(loader)
    for got in (workers, inline):
        assert len(got) == len(expected) == 3
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a["x"], b["x"]) and torch.equal(a["label"], b["label"])
    plain = Pipeline.from_source(samples).batch(4, collate=None)
    with plain.loader(ordered=True) as loader:
        first = next(iter(loader))
    assert isinstance(first, list) and len(first) == 4 and first[0]["label"] == 0
