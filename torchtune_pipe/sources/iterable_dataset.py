"""Iterable datasets as sources: ``IterableDataset`` and ``IterDataPipe``, one unit per shard,
read with torch's worker info set."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from multiproc import in_thread_worker
from torchtune_pipe.sources.thread_info import set_thread_info

__all__ = ["IterableDatasetSource", "ShardUnit"]


@dataclass(frozen=True)
class ShardUnit:
    """A work unit of an iterable dataset: "shard ``id`` of ``num_shards``".

    Attributes:
        id: the shard index (``get_worker_info().id`` while it is read).
        num_shards: the shard count (``get_worker_info().num_workers``).
        seed: ``get_worker_info().seed``.
    """

    id: int
    num_shards: int
    seed: int = 0


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
        seed: ``get_worker_info().seed`` is ``seed + shard``.
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
        """``shards`` units, one per shard."""
        return [ShardUnit(i, self.shards, self.seed + i) for i in range(self.shards)]

    def read(self, unit: ShardUnit) -> Iterator[Any]:
        """The shard's samples (or batches of them), with the worker info set while reading."""
        import copy

        from torch.utils.data import IterDataPipe
        from torch.utils.data._utils import worker as torch_worker

        ds = self.dataset
        if unit.num_shards > 1 or self.worker_init_fn is not None:
            ds = copy.deepcopy(ds)  # each shard starts from the dataset as the user built it
        info = None
        if unit.num_shards > 1:
            info = torch_worker.WorkerInfo(
                id=unit.id, num_workers=unit.num_shards, seed=unit.seed, dataset=ds
            )
        on_thread = in_thread_worker()  # the consumer's process: a worker info of its own
        previous = torch_worker._worker_info
        if on_thread:
            set_thread_info(info)
        else:
            torch_worker._worker_info = info
        try:
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
        finally:
            if on_thread:
                set_thread_info(None)
            else:
                torch_worker._worker_info = previous
