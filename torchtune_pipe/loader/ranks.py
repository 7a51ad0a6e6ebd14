"""Keeping data-parallel ranks in step at the end of an epoch.

Sources shard work units by rank (``units[rank::world_size]``), and units do not hold equal
item counts (byte ranges of text files, a last short unit), so ranks reach the end of an
epoch at different steps. Under DDP a rank that still has a batch runs a backward pass whose
gradient all-reduce waits for ranks that have left the epoch: the job hangs. A
:class:`RankSync` ends every rank's epoch at the step where the first rank runs out: before
each item the ranks all-reduce (MIN) one integer, "I have an item". The ranks with items left
drop them (the Loader counts and logs them), as ``drop_last`` does for a sampler.

The integer travels on a gloo group: the default group when it is gloo, otherwise a gloo group
created once per process (NCCL would need a device tensor and a stream sync per batch).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_GLOO: dict[tuple[int, int], Any] = {}  # (id of the default group, world size) -> gloo group


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def active(setting: bool | None, source: Any) -> bool:
    """Whether ranks are kept in step: ``setting``, or (None) when ``source`` is sharded for the
    initialised process group's world size.

    Raises:
        RuntimeError: ``setting`` is True but no process group is initialised.
    """
    if setting is False:
        return False
    dist = _dist()
    if dist is None:
        if setting:
            raise RuntimeError(
                "Loader: even_ranks=True needs torch.distributed initialised "
                "(init_process_group) before iterating"
            )
        return False
    world = dist.get_world_size()
    if world == 1:
        return False
    return bool(setting) or getattr(source, "world_size", 1) == world


class RankSync:
    """One integer all-reduced per item across the default process group's ranks."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        self._flag = torch.zeros(1, dtype=torch.int32)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if "gloo" in str(dist.get_backend()).lower():
            self._group = None
        else:
            key = (id(dist.group.WORLD), self.world_size)
            if key not in _GLOO:
                _GLOO[key] = dist.new_group(backend="gloo")  # a collective: every rank calls it
            self._group = _GLOO[key]

    def all_have(self, has: bool) -> bool:
        """True when every rank has an item (every rank must call this the same number of
        times)."""
        self._flag.fill_(1 if has else 0)
        self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MIN, group=self._group)
        return bool(self._flag.item())

    def report_dropped(self, dropped: int, epoch: int) -> None:
        """Log that this rank dropped its last ``dropped`` items of ``epoch``."""
        log.warning(
            "Loader: rank %d of %d dropped the last %d item(s) of epoch %d: another rank ran "
            "out first (even_ranks keeps DDP ranks in step)",
            self.rank, self.world_size, dropped, epoch,
        )  # fmt: skip
