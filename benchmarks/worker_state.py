"""What a snapshot per epoch costs: ours against torch's DataLoader, workers fresh or persistent.

Workers see the calling process as it was at the epoch's ``iter()`` (``persistent_workers=False``)
or at the first ``iter()`` (True), as torch's do: ours fork a fork server from the process at
``iter()`` (:mod:`multiproc.snapshot`). This benchmark measures what that costs where it shows:
epochs 2 to 5 of

- ``inmem``: a map-style dataset holding ~1 GB of tensors in the calling process (what a fork
  copies page tables for), ``__getitem__`` a row, batch 256;
- ``criteo``: the Criteo pipeline's read, parse and feature UDFs as an ``IterableDataset`` of
  work units split by ``get_worker_info()`` (generated files, ``examples/dlrm/generate.py``).

Contenders, all with ``num_workers`` = the usable cores: torch's DataLoader and ours
(``torchtune_pipe.DataLoader``), each with ``persistent_workers`` False and True. Per contender
and round: the median time to the first batch of epochs 2-5, and rows/s over epochs 2-5.
Rounds interleave the contenders; the table gives the median and the spread (min-max) over
rounds and each of ours against torch's in the same mode.

Usage::

    python -m benchmarks.worker_state --rounds 3 [--gib 1.0] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks._common import machine_info, median, print_table, usable_cores, write_json

EPOCHS = 5  # epoch 1 starts everything; epochs 2-5 are measured
CONTENDERS = ("torch-fresh", "torch-persistent", "ours-fresh", "ours-persistent")


class InMemory:
    """~``gib`` GiB of float32 rows held by the dataset; an epoch reads ``rows`` of them."""

    def __init__(self, gib: float, rows: int, width: int = 256):
        import torch

        n = max(rows, int(gib * (1 << 30)) // (4 * width))
        self.data = torch.rand(n, width)
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> Any:
        return self.data[(i * 7919) % len(self.data)]


def _criteo_dataset(paths: list[str]) -> Any:
    from benchmarks._peers_fns import make_work, units_dataset

    return units_dataset(make_work({"paths": paths, "chunk_rows": 256, "chunk_bytes": 1 << 20}))


def collate_columns(chunks: list) -> dict:
    """A batch of Criteo chunks as tensors of its columns (the DLRM example's batch without
    TorchRec's types, so the benchmark runs where TorchRec is not installed)."""
    import torch

    from examples.dlrm.criteo import CriteoChunk

    c = chunks[0] if len(chunks) == 1 else CriteoChunk.concat(chunks)
    return {
        "labels": torch.from_numpy(c.labels),
        "dense": torch.from_numpy(c.dense),
        "sparse": torch.from_numpy(c.sparse),
    }


def _loader(contender: str, dataset: Any, batch_size: int | None, collate: Any) -> Any:
    tool, mode = contender.split("-")
    kw = dict(
        batch_size=batch_size, num_workers=usable_cores(), persistent_workers=mode == "persistent"
    )
    if collate is not None:
        kw["collate_fn"] = collate
    if tool == "torch":
        from torch.utils.data import DataLoader
    else:
        from torchtune_pipe import DataLoader
    return DataLoader(dataset, **kw)


def _rows(batch: Any) -> int:
    """Rows in a batch: a tensor's first dimension, or its labels'."""
    return int((batch["labels"] if isinstance(batch, dict) else batch).shape[0])


def run_one(make: Callable[[], Any], epochs: int) -> dict:
    """Epochs of one loader: first-batch times and rows/s of epochs 2 on."""
    loader = make()
    firsts, rows, t_all = [], 0, 0.0
    try:
        for e in range(epochs):
            t0 = time.perf_counter()
            it = iter(loader)
            first = next(it)
            t1 = time.perf_counter()
            n = _rows(first) + sum(_rows(b) for b in it)
            t2 = time.perf_counter()
            if e >= 1:
                firsts.append(t1 - t0)
                rows += n
                t_all += t2 - t0
    finally:
        getattr(loader, "close", lambda: None)()
        del loader
    return {"first_batch_s": median(firsts), "rows_per_s": rows / t_all if t_all else float("nan")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the in-memory dataset")
    ap.add_argument("--rows", type=int, default=40_000, help="rows per in-memory epoch")
    ap.add_argument("--criteo-rows", type=int, default=200_000)
    ap.add_argument("--data-dir", default=os.path.join("out", "worker_state_data"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke test)")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "worker_state.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.gib, args.rows, args.criteo_rows = 1, 0.02, 2_000, 4_000
        args.out = os.path.join("out", "worker_state_quick.json")

    from benchmarks.peers import ensure_data

    paths = ensure_data(args.data_dir, files=2, rows=args.criteo_rows // 2)
    datasets = {
        "inmem": (InMemory(args.gib, args.rows), 256, None),
        "criteo": (_criteo_dataset(paths), 2, collate_columns),
    }
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for name, (ds, bs, collate) in datasets.items():
            order = CONTENDERS if r % 2 == 0 else tuple(reversed(CONTENDERS))
            for c in order:
                res = run_one(functools.partial(_loader, c, ds, bs, collate), EPOCHS)
                runs.setdefault((name, c), []).append(res)
                print(f"round {r + 1} {name:6s} {c:17s} first {res['first_batch_s']:.4f} s  "
                      f"{res['rows_per_s']:,.0f} rows/s", file=sys.stderr, flush=True)  # fmt: skip

    table = []
    for name in datasets:
        for c in CONTENDERS:
            rs = runs[(name, c)]
            rates = [x["rows_per_s"] for x in rs]
            firsts = [x["first_batch_s"] for x in rs]
            row = {
                "dataset": name, "contender": c,
                "rows_per_s": median(rates), "rate_min": min(rates), "rate_max": max(rates),
                "first_batch_s": median(firsts), "first_min": min(firsts), "first_max": max(firsts),
            }  # fmt: skip
            if c.startswith("ours"):
                peer = runs[(name, "torch-" + c.split("-")[1])]
                row["rate_vs_torch"] = median(rates) / median([x["rows_per_s"] for x in peer])
                row["first_vs_torch_s"] = median(firsts) - median(
                    [x["first_batch_s"] for x in peer]
                )
            table.append(row)
    cols = ["dataset", "contender", "rows_per_s", "rate_min", "rate_max", "rate_vs_torch",
            "first_batch_s", "first_min", "first_max", "first_vs_torch_s"]  # fmt: skip
    print_table(table, cols, title=f"worker state: epochs 2-{EPOCHS}, {args.rounds} rounds")
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "table": table})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
