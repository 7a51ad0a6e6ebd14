"""Line files as a source: TSV, CSV and JSON-lines text read in parallel, resumably.

:class:`LineFileSource` cuts plain files into byte ranges of about ``chunk_bytes`` each (a
unit holds the lines that *start* in its range), and reads a gzip file as one unit. A
malformed line raises :class:`~torchtune_pipe.errors.SourceError` naming file and line, or is
dropped, counted and reported (``on_error="skip"``: :class:`SkippedLine`, :class:`UnitStats`).
:mod:`torchtune_pipe.sources.base` re-exports these names with the other sources.
"""

from __future__ import annotations

import glob
import gzip
import logging
import math
import os
import random
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal, cast

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
            blocks = _LineBlocks(
                cast(BinaryIO, f), unit.start, math.inf if unit.compressed else unit.end
            )
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
        cause: Exception
        keep, where = batch, list(range(len(batch)))  # lines still in play, their batch index
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
    for pattern in (str(os.fspath(p)) for p in patterns):
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
