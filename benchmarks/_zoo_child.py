"""One contender of the dataset zoo (``benchmarks/zoo.py``), in its own process.

``python -m benchmarks._zoo_child SPEC.json`` builds the member's dataset before the clock
starts (as a training script has its dataset before it makes a loader), then times the loader
from its construction: torch's ``DataLoader`` (``torch``: persistent workers; ``torch-np``:
not, torch's default), torchdata.nodes (``nodes-thread``, ``nodes-process``, built as
``benchmarks/_mapstyle_fns.py`` builds them) or ``torchtune_pipe.DataLoader`` (``ours``;
``workers`` -1 is ``num_workers="auto"``). Map-style datasets are shuffled by a generator
seeded 0. A digest of each of the first ``compare_batches`` batches of the first epoch goes to
``spec["digest_path"]``, for the harness to compare the loaders' batches.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from . import _consume
from ._mapstyle_fns import _nodes
from ._zoo_datasets import make

TOOLS = ("torch", "torch-np", "nodes-thread", "nodes-process", "ours")
# What a contender's build returns: ``(epoch -> batch iterator, stop or None)``.
Built = tuple[Callable[[int], Iterator[Any]], Callable[[], None] | None]


def digest(batch: Any) -> str:
    """A hash of a batch's structure, dtypes, shapes and values."""
    h = hashlib.sha1()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().contiguous().view(torch.uint8).numpy().data)
        elif isinstance(x, dict):
            for k in sorted(x):
                h.update(f"K{k!r}".encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__}{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"V{x!r}".encode())

    walk(batch)
    return h.hexdigest()[:16]


def rows_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(batch.shape[0])


class Contender:
    """The spec's dataset (made by :meth:`warm`, off the clock) and loader (:meth:`build`);
    :meth:`count` counts a batch's rows and digests the first ones."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.dataset: Any = None
        self.collate: Callable | None = None
        self.digests: list[str] = []
        self.epoch = 0

    def warm(self, spec: dict) -> None:
        self.dataset, self.collate = make(spec["member"], spec["data"], spec["items"])
        if spec["tool"] == "ours":
            # A training script imports its loader's library at its top, as it does torch:
            # importing it here timed 0.4 s into ours' first batch only.
            import torchtune_pipe  # noqa: F401

    def count(self, batch: Any) -> int:
        if self.epoch == 0 and len(self.digests) < self.spec["compare_batches"]:
            self.digests.append(digest(batch))
        return rows_of(batch)

    def build(self, spec: dict) -> Built:
        epochs, stop = self._loader(spec)

        def counted(epoch: int) -> Iterator[Any]:
            self.epoch = epoch
            return epochs(epoch)

        return counted, stop

    def _loader(self, spec: dict) -> Built:
        tool, w, ds = spec["tool"], spec["workers"], self.dataset
        iterable = isinstance(ds, IterableDataset)
        kw: dict[str, Any] = dict(batch_size=spec["batch_size"], collate_fn=self.collate)
        if not iterable:
            kw.update(shuffle=True, generator=torch.Generator().manual_seed(0))
        if tool in ("torch", "torch-np"):
            loader = torch.utils.data.DataLoader(
                ds, num_workers=w, persistent_workers=tool == "torch" and w > 0, **kw
            )
            return lambda epoch: iter(loader), None
        if tool in ("nodes-thread", "nodes-process"):
            return _nodes(dict(spec, shuffle=True), ds, self.collate or default_collate, []), None
        if tool == "ours":
            import torchtune_pipe

            ours = torchtune_pipe.DataLoader(ds, num_workers="auto" if w < 0 else w, **kw)
            return lambda epoch: iter(ours), ours.close
        raise ValueError(f"benchmarks._zoo_child: unknown tool {tool!r}; choose one of {TOOLS}")


def main(argv: list[str]) -> int:
    """Entry point: ``python -m benchmarks._zoo_child SPEC.json``."""
    with open(argv[0]) as f:
        c = Contender(json.load(f))
    code = _consume.run_child(argv[0], c.build, c.count, warm=c.warm)
    with open(c.spec["digest_path"], "w") as f:
        json.dump(c.digests, f)
    return code


if __name__ == "__main__":
    _consume.exit_now(main(sys.argv[1:]))
