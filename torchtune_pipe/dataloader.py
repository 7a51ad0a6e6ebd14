"""A drop-in replacement for ``torch.utils.data.DataLoader``, running on tuned stage pools.

``torchtune_pipe.DataLoader`` takes the same arguments and yields the same batches in the
same order as torch's for the same seed. Underneath, a map-style dataset becomes a *fetch*
stage (``__getitem__``/``__getitems__`` on the sampler's batches, drawn in the main process
exactly as torch draws them) and a *collate* stage; with ``num_workers="auto"`` they are two
stages that start fused (collate runs in the fetch workers, torch's own arrangement) and that
a tuner may split and give CPUs each, with an integer they are one stage of that many
workers. An ``IterableDataset`` is read as ``num_workers`` shards (``"auto"``: one per core),
a worker per shard from the first batch (``get_worker_info()`` works as in torch), and
delivered round-robin, as torch does.

It deliberately does not subclass torch's DataLoader (frameworks that re-instantiate
DataLoader subclasses would rebuild it as a plain one).

Example:
    >>> from torchtune_pipe import DataLoader        # was: from torch.utils.data import ...
    >>> loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers="auto")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from multiproc import in_thread_worker, workerinfo
from torchtune_pipe.loader.core import Loader
from torchtune_pipe.options import Strategy
from torchtune_pipe.pipeline import Pipeline
from torchtune_pipe.sources.base import IterableDatasetSource, MapDatasetSource
from torchtune_pipe.sources.collated import Collate, Collated
from torchtune_pipe.sources.rank_share import take_rank_share
from torchtune_pipe.sources.rng import draw_seed, seed_as_torch_worker
from torchtune_pipe.telemetry.measure import cpus_available

log = logging.getLogger(__name__)


def _epoch_items(source: Any) -> int:
    """Items (batches where batched) an epoch of ``source`` gives, or a bound where not known."""
    try:
        return max(1, len(source))
    except TypeError:
        return 1 << 30


class _WorkerInit:
    """``StageSpec.init`` for the fetch stage: sets torch's worker info, then calls the
    user's ``worker_init_fn(worker_index)`` (as torch does, once per worker process).

    ``get_worker_info().seed`` is ``base_seed + index`` as in torch, ``base_seed`` the epoch's
    (the one torch's iterator draws at ``iter()``, read from a copy of the generator then; with
    persistent workers the first ``iter()``'s; reads in the calling thread take the source's). A
    worker process seeds ``random``, ``torch`` and ``numpy`` from it at its start, before
    ``worker_init_fn``, the way torch seeds its workers (``numpy`` through torch's own
    ``_generate_state``): ``torch.initial_seed()`` there is torch's. Per-batch seeds (the
    source's ``seed_units``) reseed them before each batch; without, the worker's streams go
    on from there."""

    def __init__(
        self,
        source: MapDatasetSource,
        num_workers: int,
        worker_init_fn: Callable | None,
    ):
        self.source = source
        self.num_workers = num_workers
        self.worker_init_fn = worker_init_fn
        self.base_seed = 0  # the epoch's, set at iter() before the workers' snapshot

    @contextlib.contextmanager
    def inline(self) -> Iterator[None]:
        """Reads in the calling thread (a fast start's, or a thread standing in for a thread
        worker to measure its reads) see the worker info of worker 0, as a worker would, in
        that thread only, and stack batches in ordinary memory as a worker does; the thread's
        own worker info comes back after."""
        from multiproc.serialize import private_collate

        with workerinfo.info_set(self._info(0, self.source.base_seed)), private_collate():
            yield

    def _info(self, index: int, base_seed: int) -> Any:
        from torch.utils.data._utils import worker as torch_worker

        return torch_worker.WorkerInfo(
            id=index,
            num_workers=self.num_workers,
            seed=base_seed + index,
            dataset=self.source.views.get(),  # what this worker reads (sources.views)
        )

    def __call__(self, stage_name: str, index: int) -> None:
        from torch.utils.data._utils import worker as torch_worker

        if in_thread_worker():
            # A thread of the consumer's process: its own worker info, and the process's
            # random generators left as they are (torch's thread workers share them too).
            workerinfo.set_info(self._info(index, self.source.base_seed))
            if self.worker_init_fn is not None:
                self.worker_init_fn(index)
            return
        torch_worker._worker_info = self._info(index, self.base_seed)
        seed_as_torch_worker(self.base_seed, index)
        if self.worker_init_fn is not None:
            self.worker_init_fn(index)


def _warn_pin_memory(device: str) -> None:
    """torch's warnings for ``pin_memory=True`` at ``iter()`` (its words), pointing at the
    caller's ``iter()`` (or ``for``)."""
    from torchtune_pipe.loader.prefetch import accelerator_available

    if device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the "
            f"device,ignore pin_memory_device='{device}'.",
            stacklevel=3,
        )
    if not accelerator_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, then device "
            "pinned memory won't be used.",
            stacklevel=3,
        )


def _start_method(context: Any) -> str:
    """The executor's start method for torch's ``multiprocessing_context`` (None, a start
    method's name, or a multiprocessing context): ``"fork"`` or a pickling one."""
    if context is None:
        return "fork"
    name = context if isinstance(context, str) else getattr(context, "get_start_method", None)
    if callable(name):
        name = name()
    if name == "fork":
        return "fork"
    if name in ("spawn", "forkserver"):
        return "spawn"
    raise ValueError(
        "multiprocessing_context option should specify a valid start method in "
        f"['fork', 'spawn', 'forkserver'], but got multiprocessing_context={context!r}"
    )


def _tuner(tuner: Any, auto: bool, weights: Any, options: Mapping[str, Any] | None) -> Any:
    """The tuner the DataLoader's :class:`Loader` runs (a name, a Tuner or None)."""
    if weights is not None:
        if tuner not in (None, "intune"):
            raise ValueError(f"DataLoader: weights= is for tuner='intune', got tuner={tuner!r}")
        tuner = "intune"
        options = {**(options or {}), "weights": weights}
    if tuner is None and auto:
        tuner = "intune"
    if options:
        if not isinstance(tuner, str):
            raise ValueError(f"DataLoader: tuner_options= needs the tuner by name, got {tuner!r}")
        from torchtune_pipe.tuning.registry import make_tuner

        return make_tuner(tuner, **options)
    return tuner


class DataLoader:
    """``torch.utils.data.DataLoader``'s interface on a tuned, resumable pipeline.

    Args: those of ``torch.utils.data.DataLoader`` (same defaults, same validation), plus:
        num_workers: an int (as torch), or ``"auto"``: fetch and collate stages, starting
            fused, whose workers and fusion ``tuner`` moves (default tuner ``"intune"``). An
            ``IterableDataset`` is read as that many shards (``"auto"``: one per core), each
            by a worker of its own from the first batch; the fetch stage keeps a worker per
            shard, no fewer and no more, whatever the tuner.
        tuner: a name from :data:`~torchtune_pipe.tuning.TUNERS` or a
            :class:`~torchtune_pipe.tuning.Tuner`, with any ``num_workers`` > 0 (None: fixed
            workers, or ``"intune"`` with ``"auto"``). An integer ``num_workers`` is one
            stage; ``"intune"`` has no agent for one stage, so the planner tunes it.
        weights: InTune's weights (a file, a directory of ``intune_{n}stages.pt``, or a state
            dict); implies ``tuner="intune"``.
        tuner_options: keyword options for the named tuner's constructor
            (:func:`~torchtune_pipe.tuning.make_tuner`).
        tuning_interval_s: seconds between tuning steps.
        tuning_log: file to append the tuner's decisions to (JSON lines); watch it live with
            ``torchtune-pipe watch LOG``, plot it with ``torchtune-pipe report LOG``.
        progress: show a live per-stage table (plain text without ``rich``).
        seed_each_batch: with workers, seed ``random``, ``torch`` and ``numpy`` before each
            batch's ``__getitem__`` calls as torch seeds its worker ``j`` at its start, ``j``
            the batch's position in the epoch, so random draws in the dataset give the same
            batches whatever the worker count, the tuner's moves or a resume (default; with
            ``w`` workers the epoch's first ``w`` batches draw what torch's draw), and set the
            generators the dataset holds from their state at ``iter()`` and the batch
            (``torchtune_pipe.sources.rng``). ``False``: seed each worker process once, at its
            start, with ``base_seed + worker_id`` as torch does (draws then depend on which
            worker fetches which batch, as under torch).
        max_concurrency: with ``"auto"``, the most ``__getitem__`` calls one fetch worker may
            run at once on its threads when reads wait (raised while running from 1); 1 for a
            dataset that must not be called from several threads at once. A dataset whose
            ``__getitem__`` draws from the global random generators is always read one call
            at a time per worker.
        worker_method: what the ``num_workers`` workers are: ``"process"`` (the default with
            an int ``num_workers``), ``"thread"`` (threads of this process, each reading
            its own copy of the dataset, :mod:`~torchtune_pipe.sources.views`;
            ``get_worker_info()`` gives each its own info; ``random``, ``numpy`` and
            ``torch`` are this process's generators, never seeded by a worker, so
            ``seed_each_batch`` does not apply), or ``"auto"`` (the default with
            ``num_workers="auto"``): processes, moved to threads while running where that
            delivers as many batches (:mod:`torchtune_pipe.tuning.worker_kind`), and only while
            the dataset's reads need no seed of this process's generators (``seed_each_batch``
            off, or a first batch showed ``__getitem__`` draws nothing from them).
        distributed: under ``torch.distributed`` with several ranks, read this rank's share
            of a map-style dataset, as Lightning and Accelerate make torch's ``DataLoader`` do
            (they rebuild torch's class only): ``None`` (default) does so with a warning once
            the process group is initialised, ``True`` without, ``False`` never (every rank
            reads everything, as torch's ``DataLoader`` alone does). See
            :mod:`torchtune_pipe.sources.rank_share`.

    Workers see this process as torch's do: as it was at the epoch's ``iter()`` (or at the
    first ``iter()`` with ``persistent_workers=True``), with what does not pickle inherited,
    because they fork from a snapshot of it taken there (:mod:`multiproc.snapshot`).
    ``multiprocessing_context="spawn"`` (or ``"forkserver"``) sends the dataset by pickle
    instead. Differences from torch: a worker that dies is replaced and its work done again,
    up to 16 times before the error reaches you.
    ``state_dict()`` / ``load_state_dict()`` resume mid-epoch with exactly the batches not
    yet delivered, whatever the worker counts.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | str = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        tuner: Any = None,
        weights: Any = None,
        tuner_options: Mapping[str, Any] | None = None,
        tuning_interval_s: float = 1.0,
        tuning_log: str | None = None,
        progress: bool = False,
        seed_each_batch: bool = True,
        max_concurrency: int = 64,
        worker_method: str | None = None,
        distributed: bool | None = None,
    ):
        arguments = {k: v for k, v in locals().items() if k != "self"}  # see __getstate__
        from torch.utils.data import IterableDataset
        from torch.utils.data._utils.collate import default_collate, default_convert

        auto = isinstance(num_workers, str) and num_workers == "auto"
        if worker_method is None:
            worker_method = "auto" if auto else "process"
        if worker_method not in ("process", "thread", "auto"):
            raise ValueError(
                "DataLoader: worker_method must be 'process', 'thread' or 'auto', got "
                f"{worker_method!r}"
            )
        self.worker_method = worker_method
        if not auto:
            import operator

            if isinstance(num_workers, str) or not hasattr(num_workers, "__index__"):
                raise ValueError(
                    f"num_workers option should be an int >= 0 or 'auto', got {num_workers!r}"
                )
            num_workers = operator.index(num_workers)  # any integral, numpy's too, as torch
            if num_workers < 0:
                raise ValueError(
                    f"num_workers option should be non-negative (or 'auto'), got {num_workers}; "
                    "use num_workers=0 to disable multiprocessing."
                )
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing."
                "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
            )
        if prefetch_factor is not None and prefetch_factor < 0:
            raise ValueError("prefetch_factor option should be non-negative")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        iterable = isinstance(dataset, IterableDataset)
        if iterable:
            if shuffle not in (False, None):
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
                )
            if sampler is not None:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
                )
            if batch_sampler is not None:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified batch_sampler option, but got batch_sampler={batch_sampler}"
                )
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
                )
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError(
                "batch_size=None option disables auto-batching and is mutually exclusive with drop_last=True"
            )
        auto_collation = batch_sampler is not None or batch_size is not None
        if collate_fn is None:
            collate_fn = default_collate if auto_collation else default_convert

        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.prefetch_factor = prefetch_factor
        if prefetch_factor is None and num_workers != 0:
            self.prefetch_factor = 2  # as torch's
        self.persistent_workers = persistent_workers
        self._iterated = False
        self.in_order = in_order
        if distributed not in (None, True, False):
            raise ValueError(
                f"DataLoader: distributed must be None, True or False, got {distributed!r}"
            )
        self.distributed = distributed
        self._shuffle, self._own_batches = bool(shuffle), batch_sampler is not None
        self._ranks_read = False  # whether the rank share was decided (take_rank_share)

        workers = 2 if isinstance(num_workers, str) else num_workers
        if auto and iterable:
            # A shard per core, torch's common guess: the shard count decides the batches, so
            # it is fixed when the loader is built, and the tuner moves the rest.
            workers = max(1, round(cpus_available()))
        if iterable:
            self.source: Any = IterableDatasetSource(
                dataset,
                shards=max(1, workers),
                batch_size=batch_size,
                drop_last=drop_last,
                worker_init_fn=worker_init_fn if workers > 0 else None,
                generator=generator,
                draw_seed=True,
                seed_readers=workers > 0,
                seed_once=bool(persistent_workers),
            )
            self.sampler = self.batch_sampler = None
        else:
            self.source = MapDatasetSource(
                dataset,
                batch_size=batch_size,
                shuffle=bool(shuffle),
                sampler=sampler,
                batch_sampler=batch_sampler,
                drop_last=drop_last,
                generator=generator,
                seed_units=workers > 0 and seed_each_batch,
                entries_per_unit=1,  # a batch (or, unbatched, a sample) per unit: torch's seeds
                sampler_epoch=False,  # the user's, as torch leaves it (set_epoch below)
                seed_once=bool(persistent_workers),
            )
            # What torch's iterator pulls from the sampler ahead of the batches it delivers:
            # where an epoch stops early, the generator is left where torch's leaves it.
            self.source.pulled_ahead = (prefetch_factor or 2) * workers if workers > 0 else 0
            self.sampler = self.source.sampler
            self.batch_sampler = (
                self.source.batch_sampler if batch_sampler is None else batch_sampler
            )
        init = None
        if not iterable and workers > 0:
            init = _WorkerInit(
                self.source,
                workers,
                worker_init_fn,
            )
        bounded = max(1, workers)
        # Delivered round-robin across shards, as torch does, an IterableDataset needs every
        # shard read side by side: a worker per shard from the start, never fewer (the source
        # bounds the stage at its shards, so never more either).
        readers = bounded if iterable else 1
        if auto:
            # Reads that wait get calls in flight per worker: __getitem__ may then run on
            # several threads of a worker, as torchdata.nodes' thread workers run it. A shard
            # is one generator, read by one thread: threads cannot help it. The fetch group
            # starts where the tuner starts it (InTune's fused start): a worker per CPU, or
            # per batch of a shorter epoch.
            start = max(readers, min(round(cpus_available()), _epoch_items(self.source)))
            pipe = Pipeline.from_source(
                self.source, name="fetch", workers=start, min_workers=readers, init=init,
                max_concurrency=1 if iterable else max_concurrency, worker_type=worker_method,
            )  # fmt: skip
            # Collate starts in the fetch workers (torch's arrangement: no hop per batch);
            # the tuner splits it into its own stage when that measures better.
            pipe = pipe.map(
                Collate(collate_fn), name="collate", workers=1, fused=True,
                worker_type="thread" if worker_method == "thread" else "process",
            )  # fmt: skip
        else:
            pipe = Pipeline.from_source(
                Collated(self.source, collate_fn),
                name="fetch",
                workers=bounded,
                min_workers=readers,
                max_workers=max(64, bounded),
                init=init,
                worker_type=worker_method,
            )
        if worker_method == "thread":  # one source; each thread reads its view (sources.views)
            pipe = Pipeline(
                pipe.source,
                tuple(dataclasses.replace(s, thread_copies=False) for s in pipe.stages),
                pipe.prefetch_spec,
            )
        depth = (prefetch_factor or 2) * max(1, workers)
        if pin_memory or timeout:
            pipe = pipe.prefetch(depth, pin_memory=pin_memory)
        self.pipeline = pipe
        self._loader = Loader(
            pipe,
            tuner=_tuner(tuner, auto, weights, tuner_options),
            tuning_interval_s=tuning_interval_s,
            tuning_log=tuning_log,
            ordered=in_order and not iterable,
            timeout_s=float(timeout),
            progress=progress,
            strategy=Strategy(
                inline=workers == 0,
                interleave=bool(iterable and workers > 1),
                # The first batches are fetched in this process while the workers start, where
                # that gives the batches workers would: map-style, per-batch seeds, no init.
                fast_start=bool(
                    not iterable and workers > 0 and worker_init_fn is None and seed_each_batch
                ),
                # "auto" may read in this process when that is faster; not with persistent
                # workers, whose view of the process is the first epoch's.
                choose_shape=bool(auto and not persistent_workers),
            ),
            persistent_workers=persistent_workers,
            start_method=_start_method(multiprocessing_context),
        )
        self._arguments, self._built = arguments, frozenset(self.__dict__) | {"_built"}

    def __getstate__(self) -> dict:
        """What a pickle or a deep copy of the loader holds, as of torch's: the arguments it
        was built with (its dataset, sampler and generator as they are now) and what was set
        on it since (a subclass's attributes); not its workers, tuner or epoch. The copy
        starts its own at its first ``iter()``."""
        extra = {k: v for k, v in self.__dict__.items() if k not in self._built}
        return {"arguments": self._arguments, "extra": extra}

    def __setstate__(self, state: dict) -> None:
        DataLoader.__init__(self, **state["arguments"])
        self.__dict__.update(state["extra"])

    def __iter__(self) -> Iterator[Any]:
        """An epoch's iterator. As torch's does at every ``iter()``, warns where
        ``pin_memory`` is set but no accelerator is present (nothing is pinned) and where
        ``pin_memory_device`` is given (torch ignores it for the current accelerator)."""
        take_rank_share(self)
        if self.pin_memory:
            _warn_pin_memory(self.pin_memory_device)
        init = self.pipeline.stages[0].init
        if isinstance(init, _WorkerInit) and not (self.persistent_workers and self._iterated):
            init.base_seed = draw_seed(self.source.generator, peek=True)
        self._iterated = True
        return iter(self._loader)

    def __len__(self) -> int:
        take_rank_share(self)
        if self.sampler is not None or self.batch_sampler is not None:
            return len(self.source)
        n = len(self.dataset)  # raises TypeError like torch for datasets without __len__
        if self.batch_size is not None:
            n = n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        return n

    @property
    def loader(self) -> Loader:
        """The underlying :class:`~torchtune_pipe.loader.core.Loader` (tuning, telemetry)."""
        return self._loader

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration, and pass it to the sampler's ``set_epoch``
        where it has one. Only this sets the sampler's epoch: one the sampler's owner set
        (``DistributedSampler.set_epoch``, as with torch's ``DataLoader``) stands."""
        self._loader.set_epoch(epoch)
        for s in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            set_it = getattr(s, "set_epoch", None)
            if callable(set_it):
                set_it(epoch)
                break

    def state_dict(self) -> dict:
        """Resumable state: the delivered batches of this epoch (see ``Loader.state_dict``)."""
        take_rank_share(self)  # a state names the sampler: this rank's, under DDP
        return self._loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume at the next ``iter()`` with exactly the batches not yet delivered."""
        take_rank_share(self)  # checked against the sampler the next iter() reads
        self._loader.load_state_dict(state)

    def close(self) -> None:
        """Stop the workers and free their shared memory."""
        self._loader.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
