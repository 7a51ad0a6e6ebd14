"""One contender of the execution-shape scenarios of ``benchmarks/peers.py``, in its own process.

``python -m benchmarks._mapstyle_fns SPEC.json`` runs a user's map-style dataset through one
tool. The datasets are what a user's script has: ``__getitem__`` that waits on a remote read (a
sleep, as a network filesystem leaves the CPU idle) or that costs a little CPU per row, a
default or CPU-heavy collate, ``shuffle=True``; or (``spec["steps_us"]``, the ``fusion``
scenario) a chain of cheap per-row maps, built the way each tool builds a chain. Every tool
gets the same dataset, sampler order, batch size and collate; only how the work is executed
differs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from multiproc.stats import MAX_FUSED

from . import _consume
from ._bench_fns import burn

# "torchtune_pipe": the drop-in DataLoader; "-maps": a Pipeline with a map stage per step,
# "-fused": the same with every map fused from the start; "-shape": a Pipeline of fixed shape,
# ``workers`` fetch workers at SHAPE_CALLS calls in flight each and one collate worker.
TOOLS = ("dataloader", "nodes-thread", "nodes-process", "spdl", "torchtune_pipe",
         "torchtune_pipe-maps", "torchtune_pipe-fused", "torchtune_pipe-shape")  # fmt: skip
SHAPE_CALLS = 64


class Rows(Dataset):
    """``rows`` rows of 32 floats; each ``__getitem__`` waits ``wait_s`` and burns
    ``row_cpu_us`` of CPU, then returns a view of its row and its label."""

    def __init__(self, rows: int, wait_s: float, row_cpu_us: float):
        self.x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(0))
        self.y = torch.arange(rows)
        self.wait_s = wait_s
        self.row_cpu_us = row_cpu_us

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.wait_s:
            time.sleep(self.wait_s)  # the remote read: the process waits, its CPU is free
        if self.row_cpu_us:
            burn(self.row_cpu_us / 1e6)
        return self.x[i], self.y[i]


class Collate:
    """torch's ``default_collate`` plus ``cpu_us`` of CPU per batch (decode, normalise)."""

    def __init__(self, cpu_us: float):
        self.cpu_us = cpu_us

    def __call__(self, samples: list) -> Any:
        from torch.utils.data import default_collate

        if self.cpu_us:
            burn(self.cpu_us / 1e6)
        return default_collate(samples)


class Step:
    """One cheap map of the ``fusion`` chain: ``us`` of CPU per row, the row passed on."""

    def __init__(self, us: float):
        self.us = us

    def __call__(self, row: Any) -> Any:
        burn(self.us / 1e6)
        return row


class Chained(Dataset):
    """``ds`` with ``steps`` applied inside ``__getitem__``: how a DataLoader user chains maps."""

    def __init__(self, ds: Dataset, steps: list[Step]):
        self.ds = ds
        self.steps = steps

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        row = self.ds[i]
        for step in self.steps:
            row = step(row)
        return row


def _dataset(spec: dict) -> tuple[Rows, Collate, list[Step]]:
    ds = Rows(spec["rows"], spec["wait_s"], spec["row_cpu_us"])
    return ds, Collate(spec["collate_cpu_us"]), [Step(us) for us in spec.get("steps_us", ())]


def _order(ds: Dataset, shuffle: bool) -> Any:
    return torch.utils.data.RandomSampler(ds) if shuffle else torch.utils.data.SequentialSampler(ds)


def _dataloader(spec: dict, ds: Dataset, collate: Collate) -> Callable[[int], Iterator[Any]]:
    w = spec["workers"]
    loader = torch.utils.data.DataLoader(
        ds, batch_size=spec["batch_size"], shuffle=spec.get("shuffle", True), num_workers=w,
        collate_fn=collate, persistent_workers=w > 0,
    )  # fmt: skip
    return lambda epoch: iter(loader)


def _nodes(spec: dict, ds: Rows, collate: Collate, steps: list[Step]) -> Callable:
    import torchdata.nodes as tn

    tool, w = spec["tool"], spec["workers"]
    node: Any = tn.SamplerWrapper(_order(ds, spec.get("shuffle", True)))
    if w == 0:
        node = tn.Mapper(node, ds.__getitem__)
    else:
        node = tn.ParallelMapper(
            node, ds.__getitem__, num_workers=w, method=tool.split("-")[1],
            in_order=True, multiprocessing_context="fork" if tool == "nodes-process" else None,
        )  # fmt: skip
    for step in steps:  # a chain of nodes, each map its own Mapper
        node = tn.Mapper(node, step)
    node = tn.Batcher(node, batch_size=spec["batch_size"], drop_last=False)
    node = tn.Mapper(node, collate)
    node = tn.Prefetcher(node, prefetch_factor=2)
    nl = tn.Loader(node)
    return lambda epoch: iter(nl)


def _spdl(spec: dict, ds: Rows, collate: Collate, steps: list[Step]) -> tuple[Callable, Callable]:
    from spdl.pipeline import PipelineBuilder

    w = max(1, spec["workers"])
    order = _order(ds, spec.get("shuffle", True))

    def forever() -> Iterator[int]:
        while True:
            yield from order

    builder = PipelineBuilder().add_source(forever()).pipe(ds.__getitem__, concurrency=w)
    for step in steps:
        builder = builder.pipe(step)
    pipeline = (
        builder.aggregate(spec["batch_size"])
        .pipe(collate)
        .add_sink(2)
        .build(num_threads=w, max_failures=0)  # reads wait on threads of SPDL's own pool
    )
    pipeline.start()
    it = iter(pipeline.get_iterator(timeout=60))
    return (lambda epoch: it), (lambda: pipeline.stop(timeout=10))


def _torchtune(spec: dict, ds: Rows, collate: Collate, steps: list[Step]) -> tuple[Callable, Any]:
    import torchtune_pipe

    tool, w, bs = spec["tool"], spec["workers"], spec["batch_size"]
    if tool == "torchtune_pipe":  # the drop-in, over the same dataset a DataLoader user has
        kw = {} if spec.get("tuner") is None else {"tuner": spec["tuner"]}
        loader = torchtune_pipe.DataLoader(
            Chained(ds, steps) if steps else ds, batch_size=bs, shuffle=spec.get("shuffle", True),
            num_workers="auto" if w < 0 else w, collate_fn=collate, persistent_workers=w != 0,
            **kw,
        )  # fmt: skip
    elif tool == "torchtune_pipe-shape":
        from torchtune_pipe.sources.map_dataset import MapDatasetSource

        src = MapDatasetSource(ds, batch_size=bs, shuffle=spec.get("shuffle", True))
        loader = (
            torchtune_pipe.Pipeline.from_source(
                src,
                name="fetch",
                workers=w,
                concurrency=SHAPE_CALLS,
                max_concurrency=SHAPE_CALLS,
            )
            .map(collate, name="collate")
            .loader(tuner=None, persistent_workers=True)
        )
    else:  # one map stage per step, fused from the start with "torchtune_pipe-fused"
        pipe = torchtune_pipe.Pipeline.from_source(ds)
        for i, step in enumerate(steps, start=1):
            # A worker runs its own stage and at most MAX_FUSED (8) after it: the source
            # runs all six maps.
            fused = tool == "torchtune_pipe-fused" and i % (MAX_FUSED + 1) != 0
            pipe = pipe.map(step, name=f"step{i}", fused=fused)
        loader = pipe.batch(bs, collate=collate).loader(
            tuner=spec.get("tuner") or "intune", persistent_workers=True
        )

    def epochs(epoch: int) -> Iterator[Any]:
        loader.set_epoch(epoch)
        return iter(loader)

    return epochs, loader.close


def build(spec: dict) -> tuple[Callable[[int], Iterator[Any]], Callable[[], None] | None]:
    """``(epoch -> batch iterator, stop)`` of the spec's tool.

    Raises:
        ValueError: an unknown tool.
    """
    ds, collate, steps = _dataset(spec)
    tool = spec["tool"]
    if tool == "dataloader":
        return _dataloader(spec, Chained(ds, steps) if steps else ds, collate), None
    if tool in ("nodes-thread", "nodes-process"):
        return _nodes(spec, ds, collate, steps), None
    if tool == "spdl":
        return _spdl(spec, ds, collate, steps)
    if tool.startswith("torchtune_pipe") and tool in TOOLS:
        return _torchtune(spec, ds, collate, steps)
    raise ValueError(f"benchmarks._mapstyle_fns: unknown tool {tool!r}; choose one of {TOOLS}")


def main(argv: list[str]) -> int:
    """Entry point: ``python -m benchmarks._mapstyle_fns SPEC.json``."""
    return _consume.run_child(argv[0], build, lambda batch: int(batch[1].shape[0]))


if __name__ == "__main__":
    _consume.exit_now(main(sys.argv[1:]))
