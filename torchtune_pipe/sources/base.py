"""Sources: where a pipeline's items come from.

A source splits its input into picklable *work units* and turns one unit into items:

- ``units(epoch=0) -> list[unit]``: the units of one epoch, in a deterministic order, already
  sharded for this rank. Each unit carries an ``id`` that is stable across epochs, so a unit
  lost with a crashed worker can be issued again.
- ``read(unit) -> Iterator[item]``: the items of one unit. Any number of worker processes call
  ``read`` on different units at once, so a source holds no open handles and pickles cheaply.

:class:`LineFileSource` reads text files made of lines (TSV, CSV, JSON lines): plain files are
cut into byte ranges of about ``chunk_bytes`` each, gzip files are one unit each
(:mod:`torchtune_pipe.sources.linefiles`, re-exported here).

Two more optional declarations say how a source may be read: :class:`BoundedSource`
(``max_readers``: the most workers that can read it at once) and :class:`FramedSource`
(``frame_items``: how many of its items travel together).

Adapters: :class:`MapDatasetSource` (map-style datasets with torch's samplers; units are
chunks of sampler entries; :mod:`torchtune_pipe.sources.map_dataset`), :class:`IterableDatasetSource`
(``IterableDataset`` and ``IterDataPipe``; unit ``i`` of ``n`` is shard ``i``, with
``get_worker_info()`` set while it is read; :mod:`torchtune_pipe.sources.iterable_dataset`),
:class:`NodeSource` (``torchdata.nodes``), and :func:`as_source` to pick one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torchtune_pipe.errors import StateError
from torchtune_pipe.sources.iterable_dataset import IterableDatasetSource, ShardUnit
from torchtune_pipe.sources.linefiles import FileRange, LineFileSource, SkippedLine, UnitStats
from torchtune_pipe.sources.map_dataset import IndexUnit, MapDatasetSource

__all__ = [
    "BoundedSource",
    "FileRange",
    "FramedSource",
    "IndexUnit",
    "IterableDatasetSource",
    "LineFileSource",
    "MapDatasetSource",
    "NodeSource",
    "NodeUnit",
    "ResumableSource",
    "ShardUnit",
    "ShardedSource",
    "SkippedLine",
    "SkippingSource",
    "Source",
    "UnitStats",
    "as_source",
    "frame_items",
    "left_early",
    "load_units_state",
    "max_readers",
    "read_indexed",
    "units_state",
]


@runtime_checkable
class Source(Protocol):
    """Where items come from: picklable work units, and the items of one unit.

    ``units(epoch)`` runs in the main process and returns the epoch's units in a deterministic
    order (sharded for this rank); ``read(unit)`` runs in any source worker. Because workers
    take whole units from a shared queue, any number of them can share a source and resizing
    the source stage never breaks sharding.

    Optional methods, each declared by a protocol of its own (the loader asks with
    ``isinstance``): :class:`SkippingSource` (``read_from``: resume mid-unit without producing
    the delivered items), :class:`ResumableSource` (``units_state`` / ``load_units_state``:
    replay the random draws of ``units()``), :class:`ShardedSource` (``rank_lengths``: every
    rank's length, so ranks can end their epochs together).
    """

    def units(self, epoch: int = 0) -> list: ...

    def read(self, unit: Any) -> Iterable[Any]: ...


@runtime_checkable
class SkippingSource(Source, Protocol):
    """A source that reads a unit from the middle: ``read_from(unit, skip)`` yields
    ``(k, item)`` for the positions ``k`` not in ``skip``, without producing the others
    (a resume then costs only the items left). Sources without it are read from the unit's
    start and the delivered positions dropped (:func:`read_indexed`)."""

    def read_from(self, unit: Any, skip: frozenset) -> Iterator[tuple[int, Any]]: ...


@runtime_checkable
class ResumableSource(Source, Protocol):
    """A source whose ``units()`` draws random numbers (a shuffled order): ``units_state()``
    returns what the last ``units()`` call drew from, saved in ``Loader.state_dict()``;
    ``load_units_state(state)`` makes the next ``units()`` call draw the same units again, so
    a resumed epoch has the order of the one it resumes."""

    def units_state(self) -> Any: ...

    def load_units_state(self, state: Any) -> None: ...


@runtime_checkable
class ShardedSource(Source, Protocol):
    """A source sharded across ``world_size`` ranks that knows every rank's items per epoch
    (``rank_lengths()``), so ``len(loader)`` can be the shortest rank's."""

    world_size: int

    def rank_lengths(self) -> list[int]: ...


@runtime_checkable
class BoundedSource(Source, Protocol):
    """A source that only ``max_readers()`` workers can read at once (None: any number).

    An ``IterableDataset`` read as ``n`` shards is ``n`` units, each read from its start to
    its end by one worker: a worker beyond ``n`` has nothing to read and only holds its
    memory and a core's share. The loader bounds the source stage by it (its ``workers``,
    ``min_workers`` and ``max_workers``), so the worker bounds every tuner sees
    (``StageStats.max_workers``) are the source's own.
    """

    def max_readers(self) -> int | None: ...


@runtime_checkable
class FramedSource(Source, Protocol):
    """A source that says how many of its items travel in one frame: ``frame_items()``
    (None: the stage's default, which groups small items).

    A frame is committed when it is full, so its first item waits for the others to be read.
    Items that are whole batches go one to a frame, as torch's workers send each batch as it
    is made: grouped, the first batch of a shard waited for the next thirty.
    """

    def frame_items(self) -> int | None: ...


def max_readers(source: Any) -> int | None:
    """The most workers that can read ``source`` at once (:class:`BoundedSource`; None: no
    bound)."""
    n = source.max_readers() if isinstance(source, BoundedSource) else None
    return None if n is None else max(1, int(n))


def frame_items(source: Any) -> int | None:
    """Items per frame ``source`` asks for (:class:`FramedSource`; None: the stage's own)."""
    n = source.frame_items() if isinstance(source, FramedSource) else None
    return None if n is None else max(1, int(n))


def units_state(source: Source) -> Any:
    """What ``source.units()`` last drew from (None for a source that draws nothing)."""
    return source.units_state() if isinstance(source, ResumableSource) else None


def load_units_state(source: Source, state: Any) -> None:
    """Make ``source``'s next ``units()`` draw as the call that ``state`` came from did."""
    if isinstance(source, ResumableSource):
        source.load_units_state(state)


def left_early(source: Any, delivered: int) -> None:
    """Tell ``source`` its consumer left the last ``units()`` call's epoch after ``delivered``
    items without asking for its end (a source with ``left_early``, e.g. one whose sampler
    draws from a generator as it is read, puts that generator where torch's would be)."""
    left = getattr(source, "left_early", None)
    if left is not None:
        left(delivered)


def new_view(source: Any) -> None:
    """Tell ``source`` a snapshot for new workers is taken: its reads that stand in for
    workers in this process read new views of its dataset
    (:mod:`torchtune_pipe.sources.views`), where it has ``new_view``."""
    fn = getattr(source, "new_view", None)
    if fn is not None:
        fn()


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
    if isinstance(obj, Source):
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
    read_from = getattr(source, "read_from", None)  # a SkippingSource (not isinstance: slow)
    if read_from is not None:
        yield from read_from(unit, skip)
        return
    n = 0
    for k, item in enumerate(source.read(unit)):
        n = k + 1
        if k not in skip:
            yield k, item
    if skip and max(skip) >= n:
        raise StateError(
            f"the loaded state (state['partial']) marks position {max(skip)} of a unit of {n} "
            "items as delivered: it was saved by another pipeline or source; load a state "
            "saved by this one"
        )
