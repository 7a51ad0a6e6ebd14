"""Functions that run inside worker processes during benchmarks (module level, so every
start method can import them by name)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset

# A DLRM-like Criteo batch: 13 dense features, 26 sparse ones.
DENSE_FEATURES = 13
SPARSE_FEATURES = 26
BATCH_ROWS = 8192
# Sparse ids per row over all 26 features: sized so one batch is exactly 2 MiB.
IDS_PER_ROW = 12


@functools.lru_cache(maxsize=4)
def _template(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    n_ids = rows * IDS_PER_ROW
    lengths = torch.zeros(SPARSE_FEATURES * rows, dtype=torch.int32)
    lengths.index_add_(
        0,
        torch.randint(0, SPARSE_FEATURES * rows, (n_ids,), generator=g),
        torch.ones(n_ids, dtype=torch.int32),
    )
    return {
        "dense": torch.randn(rows, DENSE_FEATURES, generator=g),
        "sparse_values": torch.randint(0, 1 << 40, (n_ids,), generator=g),
        "sparse_lengths": lengths,
        "labels": (torch.rand(rows, generator=g) > 0.97).float(),
    }


def dlrm_batch(rows: int = BATCH_ROWS) -> dict[str, torch.Tensor]:
    """A fresh DLRM-like batch (new memory each call, as a real pipeline makes): dense float32
    [rows, 13], sparse int64 values, int32 lengths [26 * rows], float32 labels [rows]."""
    return {k: v.clone() for k, v in _template(rows).items()}


def batch_nbytes(rows: int = BATCH_ROWS) -> int:
    """Payload bytes of one :func:`dlrm_batch` (2 MiB at 8192 rows)."""
    return sum(t.numel() * t.element_size() for t in _template(rows).values())


def dlrm_batches(unit: tuple[int, int]) -> Iterator[dict[str, torch.Tensor]]:
    """Source stage: a unit ``(n_batches, rows)`` yields that many fresh batches."""
    n, rows = unit
    for _ in range(n):
        yield dlrm_batch(rows)


def queue_producer(q, done, n_batches: int, rows: int) -> None:
    """Baseline producer: put ``n_batches`` fresh batches on a torch.multiprocessing Queue,
    then ``None``; stays alive until ``done`` is set (its shared tensors must outlive the
    consumer's unpickling under torch's file_descriptor sharing strategy)."""
    torch.set_num_threads(1)
    for _ in range(n_batches):
        q.put(dlrm_batch(rows))
    q.put(None)
    done.wait(60.0)


def identity(x):
    """A map stage that passes its item on (its executor worker still copies it once)."""
    return x


def int_range(unit: tuple[int, int]) -> Iterator[int]:
    """Source stage: the ints in ``[lo, hi)``."""
    lo, hi = unit
    yield from range(lo, hi)


def add_one(x: int) -> int:
    """A map stage with (almost) no work."""
    return x + 1


def add_two(x: int) -> int:
    """Both map stages of the tiny-item pipeline in one call (for single-stage baselines)."""
    return add_one(add_one(x))


class ChainDataset(Dataset):
    """Map-style dataset of ``n`` ints whose ``__getitem__`` runs the tiny pipeline's stages:
    what a DataLoader worker would do for the same three-stage chain."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return add_two(i)


def burn(cpu_s: float) -> None:
    """Spin until this thread has used ``cpu_s`` seconds of CPU (not wall) time."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def cpu_source(unit: tuple[int, int], cpu_s: float) -> Iterator[int]:
    """Source stage costing ``cpu_s`` CPU seconds per item."""
    lo, hi = unit
    for i in range(lo, hi):
        burn(cpu_s)
        yield i


def cpu_map(x: int, cpu_s: float) -> int:
    """Map stage costing ``cpu_s`` CPU seconds per item."""
    burn(cpu_s)
    return x
