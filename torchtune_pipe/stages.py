"""The stages of a pipeline: what each one does and its knobs, as frozen dataclasses.

:class:`Stage` describes one stage of a :class:`~torchtune_pipe.pipeline.Pipeline` (built by
its ``from_source``/``map``/``shuffle``/``batch`` methods, which validate the knobs);
:class:`Prefetch` the consumer side; :class:`PipelineLike` is what a
:class:`~torchtune_pipe.loader.core.Loader` needs of a pipeline to run it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from multiproc import ExecutorSpec
from multiproc.spec import EXECUTOR_KIND, PipelineKind

MiB = 1 << 20

# Defaults of every stage's knobs (Stage, and Pipeline.from_source/map/shuffle/batch).
DEFAULT_MAX_WORKERS = 64  # the tuner's ceiling per stage, as multiproc.StageSpec's
DEFAULT_BUFFER_BYTES = 64 * MiB  # outbound buffer of a stage until a tuner moves it
DEFAULT_MAX_ERRORS = 0.1  # on_error="skip" drops at most 10% of the items a stage takes in
MIN_BUFFER_BYTES = 64 * 1024  # the smallest buffer multiproc.StageSpec accepts
DEFAULT_PREFETCH_DEPTH = 2  # items held ready on the consumer side, as torch's prefetch_factor


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
        worker_type: ``process``, ``thread`` or ``auto`` (processes that the pipeline moves to
            threads where that measures no slower; see :mod:`torchtune_pipe.tuning.worker_kind`).
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
        fused: (map stages) start with ``fn`` running in the previous stage's workers, on
            their outputs, with no hop between them; the tuner may split or fuse it while
            running (see :mod:`multiproc.fusion`).
        placement: (map stages) ``local``; ``ray``: ``fn`` runs on Ray actors, one per
            worker (:mod:`torchtune_pipe.remote.stage`); or ``auto``: local workers, some of which
            the tuner may move onto a connected Ray cluster (:mod:`torchtune_pipe.remote.mixed`).
        ray_options: the actors' ``ActorClass.options(...)`` (``placement="ray"`` or
            ``"auto"``).
        thread_copies: (``worker_type="thread"``) each thread worker gets its own copy of
            ``fn`` (True), or all share this process's own (False: the DataLoader's thread
            workers share its source, each reading a view of the dataset of its own,
            :mod:`torchtune_pipe.sources.views`).
    """

    name: str
    kind: PipelineKind
    fn: Callable[..., Any] | None = None
    workers: int = 1
    min_workers: int = 1
    max_workers: int = DEFAULT_MAX_WORKERS
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    max_buffer_bytes: int | None = None
    worker_type: Literal["process", "thread", "auto"] = "process"
    on_error: Literal["raise", "skip"] = "raise"
    size: int = 0
    drop_last: bool = False
    buffer: int = 0
    seed: int = 0
    init: Callable[[str, int], None] | None = None
    max_errors: int | float | None = DEFAULT_MAX_ERRORS
    concurrency: int = 1
    max_concurrency: int = 1
    fused: bool = False
    placement: Literal["local", "ray", "auto"] = "local"
    ray_options: Mapping[str, Any] | None = None
    thread_copies: bool = True

    @property
    def stateful(self) -> bool:
        """Whether the stage holds items across calls (shuffle, batch)."""
        return EXECUTOR_KIND.get(self.kind) == "stateful"


@dataclass(frozen=True)
class Prefetch:
    """The consumer side: a bounded background thread in the main process.

    Attributes:
        depth: items held ready ahead of the consumer.
        pin_memory: pin tensors (when an accelerator is present).
        device: move tensors to this device with ``non_blocking`` copies (None: stay).
        non_blocking: use non-blocking copies for the device transfer.
    """

    depth: int = DEFAULT_PREFETCH_DEPTH
    pin_memory: bool = False
    device: Any = None
    non_blocking: bool = True


@runtime_checkable
class PipelineLike(Protocol):
    """What a :class:`~torchtune_pipe.loader.core.Loader` runs: a source, its stages in order, the
    consumer side, and the executor spec they make. :class:`~torchtune_pipe.pipeline.Pipeline`
    is the implementation; the loader depends on this seam, not on the builder, so the
    builder's ``loader()`` can make loaders without an import cycle."""

    source: Any
    stages: tuple[Stage, ...]
    prefetch_spec: Prefetch | None

    def spec(self, ordered: bool = False, name: str = "pipe") -> ExecutorSpec: ...


def items_out(stages: Sequence[Stage], n: int) -> int:
    """Items delivered for ``n`` source items (batch stages regroup them)."""
    for st in stages:
        if st.kind == "batch":
            n = n // st.size if st.drop_last else math.ceil(n / st.size)
    return n
