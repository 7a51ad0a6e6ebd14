"""What an epoch delivered, and the work left: the bookkeeping behind ``Loader.state_dict()``.

:class:`Progress` records which items reached the consumer by ``(unit, position in unit)``;
:func:`plan_epoch` turns a loaded state back into the units still to read, with the
delivered positions of the partial ones to skip. Neither depends on worker counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtune_pipe.errors import StateError
from torchtune_pipe.loader.tagging import Work
from torchtune_pipe.sources.base import load_units_state, units_state

# The layout of Loader.state_dict(); _state.check refuses other versions.
STATE_VERSION = 1


class Progress:
    """Which items of the epoch reached the consumer, by ``(unit, k)``."""

    def __init__(self, epoch: int, state: Mapping | None = None):
        self.epoch = epoch
        self.finished = False
        self.done: set[int] = set()
        self.seen: dict[int, set[int]] = {}
        self.totals: dict[int, int] = {}
        self.delivered = 0
        self.last_unit = -1
        if state is not None:
            self.done = set(state["done"])
            self.seen = {int(u): set(ks) for u, ks in state["partial"].items()}
            self.delivered = int(state["delivered"])
            self.last_unit = int(state["last_unit"])

    def took(self, u: int, k: Any) -> None:
        if u < 0:  # a batch: k holds its items' ids
            for uu, kk in k:
                self._one(uu, kk)
        else:
            self._one(u, k)
        self.delivered += 1

    def _one(self, u: int, k: int) -> None:
        self.seen.setdefault(u, set()).add(k)
        self.last_unit = u
        self._check(u)

    def end(self, u: int, n: int) -> None:
        self.totals[u] = n
        self._check(u)

    def _check(self, u: int) -> None:
        n = self.totals.get(u)
        if n is not None and len(self.seen.get(u, ())) >= n:
            self.done.add(u)
            self.seen.pop(u, None)
            del self.totals[u]

    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "finished": self.finished,
            "done": sorted(self.done),
            "partial": {u: sorted(ks) for u, ks in sorted(self.seen.items())},
            "delivered": self.delivered,
            "last_unit": self.last_unit,
        }


def plan_epoch(
    source: Any, epoch: int, state: Mapping | None
) -> tuple[int, Progress, list[Work], Any]:
    """The epoch to run, its bookkeeping, the work (minus what ``state`` says was delivered)
    and the source's units state to save with it.

    Raises:
        StateError: ``state`` names units the epoch does not have.
    """
    progress = Progress(epoch)
    if state is not None:
        epoch = int(state["epoch"]) + (1 if state["finished"] else 0)
        progress = Progress(epoch, None if state["finished"] else state)
        saved = state.get("units_state")
        load_units_state(source, saved)
        if state["finished"] and saved is not None:
            # The saved draws are the finished epoch's: replay them, so that this epoch's
            # draw goes on from where that one left the generators, as in a run never
            # interrupted (drawing from a fresh source's generators repeats an old order).
            source.units(int(state["epoch"]))
    units = source.units(epoch)
    for field, named in (("done", progress.done), ("partial", progress.seen)):
        bad = sorted(u for u in named if not 0 <= u < len(units))
        if bad:
            raise StateError(
                f"Loader: state[{field!r}] names units {bad[:5]} but epoch {epoch} has "
                f"{len(units)} units: the state was saved by another pipeline or source"
            )
    works = [
        Work(pos, u, frozenset(progress.seen.get(pos, ())))
        for pos, u in enumerate(units)
        if pos not in progress.done
    ]
    return epoch, progress, works, units_state(source)
