"""Writes synthetic click logs in the raw Criteo layout, with Criteo-like statistics.

The rows mimic Criteo Kaggle: about 25.6% positives; categorical ids drawn from a bounded
power law (Zipf-like) over each feature's Kaggle cardinality and written as 8-digit hex
hashes; log-normal counts with Criteo-like medians and tails, ``-1`` in I2, and missing values
at Criteo-like rates (correlated within groups of features, as in the real logs); a share of
rows has its trailing empty fields stripped, as in some redistributed Criteo files.

Labels are drawn from a fixed logistic model of a few counts and per-id effects of a dozen
categorical features, so a model can learn them. That model and the id hashing are the same
for every seed ("one world"): files written with different seeds are train/test splits of the
same distribution. The seed only drives which rows are drawn.

Usage::

    python -m examples.dlrm.generate out/train.txt --rows 1000000 --seed 0
    python -m examples.dlrm.generate out/day --rows 200000 --shards 4 --gzip   # day_0.gz ...
"""

from __future__ import annotations

import argparse
import gzip as gzip_module
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from examples.dlrm.criteo import KAGGLE_CARDINALITIES, NUM_DENSE, NUM_SPARSE

_WORLD_SEED = 0x5EED_C217  # fixes id hashing and the label model across all seeds

# Count features: log-normal (mu, sigma) of log(1 + x), fitted to the medians and 90th
# percentiles of the real Kaggle sample rows in tests/data/criteo.
_DENSE_MU = np.array([0.69, 1.95, 2.08, 1.79, 7.89, 3.22, 1.61, 2.08, 3.74, 0.69, 0.69, 0.0, 1.70])
_DENSE_SIGMA = np.array(
    [1.62, 2.68, 1.4, 0.98, 2.0, 1.69, 1.81, 1.08, 1.45, 0.32, 1.18, 0.54, 1.19]
)
_I2_NEGATIVE = 0.095  # share of -1 in I2
_DENSE_MISSING = np.array(
    [0.45, 0, 0.21, 0.22, 0.026, 0.22, 0.04, 0.001, 0.04, 0.45, 0.04, 0.76, 0.22]
)
_SPARSE_MISSING = np.array(
    [0, 0, 0.034, 0.034, 0, 0.12, 0, 0, 0, 0, 0, 0.034, 0, 0, 0, 0.034, 0, 0, 0.44, 0.44, 0.034, 0.76, 0, 0.034, 0.44, 0.44]
)  # fmt: skip
# Features that go missing together share one uniform draw per row (column indices 0..38:
# dense 0..12, then sparse 13..38).
_MISSING_GROUPS = ((0, 9), (3, 5, 12), (6, 8, 10), (15, 16, 24, 28, 33, 36), (31, 32, 37, 38))
_ZIPF_S = 1.15  # power-law exponent of id ranks

# Label model: weights on standardised log counts, and the spread of per-id effects.
_DENSE_WEIGHT = {0: 0.35, 6: 0.25, 10: 0.3, 4: -0.2}
_ID_EFFECT_STD = {
    0: 0.5,
    1: 0.6,
    5: 0.4,
    8: 0.3,
    10: 0.5,
    12: 0.6,
    13: 0.4,
    16: 0.4,
    19: 0.3,
    22: 0.4,
    24: 0.5,
}
_INTERCEPT = -1.85  # calibrated so that about 25.6% of rows are positive
_HEX_CHARS = np.frombuffer(b"0123456789abcdef", np.uint8)
_TAB, _NEWLINE = 9, 10


@dataclass(frozen=True)
class GenerateReport:
    """What :func:`generate` wrote: rows, positive labels, bytes on disk."""

    path: str
    rows: int
    positives: int
    bytes_written: int


def generate(
    path: str | os.PathLike,
    rows: int,
    seed: int = 0,
    gzip: bool = False,
    *,
    strip_prob: float = 0.25,
    block_rows: int = 65536,
) -> GenerateReport:
    """Writes ``rows`` synthetic Criteo rows to ``path`` (gzip level 1 if ``gzip``).

    Args:
        path: output file.
        rows: number of rows.
        seed: seed of the row draws; output is identical for equal (seed, block_rows).
        gzip: compress (the file is byte-identical across runs: the gzip mtime is 0).
        strip_prob: probability that a row ending in empty fields has them stripped.
        block_rows: rows drawn and formatted per numpy block.

    Returns:
        a :class:`GenerateReport`.
    """
    if rows < 0 or block_rows <= 0 or not 0 <= strip_prob <= 1:
        raise ValueError(
            f"generate(): need rows >= 0, block_rows > 0, 0 <= strip_prob <= 1; "
            f"got rows={rows}, block_rows={block_rows}, strip_prob={strip_prob}"
        )
    rng = np.random.default_rng(seed)
    world = _World()
    path = os.fspath(path)
    positives = 0
    with open(path, "wb") as raw:
        out = gzip_module.GzipFile("", "wb", 1, raw, mtime=0) if gzip else raw
        try:
            for done in range(0, rows, block_rows):
                n = min(block_rows, rows - done)
                labels, dense, dense_missing, ids, id_missing = world.draw(rng, n)
                positives += int(labels.sum())
                out.write(_format(rng, labels, dense, dense_missing, ids, id_missing, strip_prob))
        finally:
            if gzip:
                out.close()
    return GenerateReport(path, rows, positives, os.path.getsize(path))


class _World:
    """The fixed ground truth: id hashing per feature and the label model."""

    def __init__(self):
        rng = np.random.default_rng(_WORLD_SEED)
        self.cards = np.array(KAGGLE_CARDINALITIES, np.float64)
        self.mult = rng.integers(0, 2**31, NUM_SPARSE, dtype=np.uint64) * 2 + 1  # odd: bijective
        self.add = rng.integers(0, 2**32, NUM_SPARSE, dtype=np.uint64)
        self.effect_salt = rng.integers(0, 2**62, NUM_SPARSE, dtype=np.uint64)

    def draw(self, rng: np.random.Generator, n: int):
        # Counts: floor(exp(y) - 1) for y = mu + sigma z clipped at 0: a log-normal count >= 0.
        z = rng.standard_normal((n, NUM_DENSE))
        dense = np.floor(np.expm1(np.clip(_DENSE_MU + _DENSE_SIGMA * z, 0.0, 16.0))).astype(
            np.int64
        )
        dense[:, 1] = np.where(rng.random(n) < _I2_NEGATIVE, -1, dense[:, 1])
        # Id ranks: inverse CDF of a power law on [1, K + 1), so rank r has mass ~ (r + 1)^-s.
        u = rng.random((n, NUM_SPARSE))
        one_minus_s = 1.0 - _ZIPF_S
        x = (1.0 - u * (1.0 - (self.cards + 1.0) ** one_minus_s)) ** (1.0 / one_minus_s)
        ranks = np.minimum(np.floor(x) - 1.0, self.cards - 1).astype(np.uint64)
        ids = (ranks * self.mult + self.add) & np.uint64(0xFFFFFFFF)
        missing = self._missing(rng, n)
        dense_missing, id_missing = missing[:, :NUM_DENSE], missing[:, NUM_DENSE:]
        labels = self._labels(rng, dense, dense_missing, ranks, id_missing)
        return labels, dense, dense_missing, ids.astype(np.int64), id_missing

    def _missing(self, rng: np.random.Generator, n: int) -> np.ndarray:
        rates = np.concatenate([_DENSE_MISSING, _SPARSE_MISSING])
        u = rng.random((n, len(rates)))
        for group in _MISSING_GROUPS:
            u[:, group[1:]] = u[:, group[:1]]
        return u < rates

    def _labels(self, rng, dense, dense_missing, ranks, id_missing) -> np.ndarray:
        logit = np.full(len(dense), _INTERCEPT)
        for j, w in _DENSE_WEIGHT.items():
            v = np.log1p(np.maximum(dense[:, j], 0))
            std = (v - _DENSE_MU[j]) / _DENSE_SIGMA[j]
            logit += np.where(dense_missing[:, j], 0.0, w * std)
        for f, sd in _ID_EFFECT_STD.items():
            h = _mix64(ranks[:, f] ^ self.effect_salt[f])
            unit = (h >> np.uint64(11)).astype(np.float64) / 2.0**53  # uniform [0, 1)
            logit += np.where(id_missing[:, f], 0.0, sd * np.sqrt(12.0) * (unit - 0.5))
        return (rng.random(len(dense)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed, well-mixed hash of uint64 values."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _format(rng, labels, dense, dense_missing, ids, id_missing, strip_prob) -> bytes:
    """Renders a block of rows as TSV bytes without any per-row Python work.

    Each field is rendered into a fixed-width byte column padded with NUL bytes; the
    separators are columns of their own; dropping every NUL byte of the row-major matrix
    leaves the text.
    """
    n = len(labels)
    columns = [(48 + labels).astype(np.uint8)[:, None]]
    missing = np.concatenate([dense_missing, id_missing], axis=1)
    field_number = np.arange(1, NUM_DENSE + NUM_SPARSE + 1)  # the label is field 0
    last_present = np.max(np.where(missing, 0, field_number), axis=1)
    strip = (rng.random(n) < strip_prob) & (last_present < NUM_DENSE + NUM_SPARSE)
    for j in range(NUM_DENSE + NUM_SPARSE):
        # The separator in front of field j + 1 goes when the row is stripped after it.
        tab = np.where(strip & (j + 1 > last_present), 0, _TAB).astype(np.uint8)
        columns.append(tab[:, None])
        if j < NUM_DENSE:
            columns.append(_decimal_chars(dense[:, j], missing[:, j]))
        else:
            columns.append(_hex_chars(ids[:, j - NUM_DENSE], missing[:, j]))
    columns.append(np.full((n, 1), _NEWLINE, np.uint8))
    matrix = np.concatenate(columns, axis=1)
    return matrix[matrix != 0].tobytes()


def _decimal_chars(v: np.ndarray, missing: np.ndarray) -> np.ndarray:
    x = np.abs(v)
    ndigits = np.ones(len(v), np.int64)
    t = x // 10
    while t.any():
        ndigits += t > 0
        t //= 10
    width = int(ndigits.max(initial=1)) + 1  # one more column for a minus sign
    out = np.zeros((len(v), width), np.uint8)
    for k in range(width - 1):
        out[:, width - 1 - k] = np.where(k < ndigits, 48 + x % 10, 0)
        x = x // 10
    rows = np.flatnonzero(v < 0)
    out[rows, width - 1 - ndigits[rows]] = ord("-")
    out[missing] = 0
    return out


def _hex_chars(ids: np.ndarray, missing: np.ndarray) -> np.ndarray:
    shifts = np.arange(28, -1, -4, dtype=np.int64)
    out = _HEX_CHARS[(ids[:, None] >> shifts) & 15]
    out[missing] = 0
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description="Write synthetic Criteo-format click logs.")
    parser.add_argument("path", help="output file, or prefix with --shards (PATH_0, PATH_1, ...)")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per file")
    parser.add_argument("--seed", type=int, default=0, help="seed (shard i uses seed + i)")
    parser.add_argument("--gzip", action="store_true", help="gzip the output (adds .gz)")
    parser.add_argument("--shards", type=int, default=0, help="write this many files")
    parser.add_argument("--strip-prob", type=float, default=0.25)
    args = parser.parse_args(argv)
    suffix = ".gz" if args.gzip else ""
    targets = (
        [(f"{args.path}_{i}{suffix}", args.seed + i) for i in range(args.shards)]
        if args.shards
        else [(f"{args.path}{suffix}", args.seed)]
    )
    os.makedirs(os.path.dirname(os.path.abspath(targets[0][0])), exist_ok=True)
    for target, seed in targets:
        t0 = time.perf_counter()
        rep = generate(target, args.rows, seed, args.gzip, strip_prob=args.strip_prob)
        dt = time.perf_counter() - t0
        print(
            f"{rep.path}: {rep.rows} rows, {rep.positives / max(rep.rows, 1):.1%} positive, "
            f"{rep.bytes_written / 1e6:.1f} MB in {dt:.2f} s ({rep.rows / dt:,.0f} rows/s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
