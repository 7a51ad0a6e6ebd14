"""Map-style datasets as sources: torch's samplers and batching, units of sampler entries."""

from __future__ import annotations

import functools
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

from multiproc import concurrency, in_thread_worker
from torchtune_pipe.errors import StateError
from torchtune_pipe.loader.state import map_source_fingerprint
from torchtune_pipe.sources.orders import drawn_order
from torchtune_pipe.sources.rng import (
    draw_seed,
    generator_digest,
    rng_state_from_text,
    rng_state_text,
    rng_states,
    same_rng_states,
    seed_as_torch_worker,
    seed_held,
)
from torchtune_pipe.sources.views import Views, get_in_view

__all__ = ["IndexUnit", "MapDatasetSource", "PackedEntries"]

_END = object()


def _replayable(source: MapDatasetSource) -> bool:
    """Whether the source draws its order through torch's own samplers only."""
    from torch.utils.data import sampler as torch_samplers

    own = {
        torch_samplers.RandomSampler, torch_samplers.SequentialSampler,
        torch_samplers.SubsetRandomSampler, torch_samplers.WeightedRandomSampler,
    }  # fmt: skip
    batches = source.batch_sampler
    if batches is None:
        return type(source.sampler) in own
    return type(batches) is torch_samplers.BatchSampler and type(batches.sampler) in own


def _plain_batches(index_sampler: Any, batched: bool) -> tuple[Any, int, bool] | None:
    """``(sampler, batch size, drop_last)`` where ``index_sampler`` is torch's own
    ``BatchSampler`` (or, unbatched, no batch sampler: size 1) over torch's ``RandomSampler``
    or ``SequentialSampler``, whose indices are Python ints by construction; else None."""
    from torch.utils.data import sampler as torch_samplers

    sampler, size, drop_last = index_sampler, 1, False
    if batched:
        if type(index_sampler) is not torch_samplers.BatchSampler:
            return None
        sampler, size, drop_last = (
            index_sampler.sampler, index_sampler.batch_size, index_sampler.drop_last
        )  # fmt: skip
    plain = (torch_samplers.RandomSampler, torch_samplers.SequentialSampler)
    return (sampler, size, drop_last) if type(sampler) in plain else None


def _sampler_name(source: Any) -> str:
    """The type name of the sampler that orders ``source``'s samples (the user's)."""
    from torch.utils.data import BatchSampler

    bs = source.batch_sampler if source.batched else None
    order = bs.sampler if type(bs) is BatchSampler else (bs if bs is not None else source.sampler)
    return type(order).__name__


def _unsized_limit(index_sampler: Any, dataset: Any) -> int | None:
    """The most indices an epoch of ``index_sampler`` may give where it has no ``__len__``
    (10 times the dataset's length, or 2**26 where that has none either); None where it has
    one."""
    try:
        len(index_sampler)
        return None
    except TypeError:
        pass
    try:
        return 10 * len(dataset)
    except TypeError:
        return 1 << 26


@dataclass(frozen=True, repr=False)
class IndexUnit:
    """A work unit of a map-style dataset: consecutive entries of the sampler's order.

    Attributes:
        id: position in the epoch's (unsharded) unit list.
        entries: one entry per item: an index, or a list of indices (one batch); a
            :class:`PackedEntries` where every index is an ``int``, else a tuple.
        seed: seed of the random generators while the unit is read (None: not seeded).
        epoch: the epoch it is of (what seeds the dataset's own generators, with ``id``).
    """

    id: int
    entries: Sequence[Any]
    seed: int | None = None
    epoch: int = 0

    def __repr__(self) -> str:
        # Bounded, for error notes: an epoch's unit may hold thousands of indices.
        return f"IndexUnit(id={self.id}, entries={_brief(self.entries)})"


def _brief(values: Any, head: int = 3) -> str:
    """A bounded repr of a sequence of indices (or of batches of them): its first ``head``
    values, the last and the count when it holds more than ``2 * head``."""
    values = list(values)
    shown = values if len(values) <= 2 * head else values[:head]
    parts = [_brief(v, head) if isinstance(v, (list, tuple)) else repr(v) for v in shown]
    if len(shown) < len(values):
        last = values[-1]
        parts += ["...", _brief(last, head) if isinstance(last, (list, tuple)) else repr(last)]
        return f"[{', '.join(parts)}] ({len(values)})"
    return f"[{', '.join(parts)}]"


class PackedEntries(Sequence):
    """A unit's entries with their indices held as int64 (``array('q')``), not as Python ints.

    The consumer holds an epoch's whole order: 200,000 samples as lists of Python ints are
    ~5.5 MB of its own memory (pages no worker shares), and twice that while the next epoch's
    order is drawn before the last one's units are let go; packed, ~1.6 MB. An entry reads
    back as the sampler gave it: an ``int``, or a ``list`` of ints (one batch, the list
    ``__getitems__`` receives, as from torch's ``BatchSampler``).
    """

    __slots__ = ("_flat", "_ends")

    def __init__(self, flat: array, ends: array | None = None):
        self._flat = flat
        self._ends = ends  # None: one index per entry; else each batch's end in ``flat``

    @staticmethod
    def pack(entries: list, batched: bool) -> Sequence[Any]:
        """``entries`` packed when every index is an ``int`` that fits in int64; else as a
        tuple, unchanged (a sampler may yield any key its dataset takes: ``numpy`` ints,
        strings)."""
        try:
            if not batched:
                if set(map(type, entries)) <= {int}:
                    return PackedEntries(array("q", entries))
            elif all(set(map(type, e)) <= {int} for e in entries):
                return PackedEntries(
                    array("q", chain.from_iterable(entries)),
                    array("q", accumulate(map(len, entries))),
                )
        except OverflowError:
            pass
        return tuple(entries)

    def __len__(self) -> int:
        return len(self._flat) if self._ends is None else len(self._ends)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return tuple(self)[k]
        if self._ends is None:
            return self._flat[k]
        k = range(len(self._ends))[k]  # negative indices, IndexError
        return self._flat[self._ends[k - 1] if k else 0 : self._ends[k]].tolist()

    def __iter__(self) -> Iterator[Any]:
        if self._ends is None:
            return iter(self._flat)
        return (
            self._flat[a:b].tolist()
            for a, b in zip(chain((0,), self._ends), self._ends, strict=False)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return list(self) == list(other)

    def __hash__(self) -> int:
        return hash(tuple(self) if self._ends is None else tuple(map(tuple, self)))

    def __reduce__(self) -> tuple:
        return PackedEntries, (self._flat, self._ends)

    def __repr__(self) -> str:
        return f"PackedEntries({_brief(self)})"


# Samples per work unit of an unbatched map-style dataset, by default: as many as a frame holds
# (multiproc.StageSpec.frame_items), so samples travel between stages a frame at a time.
SAMPLES_PER_UNIT = 64


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
            resume bookkeeping, and what travels together between stages). Default: 1 batch
            when batched, else :data:`SAMPLES_PER_UNIT` samples (a unit of one sample would
            make every sample a frame of its own, paying a hop per sample).
        seed_units: seed ``random``, ``numpy`` and ``torch`` as torch seeds its worker
            ``unit.id`` (``base_seed + unit.id``; numpy through torch's ``_generate_state``)
            before reading a unit, so random transforms in ``__getitem__`` do not depend on
            which worker reads which unit, and the first unit of each of torch's workers
            draws what it draws there.
        rank: this process's rank; units are sharded ``units[rank::world_size]``.
        world_size: number of ranks.
        sampler_epoch: pass the epoch :meth:`units` is asked for to the sampler's
            ``set_epoch`` (a ``DistributedSampler``'s) before drawing its order. False: the
            sampler's epoch is its owner's to set, as under torch's ``DataLoader``, which never
            sets it (an epoch a loader ends early or a run resumed at a later epoch must not
            put it back).
        seed_once: draw the base seed from ``generator`` at the first :meth:`units` call
            only, as torch's persistent iterator does; later calls read it from a copy (so
            each epoch's unit seeds differ) and leave the generator as torch leaves it.

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
        entries_per_unit: int | None = None,
        seed_units: bool = False,
        rank: int = 0,
        world_size: int = 1,
        sampler_epoch: bool = True,
        seed_once: bool = False,
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
        if entries_per_unit is None:
            entries_per_unit = (
                1 if (batch_size is not None or batch_sampler is not None) else (SAMPLES_PER_UNIT)
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
        self.sampler_epoch = sampler_epoch
        self.seed_once = seed_once
        self._drawn = 0  # units() calls that drew their base seed from the generator
        self._drew = True  # whether the last one did
        self.rank = rank
        self.world_size = world_size
        self.base_seed = 0
        self._rng_state: dict | None = None
        # A generator of the user's sampler apart from ``generator``, and its state when the
        # last units() call began (left_early).
        self._own: tuple[Any, Any] | None = None
        self._replay: dict | None = None
        # Whether __getitem__ draws random numbers, from the global generators or the
        # dataset's own (per process).
        self._draws: bool | None = None
        # Entries torch's iterator pulls from the sampler ahead of those delivered (its
        # prefetch_factor * num_workers; set by the DataLoader): see left_early.
        self.pulled_ahead = 0
        # What reads standing in for workers read (torchtune_pipe.sources.views).
        self.views = Views(dataset)

    def new_view(self) -> None:
        """Start a new generation of the views that reads standing in for workers read
        (:mod:`torchtune_pipe.sources.views`): taken with each snapshot workers fork from."""
        self.views.renew()

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

        if self.sampler_epoch and hasattr(self.sampler, "set_epoch"):
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
            own = getattr(getattr(self.batch_sampler, "sampler", self.sampler), "generator", None)
            self._own = (
                (own, own.get_state())
                if isinstance(own, torch.Generator) and own is not self.generator
                else None
            )
            plain = _plain_batches(index_sampler, self.batched)
            it = iter(index_sampler if plain is None else plain[0])
            self._drew = (
                replay["drew_seed"] if replay is not None else not (self.seed_once and self._drawn)
            )
            self.base_seed = draw_seed(self.generator, peek=not self._drew)
            self._drawn += self._drew
            chunks = (
                self._chunks(it, _unsized_limit(index_sampler, self.dataset))
                if plain is None
                else self._sliced(it, *plain[1:], order=plain[0])
            )
            units = [
                IndexUnit(j, entries, self.base_seed + j if self.seed_units else None, epoch)
                for j, entries in enumerate(chunks)
            ]
        return units[self.rank :: self.world_size]

    def _sliced(
        self, it: Iterator[int], size: int, drop_last: bool, order: Any = None
    ) -> Iterator[PackedEntries]:
        """What :meth:`_chunks` gives for torch's ``BatchSampler(sampler, size, drop_last)``
        over ``it``, the sampler's order (``size`` 1: entries are indices), read into an
        ``int64`` array at once and cut into units: the same entries, without a Python list
        per batch (an epoch of 120,000 indices in batches of 256: 8 ms against 13). Where
        ``order``, the sampler ``it`` iterates, is one :func:`drawn_order` draws whole, its
        order is drawn that way instead of iterated (the same draws)."""
        flat = drawn_order(order) if order is not None else None
        flat = array("q", it) if flat is None else flat
        total = len(flat) - (len(flat) % size if drop_last else 0)
        step = self.entries_per_unit * size  # indices per unit
        for a in range(0, total, step):
            b = min(a + step, total)
            if not self.batched:
                yield PackedEntries(flat[a:b])
            else:
                ends = array("q", range(size, b - a, size))
                ends.append(b - a)
                yield PackedEntries(flat[a:b], ends)

    def _chunks(self, it: Iterator[Any], limit: int | None = None) -> Iterator[Sequence[Any]]:
        """The sampler's entries, ``entries_per_unit`` at a time, packed
        (:class:`PackedEntries`) as they are drawn: the epoch's order is never held as Python
        ints.

        Raises:
            ValueError: the sampler has no ``__len__`` and gave more than ``limit`` indices
                (an infinite sampler: an epoch is planned whole when it starts).
        """
        n, batched, buf, count = self.entries_per_unit, self.batched, [], 0
        for e in it:
            e = list(e) if batched else e
            count += len(e) if batched else 1
            if limit is not None and count > limit:
                raise ValueError(
                    f"DataLoader: the sampler {_sampler_name(self)} has no __len__ and gave "
                    f"more than {limit} indices for one epoch (10 times the dataset's "
                    "length): an infinite sampler? This loader plans an epoch's batches when "
                    "the epoch starts; give the sampler a __len__ (the samples of one epoch) "
                    "and stop it there, e.g. with itertools.islice"
                )
            buf.append(e)
            if len(buf) == n:
                yield PackedEntries.pack(buf, batched)
                buf = []
        if buf:
            yield PackedEntries.pack(buf, batched)

    def left_early(self, delivered: int) -> None:
        """The consumer stopped after ``delivered`` entries (batches when batched) of the last
        :meth:`units` call's epoch, without asking for its end: leave ``generator`` (and one
        the user gave the sampler) where torch's iterator leaves it, having pulled
        ``delivered + pulled_ahead`` entries from the sampler (``RandomSampler`` draws a last
        permutation from it only when a pull finds its end: the next epoch's order depends on
        where the last one stopped). The epoch's draws are made again from where it started,
        up to that pull; only through torch's own samplers, whose one state is the generator
        (a sampler of the user's may count its ``__iter__`` calls)."""
        start = None if self._rng_state is None else self._rng_state["generator"]
        own = self._own
        if (start is None and own is None) or self.world_size != 1 or not _replayable(self):
            return
        import torch

        if own is not None:
            own[0].set_state(own[1])
        if start is not None:
            self.generator.set_state(start)
        it = iter(self.batch_sampler if self.batched else self.sampler)
        if start is not None and self._drew:
            # The base seed (without ``generator`` it came from the global one: not again).
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        for _ in range(delivered + self.pulled_ahead):
            if next(it, _END) is _END:
                break

    def fingerprint(self) -> dict[str, Any]:
        """What decides which samples an epoch yields, by field, for a saved state to match:
        see :func:`torchtune_pipe.loader.state.map_source_fingerprint`."""
        return map_source_fingerprint(self)

    def units_state(self) -> dict | None:
        """The random state the last ``units()`` call started from (to replay its order), as
        plain data: each generator's state in base64."""
        if self._rng_state is None:
            return None
        out: dict[str, Any] = {
            k: None if v is None else rng_state_text(v) for k, v in self._rng_state.items()
        }
        out["drew_seed"] = self._drew  # else read from a copy (``seed_once``)
        return out

    def load_units_state(self, state: Mapping | None) -> None:
        """Make the next ``units()`` call draw the same order as the one ``state`` came from
        (what :meth:`units_state` returned; states that hold the generators' states as
        tensors load too).

        Raises:
            StateError: ``state`` is not such a state (the message names the field).
        """
        if state is None:
            self._replay = None
            return
        if not isinstance(state, Mapping) or "torch" not in state:
            raise StateError(
                "Loader: state['units_state'] must map 'torch' and 'generator' to generator "
                f"states, got {type(state).__name__}"
            )
        self._replay = {
            k: None
            if state.get(k) is None
            else rng_state_from_text(state[k], f"state['units_state'][{k!r}]")
            for k in ("torch", "generator")
        }
        self._replay["drew_seed"] = bool(state.get("drew_seed", True))

    def calls_per_unit(self, unit: IndexUnit) -> int | None:
        """The ``__getitem__`` calls a read of ``unit`` runs at once on its worker's threads
        (its samples), so that a worker may read several units side by side
        (:mod:`multiproc.readahead`); None when units must be read one at a time: unbatched,
        fetched with ``__getitems__``, or ``__getitem__`` draws from the global random
        generators (or this process has not read a batch yet to find that out)."""
        if not self.batched or self._draws is not False:
            return None
        if getattr(self.dataset, "__getitems__", None) is not None:
            return None
        return sum(len(e) for e in unit.entries)

    def read(self, unit: IndexUnit) -> Iterator[Any]:
        """The unit's items: samples, or lists of samples (one per batch)."""
        for _, item in self.read_from(unit, frozenset()):
            yield item

    def may_run_on_threads(self) -> bool:
        """Whether reads may run on thread workers of the consumer's process, which leave the
        process's random generators alone: where no per-unit seed is asked, or once a read
        showed that ``__getitem__`` draws nothing from them (a seed it would not read)."""
        return not self.seed_units or self._draws is False

    def read_from(self, unit: IndexUnit, skip: frozenset) -> Iterator[tuple[int, Any]]:
        """``(k, item)`` for the unit's entries not in ``skip``, fetching only those.

        What ``__getitem__`` (or ``__getitems__``) raises gets a note naming the index and
        the item's place in the epoch (the batch and its samples)."""
        if unit.seed is not None and not in_thread_worker():
            # As torch seeds its worker unit.id (seed = base seed + id); a thread worker's
            # generators are the consumer's: left alone.
            seed_as_torch_worker(unit.seed - unit.id, unit.id)
        ds = self.views.get()
        if unit.seed is not None:  # the dataset's own generators (a thread's view holds copies)
            seed_held(self.views.held(ds), unit.epoch, unit.id)
        getitems = getattr(ds, "__getitems__", None) if self.batched else None
        for k, entry in enumerate(unit.entries):
            if k in skip:
                continue
            n = unit.id * self.entries_per_unit + k  # the item's place in the epoch's order
            try:
                if not self.batched:
                    item = ds[entry]
                elif getitems:
                    item = getitems(entry)
                else:
                    item = self._fetch_batch(entry, n)
            except Exception as e:
                if not self.batched:
                    _note(e, f"dataset[{entry!r}] raised it: sample {n} of the epoch")
                elif getitems:
                    _note(e, f"dataset.__getitems__() raised it: {_batch(n, entry)}")
                raise
            yield k, item

    def _fetch_batch(self, entry: list, n: int) -> list:
        """Batch ``n``'s samples; on the worker's threads when its stage's concurrency is
        above 1 (reads that wait overlap), unless ``__getitem__`` draws random numbers (from
        the global generators or the dataset's own): threads would interleave the draws, and
        batches would differ run to run.
        The first batch a process reads is read serially to find that out."""
        ds = self.views.get()
        if self._draws is None:
            before, held = rng_states(), [g for g, _ in self.views.held(ds)]
            held_before = [generator_digest(g) for g in held]
            out = _read_each(ds, entry, n)
            self._draws = not same_rng_states(before, rng_states()) or held_before != [
                generator_digest(g) for g in held
            ]
            return out
        pool = concurrency.current()
        if pool.width <= 1 or self._draws:
            return _read_each(ds, entry, n)
        # Calls side by side on threads: each thread reads a view of its own (views.py).
        outs = pool.map(functools.partial(get_in_view, self.views), entry)
        for i, o in zip(entry, outs, strict=True):
            if o.error is not None:
                _note(o.error, f"dataset[{i!r}] raised it: {_batch(n, entry)}")
                raise o.error
        return [o.value for o in outs]


def _read_each(ds: Any, entry: list, n: int) -> list:
    """``[ds[i] for i in entry]``, the failing index noted."""
    out: list = []
    append = out.append
    i = None
    try:
        for i in entry:
            append(ds[i])  # as torch fetches: the type's __getitem__, never an instance's
    except Exception as e:
        _note(e, f"dataset[{i!r}] raised it: {_batch(n, entry)}")
        raise
    return out


def _batch(n: int, entry: list) -> str:
    return f"batch {n} of the epoch, samples {_brief(entry)}"


def _note(e: BaseException, text: str) -> None:
    if hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(text)
