"""Tagged items: the stage functions that carry every item's ``(unit, k)`` tag.

An item is ``(unit, k, x)``; a unit's end is ``(unit, -1 - count, None)``; a batch is
``(-1, ids, x)`` with the tags of its items. An end travels through every stage like an item
but is not one: the wrappers mark it (``multiproc.concurrency.not_an_item``), so the stages'
item counters, and the tuners' items per second, count the user's items only. The executor runs these wrappers around the
stages' own functions; the :class:`~torchtune_pipe.loader.core.Loader` strips the tags at the
consumer and records which items were delivered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from multiproc import Batcher, Shuffler, Skipped
from multiproc.concurrency import not_an_item
from torchtune_pipe.errors import PipelineError, StateError
from torchtune_pipe.sources.base import SkippingSource, read_indexed
from torchtune_pipe.stages import Stage


@dataclass(frozen=True, repr=False)
class Work:
    """What the executor's source stage receives: a unit, its position, items to skip."""

    pos: int
    unit: Any
    skip: frozenset = frozenset()

    def __repr__(self) -> str:
        # In error notes, whole (multiproc.items.short_repr cuts at 120 characters): the
        # unit's own repr, and how many of its items a resume skips, not which.
        skip = f", {len(self.skip)} skipped" if self.skip else ""
        return f"Work(pos={self.pos}, unit={self.unit!r}{skip})"


class ReadTagged:
    """Source stage function: the unit's items tagged ``(pos, k, item)``, then its end.

    With ``skip``, an item the source fails to produce is reported as
    :class:`multiproc.Skipped`. A source with ``read_from`` is read on from the next position
    (re-opened with the positions up to the failure skipped, which it does without producing
    them), so exactly the failing item is lost; a unit that fails again with the same error
    before producing another item (it fails to open, not on an item) is given up on there. A plain ``read()`` generator cannot go on
    after raising: the rest of its unit is skipped (one ``Skipped`` says from where).
    """

    def __init__(self, source: Any, skip: bool = False):
        self.source = source
        self.skip = skip

    def calls_per_unit(self, work: Work) -> int | None:
        """The calls the source's read of ``work`` runs at once on the worker's threads; None
        when its units must be read one at a time (:mod:`multiproc.readahead`)."""
        per_unit = getattr(self.source, "calls_per_unit", None)
        return per_unit(work.unit) if per_unit is not None else None

    def __call__(self, work: Work) -> Iterator[Any]:
        count = len(work.skip)  # items delivered before a resume count towards the unit
        skip = set(work.skip)
        repeat = None  # the last error, while no item came after it
        while True:
            last = -1
            try:
                for k, item in read_indexed(self.source, work.unit, frozenset(skip)):
                    last = k
                    count += 1
                    repeat = None
                    yield (work.pos, k, item)
                break
            except Exception as e:
                if not self.skip or isinstance(e, StateError):
                    raise
                failed = last + 1
                while failed in skip:
                    failed += 1
                if not isinstance(self.source, SkippingSource):
                    yield Skipped(e, f"item {failed} and the rest of the unit (a source without "
                                     "read_from cannot read on past a failure)")  # fmt: skip
                    break
                if repeat == (type(e), str(e)):
                    yield Skipped(e, f"item {failed} and the rest of the unit (it keeps failing)")
                    break
                repeat = (type(e), str(e))
                yield Skipped(e, f"item {failed}")
                skip.update(range(failed + 1))  # delivered before it, and itself
        not_an_item()  # the end mark: the stage's counters leave it out
        yield (work.pos, -1 - count, None)


class MapTagged:
    """Map stage function: applies ``fn`` under the tag; ends pass through."""

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn = fn

    def __call__(self, t: tuple) -> tuple:
        u, k, x = t
        if u >= 0 and k < 0:
            not_an_item()
            return t
        return (u, k, self.fn(x))


class CollateTagged:
    """Batch collate: ``(-1, ids of the items, collate(items))``."""

    def __init__(self, collate: Callable[[list], Any] | None):
        self.collate = collate

    def __call__(self, items: list) -> tuple:
        ids: list = []
        xs = []
        for u, k, x in items:
            if u < 0:
                ids.extend(k)
            else:
                ids.append((u, k))
            xs.append(x)
        return (-1, tuple(ids), self.collate(xs) if self.collate is not None else xs)


class TaggedReducer:
    """Stateful stage factory: unit ends bypass the wrapped reducer (shuffle or batch)."""

    def __init__(self, factory: Callable[..., Any]):
        self.factory = factory

    def __call__(self, epoch: int = 0, worker: int = 0) -> _PassEnds:
        return _PassEnds(self.factory(epoch, worker))


class _PassEnds:
    def __init__(self, inner: Any):
        self.inner = inner

    def push(self, tag: Any, t: tuple) -> list:
        if t[0] >= 0 and t[1] < 0:
            not_an_item()
            return [([tag], t)]
        return self.inner.push(tag, t)

    def flush(self) -> list:
        return self.inner.flush()

    def drain(self) -> list:
        return self.inner.drain()


def map_fn(st: Stage) -> Callable[[Any], Any]:
    """A map stage's function (set for every map stage by ``Pipeline.map``)."""
    if st.fn is None:
        raise PipelineError(f"map({st.name!r}): the stage has no function")
    return st.fn


def reducer_factory(st: Stage) -> Callable[..., Any]:
    """The reducer factory of a shuffle or batch stage."""
    if st.kind == "shuffle":
        return Shuffler(st.buffer, st.seed)
    return Batcher(st.size, CollateTagged(st.fn), st.drop_last)
