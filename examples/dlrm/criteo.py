"""Criteo click logs for DLRM: a fast chunk parser, the file source, and the feature UDFs.

Raw layout (Kaggle ``train.txt``, 1TB ``day_N``, plain or gzip): one row per line, tab
separated: the label (0/1), 13 integer features I1..I13 (counts; may be negative), 26
categorical features C1..C26 as 32-bit ids in hex. An empty field is a missing value, and a
row may have its trailing empty fields stripped (fewer than 40 fields). The label-less 39-field
Kaggle ``test.txt`` is not this layout and is rejected.

Parsed representation (:class:`CriteoChunk`): ``labels`` int64 [n]; ``dense`` int64 [n, 13]
with missing -> 0 and negatives kept; ``sparse`` int64 [n, 26] with missing ->
:data:`MISSING_ID` (-1). The UDFs then follow Meta's reference DLRM preprocessing, not
TorchRec's: ``log_dense`` clips negatives to 0 and takes ``log(x + 1)`` (TorchRec's npy
preprocessing instead shifts by the file-wide minimum: ``log(x - min + 2)``), and ``hash_ids``
maps ids into table rows by modulo, keeping row 0 for missing values.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from torchtune_pipe.errors import BadLinesError
from torchtune_pipe.sources.base import LineFileSource

if TYPE_CHECKING:
    from torchrec.datasets.utils import Batch

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
MISSING_ID = -1
"""Value of a missing categorical id in a parsed chunk (real ids are unsigned 32-bit)."""
MISSING_ROW = 0
"""Embedding row that :func:`hash_ids` reserves for missing ids."""
SPARSE_KEYS = tuple(f"cat_{i}" for i in range(NUM_SPARSE))
"""KeyedJaggedTensor keys, as in ``torchrec.datasets.criteo.DEFAULT_CAT_NAMES``."""

# Per-feature cardinalities of Criteo Kaggle after categorification, as used by the MLPerf
# inference DLRM reference (mlcommons/inference recommendation/dlrm/pytorch/python/main.py).
KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
DEFAULT_TABLE_CAP = 100_000


def default_table_sizes(cap: int = DEFAULT_TABLE_CAP) -> tuple[int, ...]:
    """Embedding rows per feature: ``min(cardinality, cap)`` plus the reserved missing row."""
    if cap < 1:
        raise ValueError(f"default_table_sizes(): cap must be >= 1, got {cap}")
    return tuple(min(card, cap) + 1 for card in KAGGLE_CARDINALITIES)


DEFAULT_TABLE_SIZES = default_table_sizes()

# Byte -> digit value lookup tables; 255 marks a byte that is not a digit.
_HEX = np.full(256, 255, np.uint8)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
_DEC = np.where(_HEX < 10, _HEX, 255).astype(np.uint8)
_MINUS = np.uint64(0x80)
_DEC[ord("-")] = 0x80  # the sign is told apart from digits and junk by its own value
_TAB, _NEWLINE, _CR = 9, 10, 13
_PLACEHOLDER_ROW = b"0" + b"\t" * (NUM_FIELDS - 1)  # parses cleanly; its row is reported bad
_MAX_DEC_DIGITS = 18  # int64 holds every 18-digit number
_HEX_DIGITS = b"0123456789abcdefABCDEF"


@dataclass(frozen=True, eq=False)
class CriteoChunk:
    """A chunk of Criteo rows as column arrays (see the module docstring for the encodings).

    Attributes:
        labels: int64 [n], 0 or 1.
        dense: [n, 13]; int64 as parsed, float32 after :func:`log_dense`.
        sparse: int64 [n, 26]; raw ids (missing -1) as parsed, table rows after :func:`hash_ids`.
    """

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray | slice) -> CriteoChunk:
        """Returns the rows selected by ``index`` (an index array, mask or slice)."""
        return CriteoChunk(self.labels[index], self.dense[index], self.sparse[index])

    @staticmethod
    def concat(chunks: Sequence[CriteoChunk]) -> CriteoChunk:
        """Concatenates chunks row-wise."""
        if not chunks:
            raise ValueError("CriteoChunk.concat(): no chunks given")
        return CriteoChunk(
            np.concatenate([c.labels for c in chunks]),
            np.concatenate([c.dense for c in chunks]),
            np.concatenate([c.sparse for c in chunks]),
        )

    @staticmethod
    def from_rows(rows: Sequence[CriteoRow]) -> CriteoChunk:
        """Stacks rows from :func:`parse_row` into a chunk."""
        return CriteoChunk(
            np.array([r.label for r in rows], np.int64),
            np.array([r.dense for r in rows], np.int64).reshape(len(rows), NUM_DENSE),
            np.array([r.sparse for r in rows], np.int64).reshape(len(rows), NUM_SPARSE),
        )


@dataclass(frozen=True)
class CriteoRow:
    """One parsed row: ``label``, 13 ``dense`` ints (missing 0), 26 ``sparse`` ids (missing -1)."""

    label: int
    dense: tuple[int, ...]
    sparse: tuple[int, ...]


def parse_row(line: bytes) -> CriteoRow:
    """Parses one raw Criteo line (pure Python; :func:`parse_rows` is the fast path).

    Raises:
        ValueError: the row is malformed; the message says which field and why.
    """
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) > NUM_FIELDS:
        raise ValueError(f"{len(fields)} fields, expected at most {NUM_FIELDS}")
    fields += [b""] * (NUM_FIELDS - len(fields))
    if fields[0] not in (b"0", b"1"):
        raise ValueError(_label_reason(fields[0]))
    dense = []
    for j, f in enumerate(fields[1 : 1 + NUM_DENSE]):
        digits = f[1:] if f.startswith(b"-") else f
        if f and (not digits or digits.translate(None, b"0123456789") or len(digits) > 18):
            raise ValueError(_dense_reason(j, f))
        dense.append(int(f) if f else 0)
    sparse = []
    for j, f in enumerate(fields[1 + NUM_DENSE :]):
        if len(f) > 8 or f.translate(None, _HEX_DIGITS):
            raise ValueError(_sparse_reason(j, f))
        sparse.append(int(f, 16) if f else MISSING_ID)
    return CriteoRow(int(fields[0]), tuple(dense), tuple(sparse))


def parse_rows(lines: Sequence[bytes]) -> CriteoChunk:
    """Parses raw Criteo lines into a :class:`CriteoChunk` with vectorised numpy.

    Args:
        lines: rows without their newline (a trailing ``\\r`` is ignored), as
            ``LineFileSource`` passes them.

    Raises:
        BadLinesError: some rows are malformed (too many fields, a label other than 0/1, a
            non-integer count, an id that is not hex of at most 8 digits, an empty line); its
            ``reasons`` map each bad row's index to why. All bad rows are reported at once.
    """
    n = len(lines)
    if n == 0:
        return _empty_chunk()
    a = _frame(lines)
    if (a == _CR).any():
        lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
        a = _frame(lines)
    end = np.flatnonzero((a == _TAB) | (a == _NEWLINE))  # where each field ends
    row_last = np.flatnonzero(a[end] == _NEWLINE)
    if len(row_last) != n:
        raise ValueError(f"parse_rows(): {n} lines hold {len(row_last)} rows; split on newlines")
    nfields = np.diff(row_last, prepend=-1)
    too_long = nfields > NUM_FIELDS
    if (nfields != NUM_FIELDS).any():
        # Pad stripped rows with empty fields (and stand in for over-long ones) so that every
        # row has 40 fields; only these rows take a Python step.
        padded = list(lines)
        for i in np.flatnonzero(nfields != NUM_FIELDS):
            pad = NUM_FIELDS - int(nfields[i])
            padded[i] = lines[i] + b"\t" * pad if pad > 0 else _PLACEHOLDER_ROW
        a = _frame(padded)
        end = np.flatnonzero((a == _TAB) | (a == _NEWLINE))
    end = end.reshape(n, NUM_FIELDS)
    width = np.empty_like(end)
    width[:, 1:] = end[:, 1:] - end[:, :-1] - 1
    width[:, 0] = end[:, 0] - np.r_[_LEAD, end[:-1, -1] + 1]
    labels = a[end[:, 0] - 1].astype(np.int64) - ord("0")
    bad_label = (width[:, 0] != 1) | (labels < 0) | (labels > 1)
    win = np.lib.stride_tricks.sliding_window_view(a, _LEAD)
    dense_cols, sparse_cols = slice(1, 1 + NUM_DENSE), slice(1 + NUM_DENSE, NUM_FIELDS)
    dense, bad_dense = _parse_decimal(a, win, end[:, dense_cols], width[:, dense_cols])
    sparse, bad_sparse = _parse_hex(win, end[:, sparse_cols], width[:, sparse_cols])
    bad = too_long | bad_label | bad_dense.any(1) | bad_sparse.any(1)
    if bad.any():
        raise BadLinesError({int(i): _row_reason(lines[i]) for i in np.flatnonzero(bad)})
    return CriteoChunk(labels, dense, sparse)


# SWAR ("SIMD within a register") parsing: each field's last 8 bytes are loaded as one
# little-endian uint64 word whose byte k holds the k-th character of the window, mapped to its
# digit value by a lookup table; all digits of a field then combine in a few word operations.
_LEAD = 8  # zero bytes before the text, so every field has a full 8-byte window
_KEEP = np.array([((1 << 64) - 1) ^ ((1 << (8 * (8 - w))) - 1) for w in range(9)], np.uint64)
_LO8, _LO16 = np.uint64(0x00FF00FF00FF00FF), np.uint64(0x0000FFFF0000FFFF)
_LO32, _HIGH_NIBBLES = np.uint64(0xFFFFFFFF), np.uint64(0xF0F0F0F0F0F0F0F0)
_HIGH_BITS, _OVER_9 = np.uint64(0x8080808080808080), np.uint64(0x7676767676767676)
_U8, _U16, _U32 = np.uint64(8), np.uint64(16), np.uint64(32)


def _frame(lines: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"\0" * _LEAD + b"\n".join(lines) + b"\n", np.uint8)


def _words(win: np.ndarray, end: np.ndarray, width: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Loads each field's right-aligned 8-byte window as a word of digit values; 0 outside."""
    digits = np.take(table, win[end - _LEAD])  # (rows, fields, 8) uint8
    words = digits.view("<u8")[..., 0]
    return words & _KEEP[np.minimum(width, 8)]


def _parse_hex(win: np.ndarray, end: np.ndarray, width: np.ndarray):
    """Parses fields ending at ``end`` as hex ids of at most 8 digits (empty -> -1)."""
    v = _words(win, end, width, _HEX)
    bad = ((v & _HIGH_NIBBLES) != 0) | (width > 8)
    v = ((v & _LO8) << np.uint64(4)) | ((v >> _U8) & _LO8)  # 2 digits per 16-bit lane
    v = ((v & _LO16) << _U8) | ((v >> _U16) & _LO16)  # 4 digits per 32-bit lane
    v = ((v & _LO32) << _U16) | (v >> _U32)
    value = v.astype(np.int64)
    value[width == 0] = MISSING_ID
    return value, bad


def _parse_decimal(a: np.ndarray, win: np.ndarray, end: np.ndarray, width: np.ndarray):
    """Parses fields ending at ``end`` as optionally signed decimals (empty -> 0)."""
    if (width > 8).any():
        return _parse_long_decimal(a, end, width)
    v = _words(win, end, width, _DEC)
    first = np.uint64(8) * (8 - np.maximum(width, 1)).astype(np.uint64)  # shift of 1st char
    neg = (width > 0) & (((v >> first) & np.uint64(0xFF)) == _MINUS)
    v = np.where(neg, v & ~(np.uint64(0xFF) << first), v)
    bad = (((v + _OVER_9) | v) & _HIGH_BITS) != 0  # a byte above 9 is not a digit
    bad |= neg & (width == 1)
    v = (v & _LO8) * np.uint64(10) + ((v >> _U8) & _LO8)
    v = (v & _LO16) * np.uint64(100) + ((v >> _U16) & _LO16)
    v = (v & _LO32) * np.uint64(10000) + (v >> _U32)
    value = v.astype(np.int64)
    return np.where(neg, -value, value), bad


def _parse_long_decimal(a: np.ndarray, end: np.ndarray, width: np.ndarray):
    """Byte-by-byte fallback of :func:`_parse_decimal` for chunks with fields over 8 bytes."""
    w = int(min(width.max(), _MAX_DEC_DIGITS + 1))
    k = np.arange(w)
    lead = (w - width)[..., None]  # fields right-aligned in a window of w bytes
    c = a[np.maximum(end[..., None] - w + k, 0)]
    neg = ((c == ord("-")) & (k == lead)).any(-1) & (width > 0)
    digit = (k >= lead) & ~((k == lead) & neg[..., None])
    d = np.take(_DEC, c)
    ndigits = width - neg
    bad = (digit & (d > 9)).any(-1) | (neg & (ndigits == 0)) | (ndigits > _MAX_DEC_DIGITS)
    powers = 10 ** np.arange(w - 1, -1, -1, dtype=np.int64)
    value = np.where(digit, d, 0).astype(np.int64) @ powers
    return np.where(neg, -value, value), bad


def _row_reason(line: bytes) -> str:
    """Why a row is bad, from the pure-Python parser (only runs for bad rows)."""
    if not line.rstrip(b"\r\n"):
        return "empty line"
    try:
        parse_row(line)
    except ValueError as exc:
        return str(exc)
    return "malformed row"


def _label_reason(field: bytes) -> str:
    return f"label {field.decode(errors='replace')!r} is not 0 or 1"


def _dense_reason(j: int, field: bytes) -> str:
    return f"I{j + 1} {field.decode(errors='replace')!r} is not an integer"


def _sparse_reason(j: int, field: bytes) -> str:
    return f"C{j + 1} {field.decode(errors='replace')!r} is not a hex id of at most 8 digits"


def _empty_chunk() -> CriteoChunk:
    return CriteoChunk(
        np.zeros(0, np.int64),
        np.zeros((0, NUM_DENSE), np.int64),
        np.zeros((0, NUM_SPARSE), np.int64),
    )


class CriteoSource(LineFileSource):
    """Reads raw Criteo files (plain or ``.gz``) as :class:`CriteoChunk` items.

    Args:
        paths: files or glob patterns, e.g. ``"criteo/day_*.gz"``.
        chunk_rows: rows per chunk (the last chunk of a unit may be shorter).
        **kwargs: the other :class:`~torchtune_pipe.sources.base.LineFileSource` arguments
            (``chunk_bytes``, ``on_error``, ``on_skip``, ``rank``, ``world_size``, ...).

    Example:
        >>> src = CriteoSource("day_*.gz", chunk_rows=4096, on_error="skip")  # doctest: +SKIP
        >>> chunk = next(src.read(src.units()[0]))                           # doctest: +SKIP
    """

    def __init__(
        self, paths: str | os.PathLike | Sequence[str], *, chunk_rows: int = 8192, **kwargs: Any
    ):
        super().__init__(paths, parse_batch=parse_rows, batch_lines=chunk_rows, **kwargs)


def hash_ids(chunk: CriteoChunk, table_sizes: Sequence[int] = DEFAULT_TABLE_SIZES) -> CriteoChunk:
    """Maps ids to embedding rows: ``1 + id % (size - 1)``, missing ids to :data:`MISSING_ROW`."""
    sizes = np.asarray(table_sizes, np.int64)
    if sizes.shape != (NUM_SPARSE,) or (sizes < 2).any():
        raise ValueError(f"hash_ids(): table_sizes must be {NUM_SPARSE} ints >= 2, got {sizes}")
    ids = chunk.sparse
    rows = np.where(ids < 0, MISSING_ROW, 1 + ids % (sizes - 1))
    return replace(chunk, sparse=rows)


def log_dense(chunk: CriteoChunk) -> CriteoChunk:
    """``log(x + 1)`` of the counts as float32, negatives clipped to 0 (reference DLRM)."""
    return replace(chunk, dense=np.log1p(np.maximum(chunk.dense, 0), dtype=np.float32))


def add_noise(chunk: CriteoChunk, std: float, seed: int = 0) -> CriteoChunk:
    """Adds Gaussian noise of ``std`` to the dense features (as float32), as augmentation.

    The noise is seeded by ``seed`` and the chunk's content, so a chunk gets the same noise
    whichever worker transforms it.
    """
    dense = chunk.dense.astype(np.float32, copy=False)
    rng = np.random.default_rng([seed, zlib.crc32(chunk.sparse.tobytes())])
    noise = rng.standard_normal(dense.shape, dtype=np.float32) * np.float32(std)
    return replace(chunk, dense=dense + noise)


@dataclass(frozen=True)
class HashIds:
    """Picklable stage function form of :func:`hash_ids`."""

    table_sizes: tuple[int, ...] = DEFAULT_TABLE_SIZES

    def __call__(self, chunk: CriteoChunk) -> CriteoChunk:
        return hash_ids(chunk, self.table_sizes)


@dataclass(frozen=True)
class AddNoise:
    """Picklable stage function form of :func:`add_noise`."""

    std: float = 0.01
    seed: int = 0

    def __call__(self, chunk: CriteoChunk) -> CriteoChunk:
        return add_noise(chunk, self.std, self.seed)


@dataclass(frozen=True)
class ExtraCost:
    """Burns ``cpu_ns_per_row`` nanoseconds of CPU per row, emulating a heavier transform.

    The work is real numpy arithmetic measured on this thread's CPU clock, so it slows down
    under CPU contention the way a real transform does (a sleep would not). Returns the chunk
    unchanged.
    """

    cpu_ns_per_row: int = 0

    def __post_init__(self):
        if self.cpu_ns_per_row < 0:
            raise ValueError(f"ExtraCost(): cpu_ns_per_row must be >= 0, got {self.cpu_ns_per_row}")

    def __call__(self, chunk: CriteoChunk) -> CriteoChunk:
        deadline = time.thread_time_ns() + len(chunk) * self.cpu_ns_per_row
        x = np.linspace(1.0, 2.0, 256)
        while time.thread_time_ns() < deadline:
            np.sqrt(x, out=x)
            x += 1.0
        return chunk


def shuffle_rows(chunk: CriteoChunk, seed: int) -> CriteoChunk:
    """Returns the chunk's rows in a random order drawn from ``seed``."""
    return chunk.take(np.random.default_rng(seed).permutation(len(chunk)))


def rebatch(
    chunks: Iterator[CriteoChunk], batch_size: int, drop_last: bool = False
) -> Iterator[CriteoChunk]:
    """Regroups a stream of chunks into chunks of exactly ``batch_size`` rows (last may be short)."""
    if batch_size <= 0:
        raise ValueError(f"rebatch(): batch_size must be positive, got {batch_size}")
    pending: list[CriteoChunk] = []
    held = 0
    for chunk in chunks:
        pending.append(chunk)
        held += len(chunk)
        if held < batch_size:
            continue
        merged = CriteoChunk.concat(pending)
        cut = held - held % batch_size
        for i in range(0, cut, batch_size):
            yield merged.take(slice(i, i + batch_size))
        pending, held = [merged.take(slice(cut, None))], held - cut
    if held and not drop_last:
        yield CriteoChunk.concat(pending)


def to_torchrec_batch(rows: CriteoChunk | Sequence[CriteoChunk | CriteoRow]) -> Batch:
    """Builds a ``torchrec.datasets.utils.Batch`` with one id per feature per row.

    ``dense_features`` float32 [B, 13], ``labels`` float32 [B], and ``sparse_features`` a
    KeyedJaggedTensor with keys ``cat_0..cat_25`` in key-major order, its per-key caches
    precomputed as TorchRec's in-memory Criteo pipe does. Run :func:`log_dense` and
    :func:`hash_ids` first; missing ids still present map to :data:`MISSING_ROW`.
    """
    import torch  # imported here: parsing workers should not pay for torch/torchrec imports
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not isinstance(rows, CriteoChunk):
        rows = list(rows)
        if rows and isinstance(rows[0], CriteoRow):
            rows = CriteoChunk.from_rows(rows)
        else:
            rows = CriteoChunk.concat(rows)
    b = len(rows)
    ids = np.where(rows.sparse < 0, MISSING_ROW, rows.sparse).astype(np.int64)
    sparse = KeyedJaggedTensor(
        keys=list(SPARSE_KEYS),
        values=torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),
        lengths=torch.ones(NUM_SPARSE * b, dtype=torch.int32),
        offsets=torch.arange(NUM_SPARSE * b + 1, dtype=torch.int32),
        stride=b,
        length_per_key=[b] * NUM_SPARSE,
        offset_per_key=[b * i for i in range(NUM_SPARSE + 1)],
        index_per_key={key: i for i, key in enumerate(SPARSE_KEYS)},
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(rows.dense, dtype=np.float32)),
        sparse_features=sparse,
        labels=torch.from_numpy(rows.labels.astype(np.float32)),
    )
