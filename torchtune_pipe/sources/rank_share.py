"""A rank's share of a map-style dataset under ``torch.distributed``, for the drop-in loader.

Lightning (``use_distributed_sampler``, on by default) and Accelerate shard torch's
``DataLoader`` for data-parallel training by building it again with a ``DistributedSampler``.
They do that only to instances of torch's class, which ``torchtune_pipe.DataLoader`` is not:
left as it is, every rank would read the whole dataset every epoch. So the drop-in gives itself
the sampler Lightning would (:func:`rank_sampler`): once a process group of more than one rank
is initialised, at its first ``len()``, ``iter()`` or state (saved or loaded), a loader whose
sampler is torch's default (``shuffle`` or not) reads through ``DistributedSampler(dataset,
shuffle=shuffle, seed=$PL_GLOBAL_SEED or 0)``, and any other sampler is wrapped so that each
rank reads every ``world``-th index it yields, in its order (:class:`SamplerShare`; Lightning's
``DistributedSamplerWrapper`` also shuffles them for a training loader, which this cannot tell
from another). Those set ``loader.sampler``; its ``set_epoch`` (Lightning calls it every epoch)
reshuffles. A batch sampler of the user's own is left as it is, with a warning:
it decides the batches, and no share of it is one Lightning makes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any


def process_group() -> tuple[int, int] | None:
    """``(rank, world size)`` of the initialised default process group; None where there is
    none, or it has one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return None if world <= 1 else (dist.get_rank(), world)


class SamplerShare:
    """Rank ``rank``'s share of what ``sampler`` yields each epoch (its indices taken as a
    dataset, sampled as ``DistributedSampler`` samples one: shuffled with ``seed`` and the
    epoch where ``shuffle``, padded to equal shares)."""

    def __init__(self, sampler: Any, num_replicas: int, rank: int, shuffle: bool, seed: int):
        from torch.utils.data import DistributedSampler

        self.sampler = sampler
        # Filled at each __iter__ (as Lightning's wrapper does): drawn here, a random sampler
        # would draw once more than torch's loader under Lightning does.
        self._indices: list = [None] * len(sampler)
        self._share = DistributedSampler(
            self._indices, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
        )

    def __iter__(self) -> Iterator[Any]:
        self._indices[:] = list(self.sampler)  # the sampler's order of this epoch
        return (self._indices[i] for i in self._share)

    def __len__(self) -> int:
        return len(self._share)

    def set_epoch(self, epoch: int) -> None:
        self._share.set_epoch(epoch)
        set_it = getattr(self.sampler, "set_epoch", None)
        if callable(set_it):
            set_it(epoch)


def rank_sampler(sampler: Any, dataset: Any, shuffle: bool, rank: int, world: int) -> Any:
    """The sampler of rank ``rank`` of ``world`` for a loader whose sampler is ``sampler``
    (``shuffle``: it was built from ``shuffle=True``): ``sampler`` itself where it is already
    a ``DistributedSampler``."""
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    if isinstance(sampler, DistributedSampler):
        return sampler
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    if type(sampler) in (RandomSampler, SequentialSampler):
        return DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed
        )
    return SamplerShare(sampler, world, rank, shuffle=False, seed=seed)


def take_rank_share(loader: Any) -> None:
    """Where a process group of several ranks is initialised, make the drop-in ``loader`` (a
    map-style one, not ``distributed=False``) read this rank's share: decided once, at its
    first ``len()``, ``iter()`` or state then; with ``distributed=None``, said in a warning.

    Raises:
        RuntimeError: ``distributed=True`` and no such process group is initialised.
    """
    from torch.utils.data import BatchSampler

    if loader._ranks_read or loader.distributed is False or loader.sampler is None:
        return
    group = process_group()
    if group is None:
        if loader.distributed:
            raise RuntimeError(
                "DataLoader(distributed=True): torch.distributed must be initialised "
                "(init_process_group, more than one rank) before len() or iter()"
            )
        return
    loader._ranks_read = True
    rank, world = group
    where = f"DataLoader (rank {rank} of {world})"
    if loader._own_batches:
        warnings.warn(
            f"{where}: every rank reads the whole dataset, as its batch_sampler yields it "
            "(torch's DataLoader does too): a batch sampler of your own decides the batches, "
            "give it each rank's share yourself", stacklevel=3,
        )  # fmt: skip
        return
    sampler = rank_sampler(loader.sampler, loader.dataset, loader._shuffle, rank, world)
    if sampler is loader.sampler:
        return  # already a DistributedSampler
    source = loader.source
    source.sampler = loader.sampler = sampler
    if source.batch_sampler is not None:
        source.batch_sampler = BatchSampler(sampler, loader.batch_size, loader.drop_last)
    loader.batch_sampler = source.batch_sampler
    if loader.distributed is None:
        warnings.warn(
            f"{where}: reads this rank's share of the dataset through "
            f"{type(sampler).__name__}, as Lightning and Accelerate make torch's DataLoader do "
            "under DDP; distributed=False reads all of it on every rank, as torch's DataLoader "
            "alone does (distributed=True: this, without this warning)", stacklevel=3,
        )  # fmt: skip


__all__ = ["SamplerShare", "process_group", "rank_sampler", "take_rank_share"]
