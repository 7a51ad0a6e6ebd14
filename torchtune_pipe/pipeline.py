"""The Pipeline builder: declarative, validated stages that become an executor spec.

A :class:`Pipeline` is immutable; every builder method returns a new one, so a base pipeline
can be extended several ways. Stages run in the order they are added, and any number of map
stages can sit anywhere, so both the paper's ``load -> batch -> shuffle -> UDF -> prefetch``
and the common ``load -> shuffle -> UDF -> batch`` are plain chains.

Items travel tagged: the source wraps every item as ``(unit, k, item)`` and every unit ends
with a marker ``(unit, -1 - count, None)``; maps keep the tag, batches carry the tags of their
items as ``(-1, ids, batch)``. The :class:`~torchtune_pipe.loader.core.Loader` strips the tags at
the consumer and uses them to know exactly which items were delivered, which is what makes
resuming independent of worker counts (:mod:`torchtune_pipe.loader.tagging`).

The stages themselves are :mod:`torchtune_pipe.stages`; running every stage in the calling
thread is :mod:`torchtune_pipe.loader.inline`.

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
from collections.abc import Callable, Mapping
from typing import Any, Literal

from torch.utils.data import default_collate

from multiproc import ExecutorSpec, StageSpec, buffers
from multiproc.spec import EXECUTOR_KIND, MAX_ERRORS_ARE, PipelineKind, valid_max_errors
from torchtune_pipe.errors import PipelineError
from torchtune_pipe.loader.core import Loader
from torchtune_pipe.loader.tagging import (
    MapTagged,
    ReadTagged,
    TaggedReducer,
    map_fn,
    reducer_factory,
)
from torchtune_pipe.options import StageOptions, with_fields
from torchtune_pipe.remote.mixed import auto_offload
from torchtune_pipe.remote.stage import (
    INSTALL_HINT,
    PLACEMENTS,
    RayMap,
    check_ray_options,
    ray_installed,
)
from torchtune_pipe.sources.base import as_source
from torchtune_pipe.stages import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_MAX_WORKERS,
    DEFAULT_PREFETCH_DEPTH,
    MIN_BUFFER_BYTES,
    MiB,
    Prefetch,
    Stage,
)

log = logging.getLogger(__name__)


__all__ = ["MiB", "Pipeline", "Prefetch", "Stage"]


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
        options: StageOptions | None = None,
        **knobs: Any,
    ) -> Pipeline:
        """Start a pipeline at ``source``: a :class:`~torchtune_pipe.sources.base.Source`, a
        map-style or iterable torch dataset, or a ``torchdata.nodes`` node.

        With ``on_error="skip"`` an item the source fails to produce is skipped: exactly that
        item for sources with ``read_from`` (map-style datasets), the rest of its unit for a
        plain ``read()`` generator (which cannot go on after raising); ``max_errors`` bounds
        the skips. See :class:`~torchtune_pipe.loader.tagging.ReadTagged`.

        Args:
            source: the source.
            name: the stage's name.
            options: the stage's knobs (:class:`~torchtune_pipe.options.StageOptions`:
                ``workers``, ``max_workers``, ``worker_type``, ``on_error``, ``init``,
                ``concurrency``...); its fields may also be given as keyword arguments, which
                override ``options``'.

        Raises:
            PipelineError: ``source`` is none of these, or a knob is invalid.
            TypeError: a keyword argument names no stage option.
        """
        o = with_fields("from_source()", StageOptions, options, knobs)
        try:
            src = as_source(source)
        except TypeError as e:
            raise PipelineError(f"from_source(): source: {e}") from e
        stage = cls._stage("from_source()", (), name, "source", None, o)
        stage = _with_concurrency("from_source()", stage, o.concurrency, o.max_concurrency)
        return cls(src, (_with_max_errors("from_source()", stage, o.max_errors),))

    def map(
        self,
        fn: Callable[[Any], Any],
        *,
        name: str | None = None,
        options: StageOptions | None = None,
        fused: bool = False,
        placement: Literal["local", "ray", "auto"] = "local",
        ray_options: Mapping[str, Any] | None = None,
        **knobs: Any,
    ) -> Pipeline:
        """Apply ``fn`` to every item (or batch, after :meth:`batch`) in its own stage.

        Args:
            fn: the function; it must pickle (closures and lambdas do, via cloudpickle) for
                process workers.
            name: stage name; default ``fn.__name__`` (``map``, ``map_1``... if taken).
            options: the stage's knobs (:class:`~torchtune_pipe.options.StageOptions`:
                ``workers`` and its bounds, ``buffer_bytes``, ``worker_type``, ``on_error``,
                ``init`` (run on the actor with ``placement="ray"``), ``max_errors``,
                ``concurrency`` and ``max_concurrency``); its fields may also be given as
                keyword arguments, which override ``options``'.
            fused: start with ``fn`` running in the previous stage's workers (a source or
                map stage of the same worker type), with no hop between them; the tuner may
                split it while running.
            placement: ``local`` (default), or ``ray``: ``fn`` runs on a pool of Ray
                actors, one per worker (the workers are then threads of this process that
                forward each frame's items in one remote call; ``workers`` and resizing
                count actors). Order, exactly-once delivery, resume and errors are as for
                local stages; an actor that dies costs its frame one re-run on a new actor.
                Needs ``pip install torchtune-pipe[ray]``; see :mod:`torchtune_pipe.remote.stage`.
                Or ``auto``: the stage starts local (``workers`` of ``worker_type``) and the
                tuner may move some of its workers onto the Ray cluster this process is
                connected to and back (``Allocation.remote``), each remote one a thread
                forwarding frames to an actor of its own; without Ray, or not connected when
                the loader starts, it runs local only, with no error. See
                :mod:`torchtune_pipe.remote.mixed`.
            ray_options: the actors' ``ActorClass.options(...)`` (default ``{"num_cpus":
                1}``), e.g. ``{"num_cpus": 2, "resources": {"feature_node": 1}}``.

        Example:
            >>> pipe.map(featurize, workers=4, placement="ray")              # doctest: +SKIP
            >>> pipe.map(featurize, workers=2, placement="auto")             # doctest: +SKIP
        """
        method = f"map({name!r})" if name else "map()"
        o = with_fields(method, StageOptions, options, knobs)
        if not callable(fn):
            raise PipelineError(f"{method}: fn must be callable, got {type(fn).__name__}")
        if name is None:
            name = self._free_name(getattr(fn, "__name__", "map").strip("<>") or "map")
        stage = self._stage(method, self.stages, name, "map", fn, o)
        if o.worker_type != "thread" or placement != "local":
            _check_pickles(method, "fn", fn)
        stage = _with_concurrency(method, stage, o.concurrency, o.max_concurrency)
        stage = _with_fused(method, self.stages, stage, fused)
        stage = _with_placement(method, stage, placement, ray_options)
        return self._add(_with_max_errors(method, stage, o.max_errors), method)

    def shuffle(
        self,
        buffer: int,
        *,
        seed: int = 0,
        name: str = "shuffle",
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> Pipeline:
        """Shuffle with a buffer of ``buffer`` items (tf.data-style), seeded by ``seed`` and
        the epoch. In ordered (deterministic) mode the stage runs one worker."""
        method = f"shuffle({name!r})"
        _positive_int(method, "buffer", buffer)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise PipelineError(f"{method}: seed must be an int, got {seed!r}")
        stage = self._stage(
            method, self.stages, name, "shuffle", None, StageOptions(buffer_bytes=buffer_bytes)
        )
        return self._add(dataclasses.replace(stage, buffer=buffer, seed=seed), method)

    def batch(
        self,
        size: int,
        *,
        collate: Callable[[list], Any] | None = default_collate,
        drop_last: bool = False,
        name: str = "batch",
        workers: int = 1,
        max_workers: int = DEFAULT_MAX_WORKERS,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
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
        o = StageOptions(workers=workers, max_workers=max_workers, buffer_bytes=buffer_bytes)
        stage = self._stage(method, self.stages, name, "batch", collate, o)
        return self._add(dataclasses.replace(stage, size=size, drop_last=drop_last), method)

    def prefetch(
        self,
        depth: int = DEFAULT_PREFETCH_DEPTH,
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
        """A :class:`~torchtune_pipe.loader.core.Loader` running this pipeline; see its arguments."""
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
                fused=st.fused, placement=st.placement, thread_copies=st.thread_copies,
            )  # fmt: skip
            fn: Callable[..., Any]
            kind = EXECUTOR_KIND[st.kind]
            if st.kind == "source":
                fn = ReadTagged(self.source, skip=st.on_error == "skip")
            elif st.placement == "ray":
                # One remote call per frame: a thread worker per actor (remote.py).
                remote = RayMap(map_fn(st), st.name, st.ray_options or {}, init=st.init)
                fn, kind, common["init"] = remote, "batch_map", remote.start
            elif st.placement == "auto":
                # Local workers, and offload workers on Ray once some move (remote_mixed.py).
                fn, common["placement"] = MapTagged(map_fn(st)), "local"
                common["offload"] = auto_offload(st, map_fn(st))
            elif st.kind == "map":
                fn = MapTagged(map_fn(st))
            else:
                fn = TaggedReducer(reducer_factory(st))
            specs.append(StageSpec(st.name, kind, fn, **common))
        return ExecutorSpec(tuple(specs), ordered=ordered, name=name)

    def __repr__(self) -> str:
        chain = " -> ".join(f"{s.kind}({s.name!r})" for s in self.stages)
        tail = f" -> prefetch({self.prefetch_spec.depth})" if self.prefetch_spec else ""
        return f"Pipeline({chain}{tail})"

    # ------------------------------------------------------------------------ helpers
    @staticmethod
    def _stage(
        method: str,
        existing: tuple[Stage, ...],
        name: Any,
        kind: PipelineKind,
        fn: Callable[..., Any] | None,
        o: StageOptions,
    ) -> Stage:
        workers, min_workers, max_workers = o.workers, o.min_workers, o.max_workers
        buffer_bytes, worker_type, on_error, init = (
            o.buffer_bytes,
            o.worker_type,
            o.on_error,
            o.init,
        )
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
            or buffer_bytes < MIN_BUFFER_BYTES
        ):
            raise PipelineError(
                f"{method}: buffer_bytes must be an int >= {MIN_BUFFER_BYTES}, got {buffer_bytes!r}"
            )
        if worker_type not in ("process", "thread", "auto"):
            raise PipelineError(
                f"{method}: worker_type must be 'process', 'thread' or 'auto', got {worker_type!r}"
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


def _with_fused(method: str, before: tuple[Stage, ...], stage: Stage, fused: Any) -> Stage:
    if not isinstance(fused, bool):
        raise PipelineError(f"{method}: fused must be a bool, got {fused!r}")
    if fused:
        prev = before[-1]
        if prev.kind not in ("source", "map") or _threads(prev) != _threads(stage):
            raise PipelineError(
                f"{method}: fused=True runs fn in the workers of stage {prev.name!r}, which "
                f"must be a source or map stage with worker_type={stage.worker_type!r} (it is "
                f"a {prev.kind} stage with worker_type={prev.worker_type!r})"
            )
    return dataclasses.replace(stage, fused=fused)


def _threads(stage: Stage) -> bool:
    """Whether the stage starts on threads (``auto`` starts on processes)."""
    return stage.worker_type == "thread"


def _with_placement(method: str, stage: Stage, placement: Any, ray_options: Any) -> Stage:
    if placement not in PLACEMENTS:
        raise PipelineError(f"{method}: placement must be one of {PLACEMENTS}, got {placement!r}")
    if placement == "local":
        if ray_options is not None:
            raise PipelineError(f"{method}: ray_options needs placement='ray' or 'auto'")
        return stage
    if placement == "ray" and not ray_installed():
        raise PipelineError(f"{method}: placement='ray' needs Ray: {INSTALL_HINT}")
    options = check_ray_options(method, ray_options)
    # The stage calls its actor once per frame and reports the frame's failure as a whole.
    for arg, value, need in (
        ("on_error", stage.on_error, "raise"),
        ("concurrency", stage.concurrency, 1),
        ("max_concurrency", stage.max_concurrency, 1),
        ("fused", stage.fused, False),
    ):
        if value != need:
            raise PipelineError(
                f"{method}: placement={placement!r} needs {arg}={need!r}, got {value!r} (a "
                "remote worker sends each frame to its actor in one call)"
            )
    if placement == "auto":  # its local workers keep their worker_type
        return dataclasses.replace(stage, placement="auto", ray_options=options)
    return dataclasses.replace(stage, placement="ray", ray_options=options, worker_type="thread")


def _with_max_errors(method: str, stage: Stage, max_errors: Any) -> Stage:
    if not valid_max_errors(max_errors):
        raise PipelineError(f"{method}: max_errors {MAX_ERRORS_ARE}, got {max_errors!r}")
    return dataclasses.replace(stage, max_errors=max_errors)


def _check_pickles(method: str, arg: str, fn: Any) -> None:
    try:
        buffers.dumps_light(fn)  # without copying the large arrays fn holds
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise PipelineError(
            f"{method}: {arg} does not pickle for process workers ({e}); make it picklable or "
            "use worker_type='thread'"
        ) from e
