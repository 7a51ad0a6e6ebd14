"""Built-in stateful stages: batching and shuffling.

A reducer sees tagged items: ``push(tag, item)`` returns ``[(tags, out), ...]`` where ``tags``
lists the input tags folded into ``out``; the executor uses the tags to know which inputs are
fully consumed (and so what to re-deliver if the worker dies). ``flush()`` returns the same
shape at the end of the stream; ``drain()`` returns ``[(tag, item), ...]`` still held, so a
retiring worker can hand them to another.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Batcher:
    """Factory of batching reducers: groups ``size`` items and applies ``collate``.

    Use as a stateful stage function: ``StageSpec("batch", "stateful", Batcher(32))``.
    """

    size: int
    collate: Callable[[list], Any] | None = None
    drop_last: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"Batcher: size must be a positive int, got {self.size!r}")

    def __call__(self, epoch: int = 0, worker: int = 0) -> _BatchState:
        return _BatchState(self)


class _BatchState:
    def __init__(self, spec: Batcher):
        self.spec = spec
        self.tags: list = []
        self.items: list = []

    def _out(self) -> tuple[list, Any]:
        tags, items = self.tags, self.items
        self.tags, self.items = [], []
        return tags, (self.spec.collate(items) if self.spec.collate is not None else items)

    def push(self, tag, item) -> list:
        self.tags.append(tag)
        self.items.append(item)
        if len(self.items) >= self.spec.size:
            return [self._out()]
        return []

    def flush(self) -> list:
        if not self.items:
            return []
        if self.spec.drop_last:
            tags = self.tags
            self.tags, self.items = [], []
            return [(tags, _DROPPED)]
        return [self._out()]

    def drain(self) -> list:
        out = list(zip(self.tags, self.items, strict=True))
        self.tags, self.items = [], []
        return out


class _Dropped:
    """Marks items consumed without output (e.g. an incomplete last batch with drop_last)."""

    def __repr__(self) -> str:
        return "DROPPED"


_DROPPED = _Dropped()
DROPPED = _DROPPED


@dataclass(frozen=True)
class Shuffler:
    """Factory of shuffle-buffer reducers (tf.data-style): keep ``buffer`` items, emit a
    random one for each new item. Seeded by ``seed``, the epoch and the worker index."""

    buffer: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, int) or isinstance(self.buffer, bool) or self.buffer < 1:
            raise ValueError(f"Shuffler: buffer must be a positive int, got {self.buffer!r}")

    def __call__(self, epoch: int = 0, worker: int = 0) -> _ShuffleState:
        return _ShuffleState(self.buffer, random.Random(hash((self.seed, epoch, worker))))


class _ShuffleState:
    def __init__(self, size: int, rng: random.Random):
        self.size = size
        self.rng = rng
        self.buf: list = []

    def push(self, tag, item) -> list:
        self.buf.append((tag, item))
        if len(self.buf) > self.size:
            j = self.rng.randrange(len(self.buf))
            self.buf[j], self.buf[-1] = self.buf[-1], self.buf[j]
            t, x = self.buf.pop()
            return [([t], x)]
        return []

    def flush(self) -> list:
        self.rng.shuffle(self.buf)
        out = [([t], x) for t, x in self.buf]
        self.buf = []
        return out

    def drain(self) -> list:
        out, self.buf = self.buf, []
        return out
