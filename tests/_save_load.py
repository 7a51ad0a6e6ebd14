"""One save/load check that every source passes (as torchdata's ``run_test_save_load_state``).

:func:`check_save_load` runs a loader uninterrupted for a few epochs, then, for each of
several points (before the first item, the first item, mid-epoch, the last items, the epoch
boundary before and after the end marker, inside the next epoch), runs it again to that
point, takes ``state_dict()``, pickles it (as a checkpoint would), loads it into a fresh
loader with another worker count (0, 1 and 2 workers, saving and loading, in every pairing)
and reads on to the same last epoch. What the two runs delivered together must be the
uninterrupted run, item for item: nothing lost, nothing twice, in the same order.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

# (save workers, load workers): each count on both sides, and every change between them.
WORKER_PAIRS = ((0, 2), (2, 1), (1, 0), (0, 1), (1, 2), (2, 0), (2, 2), (0, 0), (1, 1))


def plain(x: Any) -> Any:
    """``x`` as plain Python values that compare with ``==`` (tensors, arrays, containers,
    dataclasses)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return ("array", str(x.dtype), tuple(x.shape), x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, plain(dataclasses.asdict(x)))
    return x


@dataclasses.dataclass(frozen=True)
class Point:
    """Where the interrupted run stops: ``taken`` items into ``epoch``; ``to_end`` reads the
    epoch to its end marker first; ``before_iter`` saves before ``iter()`` is called."""

    epoch: int
    taken: int
    to_end: bool = False
    before_iter: bool = False

    def __str__(self) -> str:
        if self.before_iter:
            return f"before iter() of epoch {self.epoch}"
        if self.to_end:
            return f"after the end of epoch {self.epoch}"
        return f"{self.taken} items into epoch {self.epoch}"


def points(lengths: list[int]) -> list[Point]:
    """The stopping points for epochs of these lengths (at least two epochs)."""
    n0, n1 = lengths[0], lengths[1]
    return [
        Point(0, 0, before_iter=True),
        Point(0, 0),
        Point(0, 1),
        Point(0, n0 // 2),
        Point(0, n0 - 1),
        Point(0, n0),  # every item taken, the end marker not read yet
        Point(0, n0, to_end=True),
        Point(1, 1),
        Point(1, n1 // 2),
    ]


def _epoch(loader: Any, key: Callable[[Any], Any]) -> list:
    return [key(x) for x in loader]


def _run_to(loader: Any, point: Point, key: Callable[[Any], Any]) -> tuple[list, dict]:
    head: list = []
    for _ in range(point.epoch):
        head += _epoch(loader, key)
    if point.before_iter:
        return head, loader.state_dict()
    it = iter(loader)
    if point.to_end:
        head += [key(x) for x in it]
    else:
        head += [key(next(it)) for _ in range(point.taken)]
    state = loader.state_dict()
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return head, state


def check_save_load(
    make: Callable[[int], Any],
    *,
    epochs: int = 2,
    key: Callable[[Any], Any] = plain,
    pairs: Iterable[tuple[int, int]] = WORKER_PAIRS,
) -> None:
    """Assert that ``make(workers)``'s loaders resume exactly from any saved point.

    Args:
        make: a fresh loader (``Loader`` or ``DataLoader``, a context manager with
            ``state_dict``/``load_state_dict``) reading with ``workers`` workers, 0 meaning
            in the calling process; every call must build its source anew.
        epochs: epochs of the uninterrupted run (at least 2).
        key: what of an item to compare (default :func:`plain`).
        pairs: the (save, load) worker counts, used in turn by the points.
    """
    with make(0) as loader:
        ref = [_epoch(loader, key) for _ in range(epochs)]
    lengths = [len(e) for e in ref]
    assert min(lengths) >= 2, f"epochs too short to stop inside: {lengths}"
    full = [x for e in ref for x in e]
    pairs = list(pairs)
    for i, point in enumerate(points(lengths)):
        save_w, load_w = pairs[i % len(pairs)]
        with make(save_w) as loader:
            head, state = _run_to(loader, point, key)
        state = pickle.loads(pickle.dumps(state))
        left = epochs - point.epoch - (1 if point.to_end else 0)
        with make(load_w) as loader:
            loader.load_state_dict(state)
            rest = [x for _ in range(left) for x in _epoch(loader, key)]
        where = f"saved {point} with {save_w} workers, loaded with {load_w}"
        got = head + rest
        if got != full:
            j = next(j for j in range(len(full) + 1) if got[j : j + 1] != full[j : j + 1])
            raise AssertionError(
                f"{where}: {len(got)} items, expected {len(full)}; from item {j} on got "
                f"{got[j : j + 2]}, expected {full[j : j + 2]}"
            )
