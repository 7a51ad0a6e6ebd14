"""The Pipeline builder: declarative, validated stages that become an executor spec.

A :class:`Pipeline` is immutable; every builder method returns a new one, so a base pipeline
can be extended several ways. Stages run in the order they are added, and any number of map
stages can sit anywhere, so both the paper's ``load -> batch -> shuffle -> UDF -> prefetch``
and the common ``load -> shuffle -> UDF -> batch`` are plain chains.

Items travel tagged: the source wraps every item as ``(unit, k, item)`` and every unit ends
with a marker ``(unit, -1 - count, None)``; maps keep the tag, batches carry the tags of their
items as ``(-1, ids, batch)``. The :class:`~torchtune_pipe.loader.Loader` strips the tags at
the consumer and uses them to know exactly which items were delivered, which is what makes
resuming independent of worker counts.

Example:
    >>> pipe = (Pipeline.from_source(LineFileSource("day_*.tsv"), workers=2)   # doctest: +SKIP
    ...         .map(parse, name="parse", workers=2)
    ...         .shuffle(10_000)
    ...         .batch(512, collate=collate)
    ...         .prefetch(2, pin_memory=True))
    >>> for batch in pipe.loader(tuner="heuristic"): ...                     # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import cloudpickle
from torch.utils.data import default_collate

from multiproc import Batcher, ExecutorSpec, Shuffler, Skipped, StageSpec, TooManyErrorsError
from multiproc.reducers import DROPPED
from multiproc.spec import MAX_ERRORS_ARE, too_many_errors, valid_max_errors

from .errors import PipelineError, StateError
from .sources import as_source, read_indexed

if TYPE_CHECKING:
    from .loader import Loader

log = logging.getLogger(__name__)

MiB = 1 << 20
_MIN_BUFFER = 64 * 1024

StageKind = Literal["source", "map", "shuffle", "batch"]


@dataclass(frozen=True)
class Stage:
    """One stage of a pipeline and its knobs.

    Attributes:
        name: unique stage name (in errors, stats, tuner decisions).
        kind: ``source``, ``map``, ``shuffle`` or ``batch``.
        fn: the map function, or the collate function of a batch stage (None: lists).
        workers: initial worker processes (CPUs); the tuner moves it in
            ``[min_workers, max_workers]``.
        buffer_bytes: initial byte budget of the stage's outbound buffer; the tuner moves it
            up to ``max_buffer_bytes``.
        worker_type: ``process`` or ``thread``.
        on_error: ``raise`` or ``skip`` (drop the failing item, count it, log the first).
        max_errors: the most items ``skip`` may drop before the loader raises: an int is a
            count, a float a share of the items the stage took in (of at least 100), None no
            bound (see :class:`multiproc.StageSpec`).
        size: items per batch (batch stages).
        drop_last: drop an incomplete last batch (batch stages).
        buffer: shuffle buffer size in items (shuffle stages).
        seed: shuffle seed (shuffle stages).
        init: ``init(stage_name, worker_index)`` run in every new worker.
        concurrency: calls in flight per worker (threads of the worker run one frame's calls,
            or a map-style dataset's reads of one batch); for calls that wait on I/O. Moved
            while running in ``[1, max_concurrency]``; ``max_concurrency`` is 1 unless given,
            because only the stage's author knows that its function is safe to call from
            several threads at once.
    """

    name: str
    kind: StageKind
    fn: Callable[..., Any] | None = None
    workers: int = 1
    min_workers: int = 1
    max_workers: int = 64
    buffer_bytes: int = 64 * MiB
    max_buffer_bytes: int | None = None
    worker_type: Literal["process", "thread"] = "process"
    on_error: Literal["raise", "skip"] = "raise"
    size: int = 0
    drop_last: bool = False
    buffer: int = 0
    seed: int = 0
    init: Callable[[str, int], None] | None = None
    max_errors: int | float | None = 0.1
    concurrency: int = 1
    max_concurrency: int = 1

    @property
    def stateful(self) -> bool:
        """Whether the stage holds items across calls (shuffle, batch)."""
        return self.kind in ("shuffle", "batch")


@dataclass(frozen=True)
class Prefetch:
    """The consumer side: a bounded background thread in the main process.

    Attributes:
        depth: items held ready ahead of the consumer.
        pin_memory: pin tensors (when an accelerator is present).
        device: move tensors to this device with ``non_blocking`` copies (None: stay).
        non_blocking: use non-blocking copies for the device transfer.
    """

    depth: int = 2
    pin_memory: bool = False
    device: Any = None
    non_blocking: bool = True


def _positive_int(method: str, arg: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipelineError(f"{method}: {arg} must be a positive int, got {value!r}")


class Pipeline:
    """An immutable chain of stages; build with :meth:`from_source` and the stage methods.

    Raises:
        PipelineError: (a ``ValueError``) on any invalid stage or argument, naming both.
    """

    def __init__(self, source: Any, stages: tuple[Stage, ...], prefetch: Prefetch | None = None):
        self.source = source
        self.stages = stages
        self.prefetch_spec = prefetch

    # ------------------------------------------------------------------------ building
    @classmethod
    def from_source(
        cls,
        source: Any,
        *,
        name: str = "source",
        workers: int = 1,
        min_workers: int = 1,
        max_workers: int = 64,
        buffer_bytes: int = 64 * MiB,
        worker_type: Literal["process", "thread"] = "process",
        on_error: Literal["raise", "skip"] = "raise",
        init: Callable[[str, int], None] | None = None,
        max_errors: int | float | None = 0.1,
        concurrency: int = 1,
        max_concurrency: int | None = None,
    ) -> Pipeline:
        """Start a pipeline at ``source``: a :class:`~torchtune_pipe.sources.Source`, a
        map-style or iterable torch dataset, or a ``torchdata.nodes`` node.

        With ``on_error="skip"`` an item the source fails to produce is skipped: exactly that
        item for sources with ``read_from`` (map-style datasets), the rest of its unit for a
        plain ``read()`` generator (which cannot go on after raising); ``max_errors`` bounds
        the skips. See :class:`ReadTagged`.

        Raises:
            PipelineError: ``source`` is none of these, or a knob is invalid.
        """
        try:
            src = as_source(source)
        except TypeError as e:
            raise PipelineError(f"from_source(): source: {e}") from e
        stage = cls._stage(
            "from_source()", (), name, "source", None, workers, min_workers, max_workers,
            buffer_bytes, worker_type, on_error, init,
        )  # fmt: skip
        stage = _with_concurrency("from_source()", stage, concurrency, max_concurrency)
        return cls(src, (_with_max_errors("from_source()", stage, max_errors),))

    def map(
        self,
        fn: Callable[[Any], Any],
        *,
        name: str | None = None,
        workers: int = 1,
        min_workers: int = 1,
        max_workers: int = 64,
        buffer_bytes: int = 64 * MiB,
        worker_type: Literal["process", "thread"] = "process",
        on_error: Literal["raise", "skip"] = "raise",
        init: Callable[[str, int], None] | None = None,
        max_errors: int | float | None = 0.1,
        concurrency: int = 1,
        max_concurrency: int | None = None,
    ) -> Pipeline:
        """Apply ``fn`` to every item (or batch, after :meth:`batch`) in its own stage.

        Args:
            fn: the function; it must pickle (closures and lambdas do, via cloudpickle) for
                process workers.
            name: stage name; default ``fn.__name__`` (``map``, ``map_1``... if taken).
            workers, min_workers, max_workers: the worker knob and its bounds.
            buffer_bytes: the outbound buffer knob (>= 64 KiB).
            worker_type: ``process`` (default) or ``thread`` (for GIL-free functions).
            on_error: ``raise`` or ``skip``.
            init: ``init(stage_name, worker_index)`` run once in every new worker.
            max_errors: the bound on skipped items (see :class:`Stage`).
            concurrency: calls of ``fn`` in flight per worker, on threads (for functions
                that wait on I/O; see :class:`Stage`).
            max_concurrency: how far the pipeline may raise ``concurrency`` while running
                (default: ``concurrency``, i.e. fixed; give it only for a thread-safe ``fn``).
        """
        method = f"map({name!r})" if name else "map()"
        if not callable(fn):
            raise PipelineError(f"{method}: fn must be callable, got {type(fn).__name__}")
        if name is None:
            name = self._free_name(getattr(fn, "__name__", "map").strip("<>") or "map")
        stage = self._stage(
            method, self.stages, name, "map", fn, workers, min_workers, max_workers,
            buffer_bytes, worker_type, on_error, init,
        )  # fmt: skip
        if worker_type == "process":
            _check_pickles(method, "fn", fn)
        stage = _with_concurrency(method, stage, concurrency, max_concurrency)
        return self._add(_with_max_errors(method, stage, max_errors), method)

    def shuffle(
        self, buffer: int, *, seed: int = 0, name: str = "shuffle", buffer_bytes: int = 64 * MiB
    ) -> Pipeline:
        """Shuffle with a buffer of ``buffer`` items (tf.data-style), seeded by ``seed`` and
        the epoch. In ordered (deterministic) mode the stage runs one worker."""
        method = f"shuffle({name!r})"
        _positive_int(method, "buffer", buffer)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise PipelineError(f"{method}: seed must be an int, got {seed!r}")
        stage = self._stage(
            method, self.stages, name, "shuffle", None, 1, 1, 64, buffer_bytes, "process",
            "raise", None,
        )  # fmt: skip
        return self._add(dataclasses.replace(stage, buffer=buffer, seed=seed), method)

    def batch(
        self,
        size: int,
        *,
        collate: Callable[[list], Any] | None = default_collate,
        drop_last: bool = False,
        name: str = "batch",
        workers: int = 1,
        max_workers: int = 64,
        buffer_bytes: int = 64 * MiB,
    ) -> Pipeline:
        """Group ``size`` consecutive items and apply ``collate``: torch's ``default_collate``
        unless told otherwise (tensors stacked, dicts and tuples collated field by field, as
        ``torch.utils.data.DataLoader`` batches), ``collate=None`` for the plain list.

        In ordered mode the stage runs one worker; unordered, each worker batches the items
        it receives."""
        method = f"batch({name!r})"
        _positive_int(method, "size", size)
        if collate is not None and not callable(collate):
            raise PipelineError(f"{method}: collate must be callable or None, got {collate!r}")
        if not isinstance(drop_last, bool):
            raise PipelineError(f"{method}: drop_last must be a bool, got {drop_last!r}")
        if collate is not None:
            _check_pickles(method, "collate", collate)
        stage = self._stage(
            method, self.stages, name, "batch", collate, workers, 1, max_workers,
            buffer_bytes, "process", "raise", None,
        )  # fmt: skip
        return self._add(dataclasses.replace(stage, size=size, drop_last=drop_last), method)

    def prefetch(
        self,
        depth: int = 2,
        *,
        pin_memory: bool = False,
        device: Any = None,
        non_blocking: bool = True,
    ) -> Pipeline:
        """Keep ``depth`` items ready on a background thread of the main process, pinned
        and/or moved to ``device`` (nested tensors and TensorDicts). Must come last."""
        _positive_int("prefetch()", "depth", depth)
        if self.prefetch_spec is not None:
            raise PipelineError("prefetch(): the pipeline already ends with a prefetch")
        return Pipeline(self.source, self.stages, Prefetch(depth, pin_memory, device, non_blocking))

    # ------------------------------------------------------------------------ using
    def loader(self, tuner: Any = None, **options: Any) -> Loader:
        """A :class:`~torchtune_pipe.loader.Loader` running this pipeline; see its arguments."""
        from .loader import Loader

        return Loader(self, tuner=tuner, **options)

    def spec(self, ordered: bool = False, name: str = "pipe") -> ExecutorSpec:
        """The executor spec of this pipeline (stage functions wrapped to carry item tags).

        In ordered mode shuffle and batch stages are bounded to one worker (the executor
        reorders only around single-worker stateful stages).
        """
        specs = []
        for st in self.stages:
            max_w = 1 if (ordered and st.stateful) else st.max_workers
            common: dict[str, Any] = dict(
                workers=min(st.workers, max_w), min_workers=min(st.min_workers, max_w),
                max_workers=max_w, buffer_bytes=st.buffer_bytes,
                max_buffer_bytes=st.max_buffer_bytes, worker_type=st.worker_type,
                on_error=st.on_error, init=st.init, max_errors=st.max_errors,
                concurrency=st.concurrency, max_concurrency=st.max_concurrency,
            )  # fmt: skip
            if st.kind == "source":
                read = ReadTagged(self.source, skip=st.on_error == "skip")
                specs.append(StageSpec(st.name, "source", read, **common))
            elif st.kind == "map":
                specs.append(StageSpec(st.name, "map", MapTagged(_fn(st)), **common))
            else:
                specs.append(StageSpec(st.name, "stateful", TaggedReducer(_factory(st)), **common))
        return ExecutorSpec(tuple(specs), ordered=ordered, name=name)

    def __repr__(self) -> str:
        chain = " -> ".join(f"{s.kind}({s.name!r})" for s in self.stages)
        tail = f" -> prefetch({self.prefetch_spec.depth})" if self.prefetch_spec else ""
        return f"Pipeline({chain}{tail})"

    # ------------------------------------------------------------------------ helpers
    @staticmethod
    def _stage(method, existing, name, kind, fn, workers, min_workers, max_workers,
               buffer_bytes, worker_type, on_error, init) -> Stage:  # fmt: skip
        if not isinstance(name, str) or not name:
            raise PipelineError(f"{method}: name must be a non-empty str, got {name!r}")
        if any(s.name == name for s in existing):
            raise PipelineError(f"{method}: stage name {name!r} is already used; pass name=")
        for arg, v in (
            ("workers", workers),
            ("min_workers", min_workers),
            ("max_workers", max_workers),
        ):
            _positive_int(method, arg, v)
        if not min_workers <= workers <= max_workers:
            raise PipelineError(
                f"{method}: need min_workers <= workers <= max_workers, got "
                f"{min_workers} <= {workers} <= {max_workers}"
            )
        if (
            not isinstance(buffer_bytes, int)
            or isinstance(buffer_bytes, bool)
            or buffer_bytes < _MIN_BUFFER
        ):
            raise PipelineError(
                f"{method}: buffer_bytes must be an int >= 65536, got {buffer_bytes!r}"
            )
        if worker_type not in ("process", "thread"):
            raise PipelineError(
                f"{method}: worker_type must be 'process' or 'thread', got {worker_type!r}"
            )
        if on_error not in ("raise", "skip"):
            raise PipelineError(f"{method}: on_error must be 'raise' or 'skip', got {on_error!r}")
        if init is not None and not callable(init):
            raise PipelineError(f"{method}: init must be callable or None, got {init!r}")
        return Stage(name, kind, fn, workers, min_workers, max_workers, buffer_bytes, None,
                     worker_type, on_error, init=init)  # fmt: skip

    def _add(self, stage: Stage, method: str) -> Pipeline:
        if self.prefetch_spec is not None:
            raise PipelineError(
                f"{method}: prefetch() must be the last stage; add {stage.kind} before it"
            )
        return Pipeline(self.source, self.stages + (stage,), None)

    def _free_name(self, base: str) -> str:
        names = {s.name for s in self.stages}
        if base not in names:
            return base
        i = 1
        while f"{base}_{i}" in names:
            i += 1
        return f"{base}_{i}"


def _with_concurrency(method: str, stage: Stage, concurrency: Any, max_concurrency: Any) -> Stage:
    _positive_int(method, "concurrency", concurrency)
    if max_concurrency is None:
        max_concurrency = concurrency
    _positive_int(method, "max_concurrency", max_concurrency)
    if concurrency > max_concurrency:
        raise PipelineError(
            f"{method}: concurrency ({concurrency}) must be <= max_concurrency ({max_concurrency})"
        )
    return dataclasses.replace(stage, concurrency=concurrency, max_concurrency=max_concurrency)


def _with_max_errors(method: str, stage: Stage, max_errors: Any) -> Stage:
    if not valid_max_errors(max_errors):
        raise PipelineError(f"{method}: max_errors {MAX_ERRORS_ARE}, got {max_errors!r}")
    return dataclasses.replace(stage, max_errors=max_errors)


def _check_pickles(method: str, arg: str, fn: Any) -> None:
    try:
        cloudpickle.dumps(fn)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise PipelineError(
            f"{method}: {arg} does not pickle for process workers ({e}); make it picklable or "
            "use worker_type='thread'"
        ) from e


def _factory(st: Stage) -> Callable[..., Any]:
    if st.kind == "shuffle":
        return Shuffler(st.buffer, st.seed)
    return Batcher(st.size, CollateTagged(st.fn), st.drop_last)


# ---------------------------------------------------------------------------- tagging
# An item is (unit, k, x); a unit's end is (unit, -1 - count, None); a batch is (-1, ids, x).


@dataclass(frozen=True)
class Work:
    """What the executor's source stage receives: a unit, its position, items to skip."""

    pos: int
    unit: Any
    skip: frozenset = frozenset()


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
                if not hasattr(self.source, "read_from"):
                    yield Skipped(e, f"item {failed} and the rest of the unit (a source without "
                                     "read_from cannot read on past a failure)")  # fmt: skip
                    break
                if repeat == (type(e), str(e)):
                    yield Skipped(e, f"item {failed} and the rest of the unit (it keeps failing)")
                    break
                repeat = (type(e), str(e))
                yield Skipped(e, f"item {failed}")
                skip.update(range(failed + 1))  # delivered before it, and itself
        yield (work.pos, -1 - count, None)


class MapTagged:
    """Map stage function: applies ``fn`` under the tag; ends pass through."""

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn = fn

    def __call__(self, t: tuple) -> tuple:
        u, k, x = t
        if u >= 0 and k < 0:
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
            return [([tag], t)]
        return self.inner.push(tag, t)

    def flush(self) -> list:
        return self.inner.flush()

    def drain(self) -> list:
        return self.inner.drain()


def _fn(st: Stage) -> Callable[[Any], Any]:
    """A map stage's function (set for every map stage by ``Pipeline.map``)."""
    if st.fn is None:
        raise PipelineError(f"map({st.name!r}): the stage has no function")
    return st.fn


def run_inline(pipeline: Pipeline, works: list[Work], epoch: int) -> Iterator[tuple]:
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
        fn = MapTagged(_fn(st))
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
    reducer = TaggedReducer(_factory(st))(epoch, 0)
    for t in stream:
        for _, out in reducer.push(None, t):
            if out is not DROPPED:
                yield out
    for _, out in reducer.flush():
        if out is not DROPPED:
            yield out
