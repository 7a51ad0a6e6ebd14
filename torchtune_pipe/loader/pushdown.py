"""Batching moved into the source: a pipeline that reads a map-style dataset sample by sample,
maps each sample and then batches them runs as torch's DataLoader does, one item per batch.

``Pipeline.from_source(ds).map(f1)...map(fk).batch(n)`` sends every sample across a channel
into the batch stage, a hop of several microseconds per row, where torch's DataLoader fetches
a whole batch's indices in a worker, applies ``__getitem__`` and collates there. The
:class:`~torchtune_pipe.loader.core.Loader` runs such a pipeline rewritten (:func:`batched_at_source`):
the source reads the sampler's batches (the same ``BatchSampler`` over the same sampler and
generator, so the same batches in the same order, ``drop_last`` included), each map stage runs
its function over every sample of a batch, and the batch stage becomes a map stage that
collates. Every stage is then stateless, so the tuner can fuse the whole chain into the
source's workers and a batch crosses one channel, collated, as with torch.

The rewrite applies only when it delivers exactly the batches of the pipeline as written: an
unbatched :class:`~torchtune_pipe.sources.map_dataset.MapDatasetSource` of one rank without per-unit
seeds, then only local map stages that raise on errors (a skipped sample would shorten a
batch) and call one sample at a time (``max_concurrency=1``), then the batch stage. What
changes is what a stage's counters count (batches, not samples) and what a map stage's error
names: the batch, with the sample's position in it in a note. ``Loader(batch_at_source=False)``
runs the pipeline as written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torchtune_pipe.sources.map_dataset import MapDatasetSource
from torchtune_pipe.stages import PipelineLike


class EachSample:
    """A map stage's function over every sample of a batch (a list)."""

    def __init__(self, fn: Callable[[Any], Any], stage: str):
        self.fn = fn
        self.stage = stage

    def __call__(self, samples: list) -> list:
        fn, out = self.fn, []
        for j, x in enumerate(samples):
            try:
                out.append(fn(x))
            except Exception as e:
                e.add_note(
                    f"in sample {j} of {len(samples)} of the batch (stage {self.stage!r} runs "
                    "over whole batches: Loader(batch_at_source=False) runs it sample by sample)"
                )
                raise
        return out


class CollateBatch:
    """The batch stage as a map stage: ``collate`` of a batch's samples (None: the list)."""

    def __init__(self, collate: Callable[[list], Any] | None):
        self.collate = collate

    def __call__(self, samples: list) -> Any:
        return samples if self.collate is None else self.collate(samples)


def batched_at_source(pipe: PipelineLike) -> PipelineLike | None:
    """``pipe`` with its batching moved into its source (module docstring), or None when the
    rewrite would not deliver exactly the same batches."""
    src, stages = pipe.source, pipe.stages
    if (
        type(src) is not MapDatasetSource
        or src.batched
        or src.world_size != 1
        or src.seed_units
        or stages[0].on_error != "raise"
    ):
        return None
    k = 1
    while k < len(stages) and stages[k].kind == "map":
        st = stages[k]
        if st.on_error != "raise" or st.placement != "local" or st.max_concurrency > 1:
            return None
        k += 1
    if k == len(stages) or stages[k].kind != "batch":
        return None
    batch = stages[k]
    source = MapDatasetSource(
        src.dataset, batch_size=batch.size, sampler=src.sampler, drop_last=batch.drop_last,
        generator=src.generator, sampler_epoch=src.sampler_epoch,
    )  # fmt: skip
    maps = tuple(dataclasses.replace(st, fn=EachSample(st.fn, st.name)) for st in stages[1:k])
    collate = dataclasses.replace(
        batch, kind="map", fn=CollateBatch(batch.fn), size=0, drop_last=False
    )
    rewritten = (stages[0], *maps, collate, *stages[k + 1 :])
    return type(pipe)(source, rewritten, pipe.prefetch_spec)  # type: ignore[call-arg]
