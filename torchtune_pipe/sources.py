"""Sources: where a pipeline's items come from.

A source splits its input into picklable *work units* and turns one unit into items:

- ``units(epoch=0) -> list[unit]``: the units of one epoch, in a deterministic order, already
  sharded for this rank. Each unit carries an ``id`` that is stable across epochs, so a unit
  lost with a crashed worker can be issued again.
- ``read(unit) -> Iterator[item]``: the items of one unit. Any number of worker processes call
  ``read`` on different units at once, so a source holds no open handles and pickles cheaply.

:class:`LineFileSource` reads text files made of lines (TSV, CSV, JSON lines): plain files are
cut into byte ranges of about ``chunk_bytes`` each, gzip files are one unit each.

Adapters (the :class:`Source` protocol, below the line-file part): :class:`MapDatasetSource`
(map-style datasets with torch's samplers; units are chunks of sampler entries),
:class:`IterableDatasetSource` (``IterableDataset`` and ``IterDataPipe``; unit ``i`` of ``n`` is
shard ``i``, with ``get_worker_info()`` set while it is read), :class:`NodeSource`
(``torchdata.nodes``), and :func:`as_source` to pick one.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal, Protocol, runtime_checkable

from torchtune_pipe.errors import BadLinesError, SourceError

_logger = logging.getLogger(__name__)

_MiB = 1 << 20
_MAX_WARNINGS = 5


@dataclass(frozen=True)
class FileRange:
    """A work unit of a line file: the lines that *start* in bytes ``[start, end)`` of ``path``.

    Attributes:
        id: unit id, stable across epochs and ranks (position in the unsharded unit list).
        path: the file.
        start: first byte offset of the range.
        end: one past the last byte offset; for a gzip file, its compressed size (a gzip unit
            always covers the whole file).
        first_line: 1-based line number of the first line of the range when known (always 1
            for ``start == 0``), else None; it is computed only if an error needs it.
    """

    id: int
    path: str
    start: int
    end: int
    first_line: int | None = None

    @property
    def compressed(self) -> bool:
        """Whether the file is gzip-compressed (judged by its ``.gz`` suffix)."""
        return self.path.endswith(".gz")


@dataclass(frozen=True)
class SkippedLine:
    """A malformed line dropped under ``on_error="skip"``, as passed to the ``on_skip`` hook.

    Attributes:
        path: the file.
        line: 1-based line number in ``path``.
        error: why the line was rejected.
    """

    path: str
    line: int
    error: str


@dataclass(frozen=True)
class UnitStats:
    """What reading one unit did; the return value of the :meth:`LineFileSource.read` generator.

    Get it with ``stats = yield from source.read(unit)`` or from ``StopIteration.value``.
    Counting per unit (rather than on the source object) keeps the numbers right when many
    worker processes each hold their own copy of the source.

    Attributes:
        unit_id: the unit read.
        lines: lines read, malformed ones included.
        skipped: malformed lines dropped under ``on_error="skip"``.
        bytes_read: bytes consumed from the file (decompressed bytes for gzip).
    """

    unit_id: int
    lines: int
    skipped: int
    bytes_read: int


class LineFileSource:
    """Reads lines from text files, as units of byte ranges that any worker can read.

    Glob patterns are expanded and the files sorted. A plain file is cut into ranges of about
    ``chunk_bytes``; a line belongs to the range in which it starts, so every line is read
    exactly once whatever the chunk size. A ``.gz`` file is one unit (gzip is not seekable).
    Lines reach the parser without their ``\\n`` or ``\\r\\n`` terminator.

    Args:
        paths: a path or glob pattern, or a list of them.
        chunk_bytes: target size of a plain-file unit.
        parse: turns one line (bytes) into an item; default: the line decoded as UTF-8.
        parse_batch: turns a list of lines into one item (e.g. arrays for a chunk of rows);
            requires ``batch_lines`` and excludes ``parse``. It may raise
            :class:`~torchtune_pipe.errors.BadLinesError` to name the bad lines of its batch;
            on any other exception the batch is re-parsed line by line to find them.
        batch_lines: if set, ``read`` yields one item per batch of up to this many lines: a
            list of ``parse``'d lines, or ``parse_batch(lines)``. Batches do not span units.
        on_error: ``"raise"`` (a malformed line raises
            :class:`~torchtune_pipe.errors.SourceError` naming file and line) or ``"skip"``
            (the line is dropped, counted in :class:`UnitStats`, passed to ``on_skip`` and
            logged as a warning for the first few per source copy).
        on_skip: called in the reading process with a :class:`SkippedLine` per dropped line.
        rank: this process's rank; units are sharded ``units[rank::world_size]``.
        world_size: number of ranks sharing the files.
        shuffle_units: permute the unit order every epoch (seeded by ``seed`` and the epoch,
            so all ranks agree) before sharding.
        seed: seed of the unit permutation.
        remote_latency_s: seconds to wait before reading each unit, to emulate the first-byte
            latency of a network filesystem in benchmarks.
        read_block_bytes: size of each ``read()`` call on the file.

    Raises:
        FileNotFoundError: a path or pattern matches no file.
        ValueError: an argument is out of range.

    Example:
        >>> src = LineFileSource("data/day_*.gz", batch_lines=4096)   # doctest: +SKIP
        >>> for unit in src.units(epoch=0):                          # doctest: +SKIP
        ...     for lines in src.read(unit): ...
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        chunk_bytes: int = 16 * _MiB,
        parse: Callable[[bytes], Any] | None = None,
        parse_batch: Callable[[list[bytes]], Any] | None = None,
        batch_lines: int | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        on_skip: Callable[[SkippedLine], None] | None = None,
        rank: int = 0,
        world_size: int = 1,
        shuffle_units: bool = False,
        seed: int = 0,
        remote_latency_s: float = 0.0,
        read_block_bytes: int = 1 * _MiB,
    ):
        name = type(self).__name__
        for arg, value in (("chunk_bytes", chunk_bytes), ("read_block_bytes", read_block_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}(): {arg} must be a positive int, got {value!r}")
        if batch_lines is not None and (not isinstance(batch_lines, int) or batch_lines <= 0):
            raise ValueError(f"{name}(): batch_lines must be a positive int, got {batch_lines!r}")
        if parse is not None and parse_batch is not None:
            raise ValueError(f"{name}(): give parse or parse_batch, not both")
        if parse_batch is not None and batch_lines is None:
            raise ValueError(f"{name}(): parse_batch needs batch_lines")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"{name}(): on_error must be 'raise' or 'skip', got {on_error!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"{name}(): world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"{name}(): rank must be in [0, {world_size}), got {rank!r}")
        if remote_latency_s < 0:
            raise ValueError(f"{name}(): remote_latency_s must be >= 0, got {remote_latency_s}")
        self._paths = _expand(paths, name)
        self.chunk_bytes = chunk_bytes
        self.parse = parse
        self.parse_batch = parse_batch
        self.batch_lines = batch_lines
        self.on_error = on_error
        self.on_skip = on_skip
        self.rank = rank
        self.world_size = world_size
        self.shuffle_units = shuffle_units
        self.seed = seed
        self.remote_latency_s = remote_latency_s
        self.read_block_bytes = read_block_bytes
        self._warnings = 0  # per copy of the source: each worker process warns on its own

    @property
    def paths(self) -> tuple[str, ...]:
        """The files read, after glob expansion, in reading order."""
        return self._paths

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self._paths)} files, chunk_bytes={self.chunk_bytes}, "
            f"batch_lines={self.batch_lines}, rank={self.rank}/{self.world_size})"
        )

    def units(self, epoch: int = 0) -> list[FileRange]:
        """Returns this rank's units for ``epoch``, in a deterministic order.

        Empty files yield no unit. Unit ids number the unsharded, unshuffled list.
        """
        units: list[FileRange] = []
        for path in self._paths:
            size = os.path.getsize(path)
            if size == 0:
                continue
            if path.endswith(".gz"):
                units.append(FileRange(len(units), path, 0, size, 1))
                continue
            for start in range(0, size, self.chunk_bytes):
                end = min(start + self.chunk_bytes, size)
                units.append(FileRange(len(units), path, start, end, 1 if start == 0 else None))
        if self.shuffle_units:
            random.Random(f"{self.seed}:{epoch}").shuffle(units)
        return units[self.rank :: self.world_size]

    def read(self, unit: FileRange) -> Generator[Any, None, UnitStats]:
        """Yields the parsed lines (or batches) of ``unit``; returns its :class:`UnitStats`.

        Raises:
            SourceError: a line cannot be parsed and ``on_error="raise"``; the message names
                the file and 1-based line number, the parser's exception is the cause.
        """
        if self.remote_latency_s:
            time.sleep(self.remote_latency_s)  # emulated I/O latency, not a wait on an event
        ctx = _UnitContext(self, unit)
        opener = gzip.open if unit.compressed else open
        with opener(unit.path, "rb") as f:
            blocks = _LineBlocks(f, unit.start, math.inf if unit.compressed else unit.end)
            pending: list[bytes] = []
            for lines in blocks.iter(self.read_block_bytes):
                ctx.line_start = blocks.line_start
                if self.batch_lines is None:
                    yield from ctx.parse_lines(lines, ctx.lines)
                    ctx.lines += len(lines)
                    continue
                if pending:
                    pending.extend(lines)
                else:
                    pending = lines
                n = self.batch_lines
                while len(pending) >= n:
                    batch, pending = pending[:n], pending[n:]
                    yield from ctx.parse_chunk(batch)
            if pending:
                yield from ctx.parse_chunk(pending)
            return UnitStats(unit.id, ctx.lines, ctx.skipped, blocks.consumed)

    def _warn(self, skipped: SkippedLine) -> None:
        self._warnings += 1
        if self._warnings <= _MAX_WARNINGS:
            tail = (
                " (further skipped lines are not logged)" if self._warnings == _MAX_WARNINGS else ""
            )
            _logger.warning("skipped %s:%d: %s%s", skipped.path, skipped.line, skipped.error, tail)


class _UnitContext:
    """Per-``read`` state: line counting and malformed-line handling for one unit."""

    def __init__(self, source: LineFileSource, unit: FileRange):
        self.source = source
        self.unit = unit
        self.lines = 0  # lines of the unit handed to a parser so far
        self.skipped = 0
        self.line_start = unit.start  # byte offset of the unit's first line, once aligned
        self._first_line = unit.first_line

    def parse_lines(self, lines: list[bytes], index0: int) -> Iterable[Any]:
        """Parses lines one by one (the lines start at unit line index ``index0``)."""
        parse = self.source.parse or _decode
        for i, line in enumerate(lines):
            try:
                item = parse(line)
            except Exception as exc:  # any parser failure becomes a SourceError or a skip
                self.bad_line(index0 + i, f"{type(exc).__name__}: {exc}", exc)
                continue
            yield item

    def parse_chunk(self, batch: list[bytes]) -> Iterable[Any]:
        """Parses one batch of lines into one item (or nothing, if every line is bad)."""
        index0 = self.lines
        self.lines += len(batch)
        if self.source.parse_batch is None:
            items = list(self.parse_lines(batch, index0))
            if items:
                yield items
            return
        parse_batch = self.source.parse_batch
        keep, where = batch, range(len(batch))  # lines still in play and their batch index
        while keep:
            try:
                item = parse_batch(keep)
            except BadLinesError as exc:
                reasons, cause = exc.reasons, exc
            except Exception as exc:  # locate the culprit lines by parsing them one at a time
                reasons, cause = _find_bad_lines(parse_batch, keep), exc
            else:
                yield item
                return
            reasons = {i: why for i, why in reasons.items() if 0 <= i < len(keep)}
            if not reasons:  # no single line is to blame: report the whole batch
                why = f"{type(cause).__name__}: {cause}"
                msg = f"batch parser failed on the {len(keep)} lines from here on: {why}"
                raise self.error(index0 + where[0], msg) from cause
            for i, why in reasons.items():
                self.bad_line(index0 + where[i], why, cause)
            kept = [i for i in range(len(keep)) if i not in reasons]
            keep, where = [keep[i] for i in kept], [where[i] for i in kept]

    def bad_line(self, index: int, why: str, cause: BaseException) -> None:
        """Raises for the bad line at unit line ``index``, or counts and reports it."""
        if self.source.on_error == "raise":
            raise self.error(index, why) from cause
        self.skipped += 1
        skipped = SkippedLine(self.unit.path, self.line_number(index), why)
        self.source._warn(skipped)
        if self.source.on_skip is not None:
            self.source.on_skip(skipped)

    def error(self, index: int, why: str) -> SourceError:
        line = self.line_number(index)
        return SourceError(f"{self.unit.path}:{line}: {why}", path=self.unit.path, line=line)

    def line_number(self, index: int) -> int:
        """1-based file line number of the unit's line ``index``; counts newlines on first use."""
        if self._first_line is None:
            self._first_line = _count_newlines(self.unit.path, self.line_start) + 1
        return self._first_line + index


class _LineBlocks:
    """Iterates, in blocks, the lines of an open binary file that start in ``[start, end)``.

    A range that does not begin at offset 0 first skips through the newline at or after
    ``start - 1``: the line cut by ``start`` belongs to the previous range, which reads past
    its own ``end`` to finish it.
    """

    def __init__(self, f: BinaryIO, start: int, end: float):
        self._f = f
        self._start = start
        self._end = end
        self.line_start = start  # offset of the first line that belongs to the range
        self.consumed = 0

    def iter(self, block_bytes: int) -> Iterable[list[bytes]]:
        f, end = self._f, self._end
        pos = 0
        if self._start > 0:
            f.seek(self._start - 1)
            pos = self._start - 1 + len(f.readline())
        self.line_start = pos
        carry, carry_at = b"", pos  # an unfinished line and the offset where it starts
        while carry or carry_at < end:
            block = f.read(block_bytes)
            self.consumed += len(block)
            if not block:
                if carry:  # last line of a file without a final newline
                    yield [carry[:-1] if carry.endswith(b"\r") else carry]
                return
            buf = carry + block if carry else block
            lines = buf.split(b"\n")
            carry = lines.pop()
            next_at = carry_at + len(buf) - len(carry)
            done = next_at >= end
            if done and next_at > end:
                # Keep the lines that start before `end`: line 0 and one per earlier newline.
                keep = buf.count(b"\n", 0, int(end - carry_at) - 1) + 1
                del lines[keep:]
            if b"\r" in buf:
                lines = [ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]
            if lines:
                yield lines
            if done:
                return
            carry_at = next_at


def _find_bad_lines(parse_batch: Callable[[list[bytes]], Any], batch: list[bytes]) -> dict:
    reasons = {}
    for i, line in enumerate(batch):
        try:
            parse_batch([line])
        except BadLinesError as exc:
            reasons[i] = next(iter(exc.reasons.values()))
        except Exception as exc:
            reasons[i] = f"{type(exc).__name__}: {exc}"
    return reasons


def _decode(line: bytes) -> str:
    return line.decode()


def _count_newlines(path: str, stop: int) -> int:
    """Counts ``\\n`` bytes in ``path[:stop]`` (only on the error path, never per line)."""
    count = 0
    with open(path, "rb") as f:
        while stop > 0:
            block = f.read(min(stop, 4 * _MiB))
            if not block:
                break
            count += block.count(b"\n")
            stop -= len(block)
    return count


def _expand(paths: str | os.PathLike | Sequence[str | os.PathLike], owner: str) -> tuple[str, ...]:
    patterns = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not patterns:
        raise ValueError(f"{owner}(): paths is empty")
    files: list[str] = []
    for pattern in map(os.fspath, patterns):
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"{owner}(): pattern {pattern!r} matches no file")
            files.extend(matches)
        elif os.path.isfile(pattern):
            files.append(pattern)
        else:
            raise FileNotFoundError(f"{owner}(): no such file: {pattern!r}")
    return tuple(files)


# ------------------------------------------------------------------------------------------
# The Source protocol and adapters for torch datasets, torchdata nodes and datapipes.
# ------------------------------------------------------------------------------------------


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
                yield k, [ds[i] for i in entry]


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
    for k, item in enumerate(source.read(unit)):
        if k not in skip:
            yield k, item


def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
