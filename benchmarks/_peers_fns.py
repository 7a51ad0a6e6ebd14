"""One contender of ``benchmarks/peers.py``, run in its own process.

``python -m benchmarks._peers_fns SPEC.json`` builds the Criteo pipeline with one tool (torch
DataLoader, torchdata.nodes, SPDL or torchtune_pipe with a tuner), iterates it for
``duration_s`` seconds (epoch after epoch) and writes the arrival time and row count of every
batch to ``spec["out"]``. Every tool runs the same work: the same files and work units (byte
ranges of the files), the same parser (:func:`~examples.dlrm.criteo.parse_rows`), the same
feature UDFs (``Features`` then ``ExtraCost``), the same batch size and the same collate into a
TorchRec ``Batch``. The parent process measures memory and CPU of the process tree.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks import _consume
from examples.dlrm.criteo import CriteoChunk, CriteoSource, ExtraCost
from examples.dlrm.pipeline import DLRMPipelineConfig, Features, build_pipeline, collate_batch

TOOLS = ("dataloader", "nodes", "spdl", "torchtune_pipe")


@dataclass(frozen=True)
class UnitWork:
    """Reads one work unit and runs the feature UDFs on each of its chunks (picklable)."""

    source: CriteoSource
    features: Features
    extra: ExtraCost | None

    def chunks(self, unit: Any) -> Iterator[CriteoChunk]:
        """The unit's chunks, transformed."""
        for chunk in self.source.read(unit):
            chunk = self.features(chunk)
            yield self.extra(chunk) if self.extra is not None else chunk

    def __call__(self, unit: Any) -> list[CriteoChunk]:
        return list(self.chunks(unit))


def make_source(spec: dict) -> CriteoSource:
    """The Criteo source every tool reads (no unit shuffling: same order for all tools)."""
    return CriteoSource(
        spec["paths"],
        chunk_rows=spec["chunk_rows"],
        chunk_bytes=spec["chunk_bytes"],
        remote_latency_s=spec.get("latency_s", 0.0),
    )


def make_work(spec: dict) -> UnitWork:
    """The per-unit work shared by the peers (not torchtune_pipe, which runs it as stages)."""
    extra = ExtraCost(spec["extra_cost_ns"]) if spec.get("extra_cost_ns", 0) > 0 else None
    return UnitWork(make_source(spec), Features(), extra)


# ---------------------------------------------------------------------------- the tools
def units_dataset(work: UnitWork) -> Any:
    """The work's units as torch's ``IterableDataset``, split by ``get_worker_info()``."""
    import torch.utils.data as tud

    units = work.source.units(0)

    class Units(tud.IterableDataset):
        def __iter__(self) -> Iterator[CriteoChunk]:
            info = tud.get_worker_info()
            wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
            for unit in units[wid::n]:
                yield from work.chunks(unit)

    return Units()


def _dataloader(spec: dict) -> Callable[[int], Iterator[Any]]:
    import torch.utils.data as tud

    w = spec["workers"]
    loader = tud.DataLoader(
        units_dataset(make_work(spec)),
        batch_size=spec["batch_size"] // spec["chunk_rows"],
        collate_fn=collate_batch,
        num_workers=w,
        persistent_workers=w > 0,
        prefetch_factor=spec.get("prefetch_factor", 2) if w > 0 else None,
    )
    return lambda epoch: iter(loader)


def _nodes(spec: dict) -> Callable[[int], Iterator[Any]]:
    import torchdata.nodes as tn

    work = make_work(spec)
    units = work.source.units(0)
    w = spec["workers"]
    node: Any = tn.IterableWrapper(units)
    if w == 0:
        node = tn.Mapper(node, work)
    else:
        node = tn.ParallelMapper(
            node, work, num_workers=w, method="process", in_order=False,
            multiprocessing_context="fork",
            max_concurrent=w,  # torchdata caps it at num_workers
        )  # fmt: skip
    node = tn.Unbatcher(node)
    node = tn.Batcher(node, batch_size=spec["batch_size"] // spec["chunk_rows"])
    node = tn.Mapper(node, collate_batch)
    node = tn.Prefetcher(node, prefetch_factor=spec.get("prefetch_factor", 2))
    loader = tn.Loader(node)
    return lambda epoch: iter(loader)


def _spdl(spec: dict) -> tuple[Callable[[int], Iterator[Any]], Callable[[], None]]:
    from concurrent.futures import ProcessPoolExecutor

    from spdl.pipeline import PipelineBuilder

    work = make_work(spec)
    units = work.source.units(0)
    w = max(1, spec["workers"])

    def forever() -> Iterator[Any]:
        while True:
            yield from units

    pool = ProcessPoolExecutor(w)
    pipeline = (
        PipelineBuilder()
        .add_source(forever())
        .pipe(work, concurrency=w, executor=pool)
        .disaggregate()
        .aggregate(spec["batch_size"] // spec["chunk_rows"])
        .pipe(collate_batch)
        .add_sink(spec.get("prefetch_factor", 2))
        .build(num_threads=2, max_failures=0)
    )
    pipeline.start()
    it = iter(pipeline.get_iterator(timeout=60))

    def stop() -> None:
        pipeline.stop(timeout=10)
        pool.shutdown(cancel_futures=True)

    return (lambda epoch: it), stop


def _torchtune(spec: dict) -> tuple[Callable[[int], Iterator[Any]], Callable[[], None]]:
    config = DLRMPipelineConfig(
        batch_size=spec["batch_size"],
        chunk_rows=spec["chunk_rows"],
        chunk_bytes=spec["chunk_bytes"],
        extra_cost_ns_per_row=spec.get("extra_cost_ns", 0),
        max_workers=2 * len(os.sched_getaffinity(0)),
        buffer_bytes=spec.get("buffer_bytes", 16 << 20),
        prefetch_depth=spec.get("prefetch_factor", 2),
        pin_memory=False,
    )
    pipe = build_pipeline(spec["paths"], config, shuffle=False)
    pipe = type(pipe)(make_source(spec), pipe.stages, pipe.prefetch_spec)  # same units as peers
    loader = pipe.loader(
        tuner=spec.get("tuner") or None,
        memory_limit_bytes=spec.get("memory_limit_bytes"),
        tuning_interval_s=spec.get("tuning_interval_s", 1.0),  # the Loader's default
        persistent_workers=True,  # as the DataLoader contender's: epoch after epoch
    )

    def epoch_iter(epoch: int) -> Iterator[Any]:
        loader.set_epoch(epoch)
        return iter(loader)

    return epoch_iter, loader.close


def build(spec: dict) -> tuple[Callable[[int], Iterator[Any]], Callable[[], None]]:
    """``(epoch -> iterator of batches, stop)`` for ``spec["tool"]``.

    Raises:
        ValueError: an unknown tool.
    """
    tool = spec["tool"]
    if tool == "dataloader":
        return _dataloader(spec), lambda: None
    if tool == "nodes":
        return _nodes(spec), lambda: None
    if tool == "spdl":
        return _spdl(spec)
    if tool == "torchtune_pipe":
        return _torchtune(spec)
    raise ValueError(f"benchmarks._peers_fns: unknown tool {tool!r}; choose one of {TOOLS}")


def warm_imports(tool: str) -> None:
    """Imports TorchRec (about 8 s on 2 cores) once, before the clock starts, for every tool.

    Forked workers (DataLoader, torchdata.nodes, SPDL) inherit it, and so do torchtune_pipe's:
    its fork server is forked from this process when the loader is built, as in a user's
    script (``multiproc.handles``).
    """
    import torch  # noqa: F401
    from torchrec.datasets.utils import Batch  # noqa: F401
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: F401

    import examples.dlrm.pipeline  # noqa: F401


def consume(spec: dict, clock: Callable[[], float] = time.perf_counter) -> dict:
    """:func:`benchmarks._consume.consume` over :func:`build`, rows from ``Batch.labels``."""
    return _consume.consume(spec, build, lambda batch: int(batch.labels.shape[0]), clock)


def main(argv: list[str]) -> int:
    """Entry point: ``python -m benchmarks._peers_fns SPEC.json``."""
    rows_of = lambda batch: int(batch.labels.shape[0])  # noqa: E731
    return _consume.run_child(argv[0], build, rows_of, lambda spec: warm_imports(spec["tool"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["TOOLS", "UnitWork", "build", "consume", "main", "make_source", "make_work"]
