"""Sources: where a pipeline's items come from.

A source splits its input into picklable *work units* and turns one unit into items:

- ``units(epoch=0) -> list[unit]``: the units of one epoch, in a deterministic order, already
  sharded for this rank. Each unit carries an ``id`` that is stable across epochs, so a unit
  lost with a crashed worker can be issued again.
- ``read(unit) -> Iterator[item]``: the items of one unit. Any number of worker processes call
  ``read`` on different units at once, so a source holds no open handles and pickles cheaply.

:class:`LineFileSource` reads text files made of lines (TSV, CSV, JSON lines): plain files are
cut into byte ranges of about ``chunk_bytes`` each, gzip files are one unit each
(:mod:`torchtune_pipe.linefiles`, re-exported here).

Adapters: :class:`MapDatasetSource` (map-style datasets with torch's samplers; units are
chunks of sampler entries), :class:`IterableDatasetSource` (``IterableDataset`` and
``IterDataPipe``; unit ``i`` of ``n`` is shard ``i``, with ``get_worker_info()`` set while it
is read), :class:`NodeSource` (``torchdata.nodes``), and :func:`as_source` to pick one.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from multiproc import concurrency
from torchtune_pipe.linefiles import FileRange, LineFileSource, SkippedLine, UnitStats

__all__ = [
    "FileRange",
    "IndexUnit",
    "IterableDatasetSource",
    "LineFileSource",
    "MapDatasetSource",
    "NodeSource",
    "NodeUnit",
    "ShardUnit",
    "SkippedLine",
    "Source",
    "UnitStats",
    "as_source",
    "read_indexed",
]


@runtime_checkable
class Source(Protocol):
    """Where items come from: picklable work units, and the items of one unit.

    ``units(epoch)`` runs in the main process and returns the epoch's units in a deterministic
    order (sharded for this rank); ``read(unit)`` runs in any source worker. Because workers
    take whole units from a shared queue, any number of them can share a source and resizing
    the source stage never breaks sharding. A source may also offer
    ``read_from(unit, skip) -> Iterator[(k, item)]`` to skip the items at positions ``skip``
    without producing them (used to resume mid-unit), and ``units_state()`` /
    ``load_units_state(state)`` when ``units()`` draws random numbers that must be replayed
    to resume an epoch.
    """

    def units(self, epoch: int = 0) -> list: ...

    def read(self, unit: Any) -> Iterable[Any]: ...


@dataclass(frozen=True)
class IndexUnit:
    """A work unit of a map-style dataset: consecutive entries of the sampler's order.

    Attributes:
        id: position in the epoch's (unsharded) unit list.
        entries: one entry per item: an index, or a list of indices (one batch).
        seed: seed of the random generators while the unit is read (None: not seeded).
    """

    id: int
    entries: tuple
    seed: int | None = None


class MapDatasetSource:
    """A map-style ``Dataset`` as a source, with torch's samplers and batching semantics.

    The order comes from the sampler, drawn in the main process exactly as
    ``torch.utils.data.DataLoader`` draws it (a base seed from ``generator`` first, then the
    sampler), so shuffling is torch's. Units are chunks of ``entries_per_unit`` consecutive
    entries. With ``batch_size`` (or ``batch_sampler``) an item is the list of samples of one
    batch, fetched with ``__getitems__`` when the dataset has it; otherwise an item is one
    sample.

    Args:
        dataset: anything with ``__getitem__`` (and ``__len__`` for the default samplers).
        batch_size: samples per item; None for one sample per item.
        shuffle: use a ``RandomSampler`` (with ``generator``) instead of a sequential one.
        sampler: a sampler of indices (excludes ``shuffle``).
        batch_sampler: a sampler of index lists (excludes the four arguments above).
        drop_last: drop the last incomplete batch.
        generator: the ``torch.Generator`` of the sampler and the base seed.
        entries_per_unit: sampler entries per work unit (the unit of load balancing and of
            resume bookkeeping).
        seed_units: seed ``random``, ``numpy`` and ``torch`` with ``base_seed + unit.id``
            before reading a unit, so random transforms in ``__getitem__`` do not depend on
            which worker reads which unit.
        rank: this process's rank; units are sharded ``units[rank::world_size]``.
        world_size: number of ranks.

    Example:
        >>> src = MapDatasetSource(ds, batch_size=32, shuffle=True)   # doctest: +SKIP
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int | None = None,
        shuffle: bool = False,
        sampler: Any = None,
        batch_sampler: Any = None,
        drop_last: bool = False,
        generator: Any = None,
        entries_per_unit: int = 1,
        seed_units: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

        name = type(self).__name__
        if not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"{name}(): dataset must have __getitem__, got {type(dataset).__name__}"
            )
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(
                f"{name}(): batch_size must be a positive int or None, got {batch_size!r}"
            )
        if not isinstance(entries_per_unit, int) or entries_per_unit < 1:
            raise ValueError(
                f"{name}(): entries_per_unit must be a positive int, got {entries_per_unit!r}"
            )
        if sampler is not None and shuffle:
            raise ValueError(f"{name}(): sampler is mutually exclusive with shuffle")
        if batch_sampler is not None and (
            batch_size is not None or shuffle or sampler is not None or drop_last
        ):
            raise ValueError(
                f"{name}(): batch_sampler is mutually exclusive with batch_size, shuffle, "
                "sampler and drop_last"
            )
        if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"{name}(): need 0 <= rank < world_size, got {rank}, {world_size}")
        if sampler is None:
            sampler = (
                RandomSampler(dataset, generator=generator)
                if shuffle
                else SequentialSampler(dataset)
            )
        if batch_sampler is None and batch_size is not None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.dataset = dataset
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.batched = batch_sampler is not None
        self.generator = generator
        self.entries_per_unit = entries_per_unit
        self.seed_units = seed_units
        self.rank = rank
        self.world_size = world_size
        self.base_seed = 0
        self._rng_state: dict | None = None
        self._replay: dict | None = None
        self._draws: bool | None = None  # whether __getitem__ draws random numbers (per process)

    def __len__(self) -> int:
        """This rank's items per epoch (batches when batched), as ``len(DataLoader)`` counts
        them."""
        return self.rank_lengths()[self.rank]

    def rank_lengths(self) -> list[int]:
        """Items per epoch of every rank (units of ``entries_per_unit`` dealt round-robin)."""
        total = len(self.batch_sampler if self.batched else self.sampler)
        n = self.entries_per_unit
        sizes = [min(n, total - i) for i in range(0, total, n)]
        return [sum(sizes[r :: self.world_size]) for r in range(self.world_size)]

    def units(self, epoch: int = 0) -> list[IndexUnit]:
        """The epoch's units. Draws the base seed, then the sampler order, like torch."""
        import torch

        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        index_sampler = self.batch_sampler if self.batched else self.sampler
        replay, self._replay = self._replay, None
        with torch.random.fork_rng(devices=[], enabled=replay is not None):
            if replay is not None:
                torch.set_rng_state(replay["torch"])
                if self.generator is not None and replay["generator"] is not None:
                    self.generator.set_state(replay["generator"])
            self._rng_state = {
                "torch": torch.get_rng_state(),
                "generator": None if self.generator is None else self.generator.get_state(),
            }
            it = iter(index_sampler)
            self.base_seed = int(
                torch.empty((), dtype=torch.int64).random_(generator=self.generator).item()
            )
            entries = [list(e) if self.batched else e for e in it]
        n = self.entries_per_unit
        units = [
            IndexUnit(j, tuple(entries[i : i + n]), self.base_seed + j if self.seed_units else None)
            for j, i in enumerate(range(0, len(entries), n))
        ]
        return units[self.rank :: self.world_size]

    def units_state(self) -> dict | None:
        """The random state the last ``units()`` call started from (to replay its order)."""
        return self._rng_state

    def load_units_state(self, state: dict | None) -> None:
        """Make the next ``units()`` call draw the same order as the one ``state`` came from."""
        self._replay = state

    def read(self, unit: IndexUnit) -> Iterator[Any]:
        """The unit's items: samples, or lists of samples (one per batch)."""
        for _, item in self.read_from(unit, frozenset()):
            yield item

    def read_from(self, unit: IndexUnit, skip: frozenset) -> Iterator[tuple[int, Any]]:
        """``(k, item)`` for the unit's entries not in ``skip``, fetching only those."""
        if unit.seed is not None:
            _seed_all(unit.seed)
        ds = self.dataset
        getitems = getattr(ds, "__getitems__", None) if self.batched else None
        for k, entry in enumerate(unit.entries):
            if k in skip:
                continue
            if not self.batched:
                yield k, ds[entry]
            elif getitems:
                yield k, getitems(entry)
            else:
                yield k, self._fetch_batch(entry)

    def _fetch_batch(self, entry: list) -> list:
        """One batch's samples; on the worker's threads when its stage's concurrency is above
        1 (reads that wait overlap), unless ``__getitem__`` draws from the global random
        generators: threads would interleave the draws, and batches would differ run to run.
        The first batch a process reads is read serially to find that out."""
        ds = self.dataset
        if self._draws is None:
            before = _rng_states()
            out = [ds[i] for i in entry]
            self._draws = not _same_rng_states(before, _rng_states())
            return out
        pool = concurrency.current()
        if pool.width <= 1 or self._draws:
            return [ds[i] for i in entry]
        outs = pool.map(ds.__getitem__, entry)
        for o in outs:
            if o.error is not None:
                raise o.error
        return [o.value for o in outs]


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
    an epoch. Resizing the source stage is safe at any time, but it only helps between
    shards: more workers than unread shards idle, so change ``shards`` between epochs to
    change the parallelism the dataset allows.

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
        previous = torch_worker._worker_info
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
            torch_worker._worker_info = previous


@dataclass(frozen=True)
class NodeUnit:
    """The single work unit of a :class:`NodeSource`."""

    id: int = 0


class NodeSource:
    """A ``torchdata.nodes.BaseNode`` graph as a source.

    A node graph is one sequential stream with its own internal parallelism, so it is one
    unit: ``read`` resets the node and iterates it to the end. Use it to reuse an existing
    torchdata graph as the reading stage and tune the stages after it.

    Args:
        node: the root node of the graph.
    """

    def __init__(self, node: Any):
        if not (hasattr(node, "reset") and hasattr(node, "__next__")):
            raise TypeError(
                f"NodeSource(): node must be a torchdata.nodes.BaseNode, got {type(node).__name__}"
            )
        self.node = node

    def units(self, epoch: int = 0) -> list[NodeUnit]:
        """One unit."""
        return [NodeUnit(0)]

    def read(self, unit: NodeUnit) -> Iterator[Any]:
        """Every item of the node, from a reset."""
        self.node.reset()
        yield from self.node


def as_source(obj: Any) -> Source:
    """Wrap ``obj`` as a :class:`Source`: sources pass through; torchdata nodes, iterable
    datasets (and datapipes) and map-style datasets get their adapter.

    Raises:
        TypeError: ``obj`` is none of these.
    """
    if hasattr(obj, "units") and hasattr(obj, "read"):
        return obj
    try:
        from torchdata.nodes import BaseNode
    except ImportError:  # torchdata is optional for this adapter only
        BaseNode = ()  # noqa: N806
    if BaseNode and isinstance(obj, BaseNode):
        return NodeSource(obj)
    from torch.utils.data import IterableDataset

    if isinstance(obj, IterableDataset):
        return IterableDatasetSource(obj)
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        return MapDatasetSource(obj)
    raise TypeError(
        f"as_source(): expected a Source (units/read), a torchdata node, an IterableDataset or a "
        f"map-style dataset, got {type(obj).__name__}"
    )


def read_indexed(source: Any, unit: Any, skip: frozenset) -> Iterator[tuple[int, Any]]:
    """``(k, item)`` for the items of ``unit`` whose position ``k`` is not in ``skip``."""
    read_from = getattr(source, "read_from", None)
    if read_from is not None:
        yield from read_from(unit, skip)
        return
    n = 0
    for k, item in enumerate(source.read(unit)):
        n = k + 1
        if k not in skip:
            yield k, item
    if skip and max(skip) >= n:
        from .errors import StateError

        raise StateError(
            f"the loaded state (state['partial']) marks position {max(skip)} of a unit of {n} "
            "items as delivered: it was saved by another pipeline or source; load a state "
            "saved by this one"
        )


def _rng_states() -> tuple:
    """The global generators' states (``random``, ``numpy``, ``torch``), as
    :func:`_set_rng_states` puts them back."""
    import numpy as np
    import torch

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_rng_states(states: tuple) -> None:
    import numpy as np
    import torch

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def _same_rng_states(a: tuple, b: tuple) -> bool:
    import numpy as np
    import torch

    np_a, np_b = a[1], b[1]  # (name, keys array, position, has_gauss, cached_gaussian)
    return (
        a[0] == b[0]
        and np.array_equal(np_a[1], np_b[1])
        and np_a[2:] == np_b[2:]
        and torch.equal(a[2], b[2])
    )


def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
