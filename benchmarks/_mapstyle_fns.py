"""The child process of ``benchmarks/mapstyle.py``: a user's map-style dataset through one tool.

The datasets are what a user's script has: ``__getitem__`` that waits on a remote read (a
sleep, as a network filesystem leaves the CPU idle) or that costs a little CPU per row, a
default or CPU-heavy collate, ``shuffle=True``. Every tool gets the same dataset, sampler
order, batch size and collate; only how the work is executed differs.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from . import _consume
from ._bench_fns import burn

TOOLS = ("dataloader", "nodes-thread", "nodes-process", "torchtune_pipe")


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


def _dataset(spec: dict) -> tuple[Rows, Collate]:
    return Rows(spec["rows"], spec["wait_s"], spec["row_cpu_us"]), Collate(spec["collate_cpu_us"])


def build(spec: dict) -> tuple[Callable[[int], Iterator[Any]], Callable[[], None] | None]:
    """``(epoch -> batch iterator, stop)`` of the spec's tool."""
    ds, collate = _dataset(spec)
    tool, w, bs = spec["tool"], spec["workers"], spec["batch_size"]
    if tool == "dataloader":
        loader = torch.utils.data.DataLoader(
            ds, batch_size=bs, shuffle=True, num_workers=w, collate_fn=collate,
            persistent_workers=w > 0,
        )  # fmt: skip
        return (lambda epoch: iter(loader)), None
    if tool in ("nodes-thread", "nodes-process"):
        import torchdata.nodes as tn

        node: Any = tn.SamplerWrapper(torch.utils.data.RandomSampler(ds))
        if w == 0:
            node = tn.Mapper(node, ds.__getitem__)
        else:
            node = tn.ParallelMapper(
                node, ds.__getitem__, num_workers=w, method=tool.split("-")[1],
                in_order=True, multiprocessing_context="fork" if tool == "nodes-process" else None,
            )  # fmt: skip
        node = tn.Batcher(node, batch_size=bs, drop_last=False)
        node = tn.Mapper(node, collate)
        node = tn.Prefetcher(node, prefetch_factor=2)
        nl = tn.Loader(node)
        return (lambda epoch: iter(nl)), None
    if tool == "torchtune_pipe":
        import torchtune_pipe

        kw = {} if spec.get("tuner") is None else {"tuner": spec["tuner"]}
        ttp = torchtune_pipe.DataLoader(
            ds, batch_size=bs, shuffle=True, num_workers="auto" if w < 0 else w, collate_fn=collate,
            **kw,
        )  # fmt: skip

        def epochs(epoch: int) -> Iterator[Any]:
            ttp.set_epoch(epoch)
            return iter(ttp)

        return epochs, ttp.close
    raise ValueError(f"benchmarks._mapstyle_fns: unknown tool {tool!r}; choose one of {TOOLS}")


def main(argv: list[str]) -> int:
    """Entry point: ``python -m benchmarks._mapstyle_fns SPEC.json``."""
    return _consume.run_child(argv[0], build, lambda batch: int(batch[1].shape[0]))


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # The result is on disk: skip interpreter teardown, where torchdata.nodes' prefetch
    # thread can abort the process ("terminate called without an active exception"). Worker
    # processes go first: skipped teardown would leave them holding the harness's pipes.
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    sys.stdout.flush()
    os._exit(code)
