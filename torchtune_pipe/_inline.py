"""Running a pipeline in the calling thread: every stage inline, no worker processes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from multiproc import Skipped, TooManyErrorsError
from multiproc.reducers import DROPPED
from multiproc.spec import too_many_errors

from ._tagging import MapTagged, ReadTagged, TaggedReducer, Work, map_fn, reducer_factory
from .stages import Stage, StageChain

log = logging.getLogger(__name__)


def run_inline(pipeline: StageChain, works: list[Work], epoch: int) -> Iterator[tuple]:
    """Run the pipeline in the calling thread (no workers): the tagged stream of items."""
    src = pipeline.stages[0]
    read = ReadTagged(pipeline.source, skip=src.on_error == "skip")
    stream: Iterator[tuple] = _inline_source(src, (t for w in works for t in read(w)))
    for st in pipeline.stages[1:]:
        stream = _inline_stage(st, stream, epoch)
    return stream


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
                yield fn(t)
            except Exception as e:
                if st.on_error == "raise":
                    raise
                skips.skipped(e, f"item {t[1]} of unit {t[0]}")
        return
    reducer = TaggedReducer(reducer_factory(st))(epoch, 0)
    for t in stream:
        for _, out in reducer.push(None, t):
            if out is not DROPPED:
                yield out
    for _, out in reducer.flush():
        if out is not DROPPED:
            yield out
