"""The drop-in DataLoader's collate, as a stage of its own (:class:`Collate`) or fused into the
source that fetches the samples (:class:`Collated`: torch's arrangement)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torchtune_pipe.sources.base import (
    frame_items,
    left_early,
    load_units_state,
    max_readers,
    new_view,
    read_indexed,
    units_state,
)


class Collate:
    """The collate stage's function."""

    def __init__(self, collate: Callable[[Any], Any]):
        self.collate = collate

    def __call__(self, data: Any) -> Any:
        return self.collate(data)


class Collated:
    """A source whose items are collated where they are fetched (torch's arrangement: one
    stage of ``num_workers`` workers doing both)."""

    def __init__(self, source: Any, collate: Callable[[Any], Any]):
        self.source = source
        self.collate = collate

    def __len__(self) -> int:
        return len(self.source)

    def units(self, epoch: int = 0) -> list:
        return self.source.units(epoch)

    def fingerprint(self) -> str:
        """The wrapped source's: a state saved with the collate fused in loads without it."""
        from torchtune_pipe.loader.state import source_fingerprint

        return source_fingerprint(self.source)

    def units_state(self) -> Any:
        return units_state(self.source)

    @property
    def batched(self) -> bool:
        return bool(getattr(self.source, "batched", False))

    def may_run_on_threads(self) -> bool:
        probe = getattr(self.source, "may_run_on_threads", None)
        return True if probe is None else bool(probe())

    def max_readers(self) -> int | None:
        return max_readers(self.source)

    def frame_items(self) -> int | None:
        return frame_items(self.source)

    def load_units_state(self, state: Any) -> None:
        load_units_state(self.source, state)

    def left_early(self, delivered: int) -> None:
        left_early(self.source, delivered)

    def new_view(self) -> None:
        new_view(self.source)

    def read(self, unit: Any) -> Iterator[Any]:
        for _, x in self.read_from(unit, frozenset()):
            yield x

    def read_from(self, unit: Any, skip: frozenset) -> Iterator[tuple[int, Any]]:
        for k, data in read_indexed(self.source, unit, skip):
            yield k, self.collate(data)


__all__ = ["Collate", "Collated"]
