"""Iterable datasets as sources: ``IterableDataset`` and ``IterDataPipe``, one unit per shard,
read with torch's worker info set."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from multiproc import in_thread_worker, workerinfo
from torchtune_pipe.errors import StateError
from torchtune_pipe.sources.rng import draw_seed, seed_as_torch_worker

__all__ = ["IterableDatasetSource", "ShardUnit"]

# Added to a persistent loader's base seed per later epoch (an odd 64-bit constant, the golden
# ratio's): shards' seeds of different epochs do not meet.
_EPOCH_STRIDE = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class ShardUnit:
    """A work unit of an iterable dataset: "shard ``id`` of ``num_shards``".

    Attributes:
        id: the shard index (``get_worker_info().id`` while it is read).
        num_shards: the shard count (``get_worker_info().num_workers``).
        seed: ``get_worker_info().seed``.
        reseed: the base seed to seed ``random``, ``torch`` and ``numpy`` with before reading
            the shard, as torch seeds its worker ``id`` when it starts (``reseed + id``); None:
            left as they are.
    """

    id: int
    num_shards: int
    seed: int = 0
    reseed: int | None = None


class IterableDatasetSource:
    """An ``IterableDataset`` (or ``IterDataPipe``) as a source of ``shards`` units.

    While unit ``i`` of ``n`` is read, ``torch.utils.data.get_worker_info()`` returns a
    worker-info object with ``id=i, num_workers=n`` and this process's copy of the dataset,
    so a dataset that shards itself by worker info (torch's documented pattern) yields shard
    ``i``. An ``IterDataPipe`` is sharded with ``apply_sharding(dp, n, i)`` instead. With
    ``shards=1`` the worker info stays None, as in torch's main process.

    One shard is read by one worker from its start to its end; the shard count is fixed for
    an epoch. So the source declares ``shards`` as the most workers that can read it
    (:meth:`max_readers`): the loader bounds its stage there, and no tuner grows it past
    the shards it can read. Change ``shards`` between epochs to change the parallelism the
    dataset allows. With ``batch_size``, each batch travels in a frame of its own
    (:meth:`frame_items`), as torch's workers send each batch as soon as it is made.

    Args:
        dataset: the iterable dataset.
        shards: units per epoch.
        batch_size: items are lists of this many samples (per shard, as torch batches per
            worker); None for one sample per item.
        drop_last: drop each shard's last incomplete batch.
        worker_init_fn: called with the shard index at the start of each shard, with the
            worker info already set (a fresh copy of the dataset per shard).
        seed: ``get_worker_info().seed`` is ``seed + shard`` (unless ``draw_seed``).
        generator: what ``draw_seed`` draws from (None: torch's global generator).
        draw_seed: draw the base seed as torch's ``DataLoader`` iterator does, one int64 from
            ``generator`` per :meth:`units` call (or, with ``seed_once``, the first call only,
            as torch's persistent iterator does): ``get_worker_info().seed`` is it plus the
            shard, and the caller's generator moves as under torch.
        seed_readers: seed ``random``, ``torch`` and ``numpy`` before each shard is read in a
            worker process as torch seeds its worker ``shard`` (a thread worker's generators
            are the consumer's, left alone). With ``seed_once``, later epochs seed each shard
            from the first epoch's base seed and their count: which worker reads a shard then
            changes nothing, where torch's persistent worker ``i`` goes on with its streams.
        seed_once: see ``draw_seed`` and ``seed_readers``.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shards: int = 1,
        batch_size: int | None = None,
        drop_last: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        seed: int = 0,
        generator: Any = None,
        draw_seed: bool = False,
        seed_readers: bool = False,
        seed_once: bool = False,
    ):
        name = type(self).__name__
        if not hasattr(dataset, "__iter__"):
            raise TypeError(f"{name}(): dataset must be iterable, got {type(dataset).__name__}")
        if not isinstance(shards, int) or shards < 1:
            raise ValueError(f"{name}(): shards must be a positive int, got {shards!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(
                f"{name}(): batch_size must be a positive int or None, got {batch_size!r}"
            )
        self.dataset = dataset
        self.shards = shards
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.worker_init_fn = worker_init_fn
        self.seed = seed
        self.generator = generator
        self.draw_seed = draw_seed
        self.seed_readers = seed_readers
        self.seed_once = seed_once
        self._epochs = 0  # units() calls so far
        self._replay: int | None = None  # a saved epoch's base seed, for the next units()

    @property
    def batched(self) -> bool:
        """Whether items are batches (``batch_size`` given)."""
        return self.batch_size is not None

    def max_readers(self) -> int:
        """``shards``: a shard is read by one worker, so a worker more has nothing to read."""
        return self.shards

    def frame_items(self) -> int | None:
        """1 with ``batch_size`` (a batch per frame: the first batch goes out as soon as it
        is read, not with the next ones); None (the stage's grouping) for single samples."""
        return 1 if self.batch_size is not None else None

    def units(self, epoch: int = 0) -> list[ShardUnit]:
        """``shards`` units, one per shard (the base seed drawn first: see ``draw_seed``)."""
        first = self._epochs == 0
        self._epochs += 1
        if self.draw_seed and (first or not self.seed_once):
            self.seed = draw_seed(self.generator)
        if self._replay is not None:
            self.seed, self._replay = self._replay, None
        reseed: int | None = None
        if self.seed_readers:
            reseed = self.seed
            if not first and self.seed_once:  # distinct per epoch, whoever reads the shard
                reseed = (self.seed + (self._epochs - 1) * _EPOCH_STRIDE) % (1 << 63)
        return [ShardUnit(i, self.shards, self.seed + i, reseed) for i in range(self.shards)]

    def units_state(self) -> dict:
        """The base seed of the last :meth:`units` call (a resumed epoch reads as it did)."""
        return {"seed": self.seed}

    def load_units_state(self, state: Any) -> None:
        """Make the next :meth:`units` call use the base seed ``state`` saved (None: draw).

        Raises:
            StateError: ``state`` is not such a state (the message names the field).
        """
        if state is None:
            self._replay = None
            return
        seed = state.get("seed") if isinstance(state, dict) else None
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise StateError(
                "Loader: state['units_state']['seed'] must be the int base seed an "
                f"IterableDataset's epoch drew, got {state!r}"
            )
        self._replay = seed

    def read(self, unit: ShardUnit) -> Iterator[Any]:
        """The shard's samples (or batches of them). While the shard is read, and only then
        (not between its items), ``get_worker_info()`` gives the shard's worker info, or None
        for the only shard, in the reading thread alone (:mod:`multiproc.workerinfo`)."""
        import copy

        from torch.utils.data._utils import worker as torch_worker

        ds = self.dataset
        if unit.num_shards > 1 or self.worker_init_fn is not None:
            ds = copy.deepcopy(ds)  # each shard starts from the dataset as the user built it
        info = None
        if unit.num_shards > 1:
            info = torch_worker.WorkerInfo(
                id=unit.id, num_workers=unit.num_shards, seed=unit.seed, dataset=ds
            )
        yield from workerinfo.read_with_info(info, self._read(ds, unit))

    def _read(self, ds: Any, unit: ShardUnit) -> Iterator[Any]:
        from torch.utils.data import IterDataPipe

        if unit.reseed is not None and not in_thread_worker():
            # As torch's worker loop seeds its generators, before worker_init_fn.
            seed_as_torch_worker(unit.reseed, unit.id)
        if self.worker_init_fn is not None:
            self.worker_init_fn(unit.id)
        if isinstance(ds, IterDataPipe) and unit.num_shards > 1:
            from torch.utils.data import graph_settings

            ds = graph_settings.apply_sharding(ds, unit.num_shards, unit.id)
        it = iter(ds)
        if self.batch_size is None:
            yield from it
            return
        while True:
            batch = list(itertools.islice(it, self.batch_size))
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            yield batch
