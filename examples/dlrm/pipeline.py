"""The DLRM input pipeline on Criteo files, as production DLRM jobs run it.

``read`` (parse raw rows into column chunks) -> ``shuffle`` (a buffer of chunks) ->
``features`` (hash ids into the per-table sizes, ``log(x + 1)`` of the counts) ->
``augment`` (Gaussian noise on the dense features; only with ``noise_std > 0``) ->
``extra_cost`` (burns CPU per row, to emulate heavier production transforms; only with
``extra_cost_ns_per_row > 0``) -> ``batch`` (chunks into one TorchRec ``Batch``) -> prefetch
(pinned memory, only when an accelerator is present).

Every stage is a pool of worker processes whose size a tuner moves while training runs.

Example:
    >>> config = DLRMPipelineConfig(batch_size=512, extra_cost_ns_per_row=2000)
    >>> loader = build_loader("data/day_*", config, tuner="intune")   # doctest: +SKIP
    >>> for batch in loader: ...                                       # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from examples.dlrm.criteo import (
    DEFAULT_TABLE_SIZES,
    NUM_SPARSE,
    AddNoise,
    CriteoChunk,
    CriteoSource,
    ExtraCost,
    hash_ids,
    log_dense,
    to_torchrec_batch,
)
from torchtune_pipe import Loader, Pipeline

# TorchRec is imported with this module, not on the first collate: the executor's fork server
# imports the modules of the stage functions (this one, for collate_batch) before it forks
# workers, so every batch worker, including those a tuner adds later, starts with TorchRec
# loaded instead of spending ~2 s of CPU importing it while the pipeline runs. Environments
# that only parse and hash rows (the tf.data benchmark's) have no TorchRec; collate_batch
# raises the ImportError there.
try:
    import torchrec.datasets.utils  # noqa: F401
    import torchrec.sparse.jagged_tensor  # noqa: F401
except ImportError:
    pass

MiB = 1 << 20


@dataclass(frozen=True)
class DLRMPipelineConfig:
    """Knobs of the DLRM input pipeline (the tuner moves workers and buffers, not these).

    Attributes:
        batch_size: rows per TorchRec ``Batch``; a multiple of ``chunk_rows``. The last batch
            of an epoch, and batches holding the short last chunk of a file range, are smaller.
        chunk_rows: rows per parsed chunk, the unit that is shuffled and transformed.
        chunk_bytes: bytes of raw file per work unit (a ``.gz`` file is always one unit).
        shuffle_chunks: size of the shuffle buffer, in chunks.
        table_sizes: embedding rows per categorical feature (26 values).
        noise_std: standard deviation of the dense-feature noise (0: no ``augment`` stage).
        extra_cost_ns_per_row: CPU nanoseconds burnt per row (0: no ``extra_cost`` stage).
        seed: seed of the shuffle, the unit order and the noise.
        prefetch_depth: batches held ready in the main process.
        pin_memory: pin batches for fast host-to-device copies (only when an accelerator is
            present).
        workers: initial workers per process stage.
        max_workers: upper bound of every stage's workers.
        buffer_bytes: initial outbound buffer budget of every stage.
        on_error: ``raise`` on a malformed row, or ``skip`` it (counted and logged).
        placement: where the feature stages (``features``, ``augment``, ``extra_cost``) run:
            ``local`` worker processes, ``ray`` actors on the Ray cluster this process is
            connected to (``ray.init(...)`` first; ``pip install torchtune-pipe[ray]``), or
            ``auto``: local workers the tuner may move onto that cluster and back
            (``Pipeline.map(placement="auto")``).
        ray_max_workers: with ``placement="ray"``, the most actors a feature stage may have
            (a tuner's resize beyond the cluster's room would wait for an actor that never
            starts); None: ``max_workers``.
    """

    batch_size: int = 512
    chunk_rows: int = 128
    chunk_bytes: int = 4 * MiB
    shuffle_chunks: int = 64
    table_sizes: tuple[int, ...] = DEFAULT_TABLE_SIZES
    noise_std: float = 0.0
    extra_cost_ns_per_row: int = 0
    seed: int = 0
    prefetch_depth: int = 2
    pin_memory: bool = True
    workers: int = 1
    max_workers: int = 32
    buffer_bytes: int = 16 * MiB
    on_error: str = "raise"
    placement: str = "local"
    ray_max_workers: int | None = None

    def __post_init__(self) -> None:
        if self.placement not in ("local", "ray", "auto"):
            raise ValueError(
                "DLRMPipelineConfig: placement must be 'local', 'ray' or 'auto', got "
                f"{self.placement!r}"
            )
        for name in ("batch_size", "chunk_rows", "chunk_bytes", "shuffle_chunks", "workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"DLRMPipelineConfig: {name} must be a positive int, got {value!r}"
                )
        if self.batch_size % self.chunk_rows:
            raise ValueError(
                f"DLRMPipelineConfig: batch_size ({self.batch_size}) must be a multiple of "
                f"chunk_rows ({self.chunk_rows})"
            )
        if len(self.table_sizes) != NUM_SPARSE or min(self.table_sizes) < 2:
            raise ValueError(
                f"DLRMPipelineConfig: table_sizes must be {NUM_SPARSE} ints >= 2, "
                f"got {len(self.table_sizes)} values"
            )
        if self.noise_std < 0 or self.extra_cost_ns_per_row < 0:
            raise ValueError(
                "DLRMPipelineConfig: noise_std and extra_cost_ns_per_row must be >= 0, got "
                f"{self.noise_std} and {self.extra_cost_ns_per_row}"
            )

    @property
    def chunks_per_batch(self) -> int:
        """Chunks the batch stage joins into one ``Batch``."""
        return self.batch_size // self.chunk_rows


@dataclass(frozen=True)
class Features:
    """The ``features`` stage: hash ids into table rows, then ``log(x + 1)`` of the counts."""

    table_sizes: tuple[int, ...] = DEFAULT_TABLE_SIZES

    def __call__(self, chunk: CriteoChunk) -> CriteoChunk:
        return log_dense(hash_ids(chunk, self.table_sizes))


def collate_batch(chunks: list[CriteoChunk]) -> Any:
    """The ``batch`` stage's collate: joins chunks into one ``torchrec.datasets.utils.Batch``."""
    return to_torchrec_batch(chunks[0] if len(chunks) == 1 else CriteoChunk.concat(chunks))


def build_pipeline(
    paths: str | os.PathLike | Sequence[str],
    config: DLRMPipelineConfig = DLRMPipelineConfig(),
    *,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
) -> Pipeline:
    """The DLRM pipeline over Criteo files, sharded by work unit for ``rank`` of ``world_size``.

    Args:
        paths: Criteo files or glob patterns (plain or ``.gz``).
        config: the pipeline's knobs.
        rank, world_size: this process's share of the units (data-parallel training).
        shuffle: shuffle chunks and unit order (off for evaluation).

    Raises:
        FileNotFoundError: a path matches no file.
        ValueError: a knob is invalid (the message names it).
    """
    source = CriteoSource(
        paths,
        chunk_rows=config.chunk_rows,
        chunk_bytes=config.chunk_bytes,
        on_error=config.on_error,
        rank=rank,
        world_size=world_size,
        shuffle_units=shuffle,
        seed=config.seed,
    )
    knobs = dict(
        workers=config.workers,
        max_workers=config.max_workers,
        buffer_bytes=config.buffer_bytes,
    )
    pipe = Pipeline.from_source(source, name="read", **knobs)
    if shuffle:
        pipe = pipe.shuffle(
            config.shuffle_chunks, seed=config.seed, buffer_bytes=config.buffer_bytes
        )
    feature_knobs: dict[str, Any] = dict(knobs)
    if config.placement == "ray":
        top = min(config.max_workers, config.ray_max_workers or config.max_workers)
        feature_knobs.update(placement="ray", max_workers=top, workers=min(config.workers, top))
    elif config.placement == "auto":
        feature_knobs.update(placement="auto")
    pipe = pipe.map(Features(tuple(config.table_sizes)), name="features", **feature_knobs)
    if config.noise_std > 0:
        pipe = pipe.map(AddNoise(config.noise_std, config.seed), name="augment", **feature_knobs)
    if config.extra_cost_ns_per_row > 0:
        pipe = pipe.map(ExtraCost(config.extra_cost_ns_per_row), name="extra_cost", **feature_knobs)
    pipe = pipe.batch(config.chunks_per_batch, collate=collate_batch, **knobs)
    return pipe.prefetch(config.prefetch_depth, pin_memory=config.pin_memory)


def build_loader(
    paths: str | os.PathLike | Sequence[str],
    config: DLRMPipelineConfig = DLRMPipelineConfig(),
    *,
    tuner: Any = None,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    **options: Any,
) -> Loader:
    """A :class:`~torchtune_pipe.Loader` over :func:`build_pipeline`.

    Args:
        paths, config, rank, world_size, shuffle: see :func:`build_pipeline`.
        tuner: the loader's own tuner (None when a
            :class:`~torchtune_pipe.integrations.lightning.TuningCallback` tunes it).
        **options: other :class:`~torchtune_pipe.Loader` arguments (``ordered``,
            ``timeout_s``, ``tuning_log``...).
    """
    pipe = build_pipeline(paths, config, rank=rank, world_size=world_size, shuffle=shuffle)
    return pipe.loader(tuner=tuner, **options)
