"""Sources, stage functions and pipeline recipes shared by the real-pipeline benchmarks.

Everything here lives at module level so worker processes can unpickle it by reference. Three
recipes stress different stages on a small machine:

- ``udf_heavy``: a cheap source and parse, then a CPU-burning per-item UDF (the bottleneck).
- ``remote_read``: a source that waits ``latency_s`` per unit, as a network filesystem does,
  then a moderate UDF; waiting uses no CPU, so more source workers than cores help.
- ``batch_heavy``: a cheap source and parse, then a batch stage whose collate is expensive
  (stacks large items and normalises the batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from torchtune_pipe import Pipeline
from torchtune_pipe.pipeline import MiB

# Stage worker bound for every recipe: keeps tuners from spawning dozens of processes on a
# two-core machine while leaving room for I/O oversubscription.
MAX_WORKERS = 6
# Outbound buffer per stage: small enough that buffers never matter for memory here.
BUFFER_BYTES = 16 * MiB


@dataclass(frozen=True)
class SyntheticSource:
    """An endless-enough source of float32 vectors, ``items_per_unit`` per work unit.

    Attributes:
        n_units: units per epoch (size it so an epoch outlasts the run).
        items_per_unit: items each unit yields.
        item_floats: float32 elements per item.
        latency_s: wall time waited (not computed) before each unit's first item, emulating a
            remote read.
    """

    n_units: int = 100_000
    items_per_unit: int = 16
    item_floats: int = 64
    latency_s: float = 0.0

    def units(self, epoch: int = 0) -> list[int]:
        """Unit ids of one epoch (the same every epoch)."""
        return list(range(self.n_units))

    def read(self, unit: int) -> Iterator[np.ndarray]:
        """The items of ``unit``, after the emulated read latency."""
        if self.latency_s > 0:
            time.sleep(self.latency_s)  # the emulated remote read: time passes, no CPU used
        base = np.arange(self.item_floats, dtype=np.float32)
        for k in range(self.items_per_unit):
            yield base + np.float32(unit * self.items_per_unit + k)

    def __len__(self) -> int:
        return self.n_units * self.items_per_unit


def parse(x: np.ndarray) -> np.ndarray:
    """A cheap per-item transform (scale and shift)."""
    return x * np.float32(0.5) + np.float32(1.0)


@dataclass(frozen=True)
class Burn:
    """A CPU-burning UDF: ``loops`` iterations of pure-Python arithmetic per item."""

    loops: int

    def __call__(self, x: np.ndarray) -> np.ndarray:
        acc = 0
        for i in range(self.loops):
            acc = (acc + i * i) % 1_000_003
        return x + np.float32(acc % 7)


@dataclass(frozen=True)
class HeavyCollate:
    """Collate that stacks the items, then normalises the batch ``rounds`` times."""

    rounds: int

    def __call__(self, items: list) -> np.ndarray:
        batch = np.stack(items)
        for _ in range(self.rounds):
            batch = (batch - batch.mean(axis=0)) / (batch.std(axis=0) + np.float32(1e-3))
        return batch


@dataclass(frozen=True)
class Recipe:
    """A benchmark pipeline: its name, stage names, and how to build it for an allocation.

    Attributes:
        name: recipe name.
        stages: stage names in pipeline order.
        build: ``build(workers) -> Pipeline`` with ``workers[i]`` workers on stage ``i``.
        items_per_delivery: samples per item the consumer receives (the batch size, or 1).
    """

    name: str
    stages: tuple[str, ...]
    build: Callable[[Sequence[int]], Pipeline]
    items_per_delivery: int = 1


def _common(w: int) -> dict:
    return dict(workers=w, max_workers=MAX_WORKERS, buffer_bytes=BUFFER_BYTES)


@dataclass(frozen=True)
class _UdfHeavy:
    loops: int

    def __call__(self, workers: Sequence[int]) -> Pipeline:
        src = SyntheticSource(items_per_unit=32)
        return (
            Pipeline.from_source(src, **_common(workers[0]))
            .map(parse, name="parse", **_common(workers[1]))
            .map(Burn(self.loops), name="udf", **_common(workers[2]))
        )


@dataclass(frozen=True)
class _RemoteRead:
    latency_s: float
    loops: int

    def __call__(self, workers: Sequence[int]) -> Pipeline:
        src = SyntheticSource(items_per_unit=8, latency_s=self.latency_s)
        return (
            Pipeline.from_source(src, **_common(workers[0]))
            .map(parse, name="parse", **_common(workers[1]))
            .map(Burn(self.loops), name="udf", **_common(workers[2]))
        )


@dataclass(frozen=True)
class _BatchHeavy:
    size: int
    item_floats: int
    rounds: int

    def __call__(self, workers: Sequence[int]) -> Pipeline:
        src = SyntheticSource(items_per_unit=64, item_floats=self.item_floats)
        return (
            Pipeline.from_source(src, **_common(workers[0]))
            .map(parse, name="parse", **_common(workers[1]))
            .batch(self.size, collate=HeavyCollate(self.rounds), **_common(workers[2]))
        )


def recipes(scale: float = 1.0) -> dict[str, Recipe]:
    """The three benchmark pipelines; ``scale`` multiplies the per-item work (quick runs < 1)."""
    loops = max(1, int(20_000 * scale))
    return {
        "udf_heavy": Recipe("udf_heavy", ("source", "parse", "udf"), _UdfHeavy(loops)),
        "remote_read": Recipe(
            "remote_read",
            ("source", "parse", "udf"),
            _RemoteRead(latency_s=0.04, loops=max(1, int(2_000 * scale))),
        ),
        "batch_heavy": Recipe(
            "batch_heavy",
            ("source", "parse", "batch"),
            _BatchHeavy(size=64, item_floats=4096, rounds=max(1, int(24 * scale))),
            items_per_delivery=64,
        ),
    }
