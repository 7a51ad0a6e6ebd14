"""Items bigger than the buffer budget, behind a slow consumer: how much memory piles up.

A source makes 8 MiB items (a decoded image batch, a dense feature block); a map stage with
two workers passes them on; the consumer takes one every ``--consumer-ms``. Budgets bound
what a pipeline holds only if frames bigger than a worker's share of the budget wait for room
like any other: each worker then has at most one such frame out, and a source frames large
items a few MiB at a time instead of 64 per frame. Contenders, each in its own process, side
by side in interleaved rounds:

* ``torchtune_pipe``: the Pipeline API, stage budgets of ``--budget-mib``;
* ``dataloader-w2``: torch's DataLoader, 2 workers, ``prefetch_factor=2`` (its own bound: 4
  items in flight).

Measured: the contender's process tree (its own PSS plus every descendant's), sampled every
20 ms; the table shows the peak above the tree's size at the first item, against the bound for
torchtune_pipe: the budgets, plus per worker the frame it has out and the one it is making,
plus the loader's prefetch and the item the consumer holds.

Usage::

    python -m benchmarks.big_items --out out/big_items.json   # 3 rounds, ~1 minute
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks._common import machine_info, median, print_table, write_json

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
ITEM_MIB = 8
WORKERS = 2


def _item(i: int):
    import torch

    return {"id": i, "payload": torch.full((ITEM_MIB * MiB // 4,), float(i))}


class _Source:
    """Units of 16 item ids; a unit's items are made by the source worker."""

    def __init__(self, n: int):
        self.n = n

    def units(self, epoch: int = 0) -> list[range]:
        return [range(k, min(k + 16, self.n)) for k in range(0, self.n, 16)]

    def read(self, unit: range):
        for i in unit:
            yield _item(i)


class _Items:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return _item(i)


def child(name: str, n: int, consumer_ms: float, budget_mib: int, ready: str) -> None:
    """Run one contender; touch ``ready`` after its first item."""
    if name == "torchtune_pipe":
        from torchtune_pipe import Pipeline

        pipe = Pipeline.from_source(_Source(n), buffer_bytes=budget_mib * MiB).map(
            lambda x: x, workers=WORKERS, buffer_bytes=budget_mib * MiB
        )
        it = iter(pipe.loader())
    else:
        from torch.utils.data import DataLoader

        it = iter(DataLoader(_Items(n), batch_size=None, num_workers=WORKERS, prefetch_factor=2))
    seen = set()
    for k, x in enumerate(it):
        seen.add(x["id"])
        del x
        if k == 0:
            Path(ready).touch()
        time.sleep(consumer_ms / 1000)
    assert seen == set(range(n)), f"{name}: {len(seen)} distinct items of {n}"


def tree_bytes(pid: int) -> int:
    from torchtune_pipe.telemetry.memory import smaps_rollup

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        fields = smaps_rollup(p.pid)
        if fields is not None:
            total += fields.get("Pss", 0)
    return total


def run_one(name: str, args: argparse.Namespace, workdir: str) -> dict:
    ready = Path(workdir) / f"{name}.ready"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.big_items", "--child", name, "--items",
           str(args.items), "--consumer-ms", str(args.consumer_ms), "--budget-mib",
           str(args.budget_mib), "--ready", str(ready)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO)
    base = peak = 0
    t0 = time.monotonic()
    while proc.poll() is None:
        size = tree_bytes(proc.pid)
        if ready.exists():
            if not base:
                base = size
            peak = max(peak, size)
        time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited with {proc.returncode}")
    return {"name": name, "base_mib": base / MiB, "peak_above_mib": (peak - base) / MiB,
            "wall_s": time.monotonic() - t0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--items", type=int, default=64)
    p.add_argument("--consumer-ms", type=float, default=50.0)
    p.add_argument("--budget-mib", type=int, default=16)
    p.add_argument("--out", default="out/big_items.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ready", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.items, args.consumer_ms, args.budget_mib, args.ready)
        return 0
    names = ["torchtune_pipe", "dataloader-w2"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                runs[n].append(run_one(n, args, workdir))
    # Two stages of budget_mib each; per worker (3) the frame it has out and the one it makes;
    # the loader's prefetch (2 items) and the item the consumer holds.
    bound = 2 * args.budget_mib + 3 * 2 * ITEM_MIB + 3 * ITEM_MIB
    rows = []
    for n in names:
        peaks = [x["peak_above_mib"] for x in runs[n]]
        rows.append({"contender": n, "peak_above_first_mib": median(peaks), "min": min(peaks),
                     "max": max(peaks), "bound_mib": bound if n == names[0] else None})  # fmt: skip
    print_table(rows, ["contender", "peak_above_first_mib", "min", "max", "bound_mib"],
                title=f"{ITEM_MIB} MiB items, {args.budget_mib} MiB budgets, median of "
                f"{args.rounds} rounds")  # fmt: skip
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "bound_mib": bound,
                          "runs": runs})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
