"""Options objects: the knobs several builder methods share, and the Loader's strategies.

:class:`StageOptions` holds the knobs of a worker stage that :meth:`Pipeline.from_source
<torchtune_pipe.pipeline.Pipeline.from_source>` and :meth:`~torchtune_pipe.pipeline.Pipeline.map`
both take; :class:`Strategy` holds the :class:`~torchtune_pipe.loader.core.Loader`'s switches for how
an epoch is run, none of which changes what it delivers. Each can be passed whole
(``options=``, ``strategy=``) or field by field as keyword arguments, which override the object's
fields; a keyword that names no field is an error naming it.

Example:
    >>> io = StageOptions(workers=2, concurrency=8, max_concurrency=32)
    >>> pipe = Pipeline.from_source(ds, options=io).map(fetch, options=io)  # doctest: +SKIP
    >>> pipe.loader(strategy=Strategy(fast_start=True))                      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from torchtune_pipe.stages import DEFAULT_BUFFER_BYTES, DEFAULT_MAX_ERRORS, DEFAULT_MAX_WORKERS

__all__ = ["StageOptions", "Strategy"]

_T = TypeVar("_T", "StageOptions", "Strategy")


@dataclass(frozen=True)
class StageOptions:
    """The knobs of a worker stage (a source or a map), as :class:`~.stages.Stage` holds them.

    Attributes:
        workers: the stage's starting workers; a tuner moves them in
            ``[min_workers, max_workers]``.
        min_workers, max_workers: the tuner's bounds.
        buffer_bytes: the starting outbound buffer (>= 64 KiB).
        worker_type: ``process``, ``thread`` (for functions that release the GIL) or ``auto``:
            processes, moved to threads of the consumer's process while running where they
            deliver as much (:mod:`torchtune_pipe.tuning.worker_kind`); the function must then
            be safe to call from several threads, and shares this process's random generators.
        on_error: ``raise``, or ``skip`` (drop the failing item, count it, log the first).
        init: ``init(stage_name, worker_index)`` run once in every new worker.
        max_errors: the bound on skipped items: an int a count, a float a share of the items
            taken in, None no bound.
        concurrency: calls in flight per worker, on threads, for calls that wait on I/O.
        max_concurrency: how far a tuner may raise ``concurrency`` while running; None:
            ``concurrency`` (fixed). Give it only for a function safe to call from several
            threads at once.
    """

    workers: int = 1
    min_workers: int = 1
    max_workers: int = DEFAULT_MAX_WORKERS
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    worker_type: Literal["process", "thread", "auto"] = "process"
    on_error: Literal["raise", "skip"] = "raise"
    init: Callable[[str, int], None] | None = None
    max_errors: int | float | None = DEFAULT_MAX_ERRORS
    concurrency: int = 1
    max_concurrency: int | None = None


@dataclass(frozen=True)
class Strategy:
    """How a :class:`~torchtune_pipe.loader.core.Loader` runs an epoch; the items are the same
    under every combination (their order too, except with ``interleave``).

    Attributes:
        inline: run every stage in the calling thread (no worker processes).
        fast_start: read the first units of the first epoch in the calling thread while the
            workers start, so the first items come at once (see
            :mod:`torchtune_pipe.loader.faststart`); only for pipelines without shuffle or batch
            stages, prefetch thread or timeout, whose items do not depend on where they are
            read (no ``init`` that a read needs).
        choose_shape: with ``fast_start``, compare the tuned workers with reading in the
            calling thread and keep whichever delivers faster; logged at INFO.
        batch_at_source: run a pipeline that maps a map-style dataset's samples and then
            batches them with the batching moved into its source, one item per batch, as
            torch's DataLoader does (the same batches; see :mod:`torchtune_pipe.loader.pushdown`);
            False runs it as written, a sample per item until the batch stage.
        interleave: deliver round-robin across units (torch's order for iterable datasets
            read by one worker per shard); needs a pipeline without shuffle or batch stages.
    """

    inline: bool = False
    fast_start: bool = False
    choose_shape: bool = False
    batch_at_source: bool = True
    interleave: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise TypeError(f"Strategy: {f.name} must be a bool, got {value!r}")


def with_fields(where: str, cls: type[_T], given: _T | None, fields: Mapping[str, Any]) -> _T:
    """``given`` (default: ``cls()``) with ``fields`` replacing its fields.

    Raises:
        TypeError: ``given`` is not a ``cls``, or a key of ``fields`` names no field of
            ``cls`` (the message names ``where``, the key and the fields there are).
    """
    if given is None:
        given = cls()
    elif not isinstance(given, cls):
        arg = "options" if cls is StageOptions else "strategy"
        raise TypeError(f"{where}: {arg} must be a {cls.__name__}, got {type(given).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise TypeError(
            f"{where}: unexpected keyword argument {unknown[0]!r}; the {cls.__name__} fields "
            f"are {', '.join(names)}"
        )
    return dataclasses.replace(given, **fields) if fields else given
