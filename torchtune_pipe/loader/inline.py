"""Running a pipeline in the calling thread: every stage inline, no worker processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from multiproc import Skipped, TooManyErrorsError
from multiproc.items import short_repr
from multiproc.reducers import DROPPED
from multiproc.spec import too_many_errors
from torchtune_pipe.loader.tagging import (
    MapTagged,
    ReadTagged,
    TaggedReducer,
    Work,
    map_fn,
    reducer_factory,
)
from torchtune_pipe.sources.rng import isolated_rng
from torchtune_pipe.sources.views import standing_in
from torchtune_pipe.stages import PipelineLike, Stage

log = logging.getLogger(__name__)


def run_inline(
    pipeline: PipelineLike, works: list[Work], epoch: int, isolate: bool = False
) -> Iterator[tuple]:
    """Run the pipeline in the calling thread (no workers): the tagged stream of items.
    ``isolate``: each work unit is read whole, the global random generators put back as they
    were before it, from a view of the dataset (:mod:`~torchtune_pipe.sources.views`): a source
    that seeds reads per unit, as for workers, leaves the caller's draws and its dataset's
    state alone, as workers do."""
    src = pipeline.stages[0]
    read = ReadTagged(pipeline.source, skip=src.on_error == "skip")
    stream: Iterator[tuple] = _inline_source(src, _read(src, read, works, isolate))
    for st in pipeline.stages[1:]:
        stream = _inline_stage(st, stream, epoch)
    return stream


def _note(e: BaseException, st: Stage, where: str) -> None:
    """Say where ``e`` was raised, as the executor says it of a worker's error."""
    if hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(
            f"raised in stage {st.name!r}, in the calling process (pid {os.getpid()}), {where}"
        )


def _read(st: Stage, read: ReadTagged, works: list[Work], isolate: bool) -> Iterator[Any]:
    """The works' tagged items (each unit read whole within :func:`isolated_rng`, standing in
    for a worker, where ``isolate``)."""
    for w in works:
        if not isolate:
            yield from _unit(st, read, w)
            continue
        with isolated_rng(), standing_in():
            got = list(_unit(st, read, w))
        yield from got


def _unit(st: Stage, read: ReadTagged, w: Work) -> Iterator[Any]:
    """A work unit's tagged items; an error names the unit and the item it was reading."""
    items = read(w)
    k = 0
    while True:
        try:
            t = next(items)
        except StopIteration:
            break
        except Exception as e:
            _note(e, st, f"work unit {short_repr(w)}, item {k}")
            raise
        if type(t) is tuple and t[1] >= 0:
            k = t[1] + 1
        yield t


def _item(t: tuple) -> str:
    """A tagged item in words: its place in its work unit, or a batch's items'."""
    if t[0] >= 0:
        return f"item {t[1]} of work unit {t[0]}"
    return f"the batch of (work unit, item) {short_repr(list(t[1]))}"


class _Skips:
    """Skipped items of an inline stage: the first logged, the count bounded by max_errors
    (what the executor does for worker stages)."""

    def __init__(self, st: Stage):
        self.st = st
        self.items_in = 0
        self.count = 0
        self.last: list[str] = []

    def skipped(self, exc: BaseException, where: str) -> None:
        self.count += 1
        self.last = (self.last + [f"{where}: {type(exc).__name__}: {exc}"])[-3:]
        if self.count == 1:
            log.warning(
                "stage %r skipped an item (on_error='skip'): %s", self.st.name, self.last[0]
            )
        if too_many_errors(self.count, self.items_in, self.st.max_errors):
            raise TooManyErrorsError(
                f"stage {self.st.name!r}: {self.count} items skipped of {self.items_in} taken in, "
                f"more than max_errors={self.st.max_errors!r} allows; last errors: "
                + "; ".join(self.last)
            )


def _inline_source(st: Stage, stream: Iterator[Any]) -> Iterator[tuple]:
    skips = _Skips(st)
    for t in stream:
        if type(t) is Skipped:
            skips.items_in += 1
            skips.skipped(t.error, t.where)
            continue
        skips.items_in += 1
        yield t


def _inline_stage(st: Stage, stream: Iterator[tuple], epoch: int) -> Iterator[tuple]:
    if st.kind == "map":
        fn = MapTagged(map_fn(st))
        skips = _Skips(st)
        for t in stream:
            skips.items_in += 1
            try:
                out = fn(t)
            except Exception as e:
                if st.on_error == "raise":
                    _note(e, st, _item(t))
                    raise
                skips.skipped(e, f"item {t[1]} of unit {t[0]}")
                continue
            yield out
        return
    reducer = TaggedReducer(reducer_factory(st))(epoch, 0)
    for t in stream:
        try:
            ready = reducer.push(None, t)
        except Exception as e:
            _note(e, st, _item(t))
            raise
        for _, out in ready:
            if out is not DROPPED:
                yield out
    try:
        ready = reducer.flush()
    except Exception as e:
        _note(e, st, "the end of the epoch (the items it held)")
        raise
    for _, out in ready:
        if out is not DROPPED:
            yield out
