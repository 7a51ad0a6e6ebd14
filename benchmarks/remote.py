"""The cost of the remote hop: a map stage on Ray actors against a local process stage.

One pipeline, ``source -> map(identity)``, run twice per case: the map stage as a local
process worker (``placement="local"``) and as a Ray actor (``placement="ray"``, one actor on a
two-node Ray cluster started on this machine). Items are torch tensors of a few sizes, in
frames of one item (the per-frame cost) or of up to 64 items (the per-item cost; the source
frames items of 1 MiB and more a few MiB at a time). Each case's loader runs one warm-up epoch
(worker and actor start) and then a timed one; cases are interleaved over ``--rounds`` rounds,
in alternating order, and the table gives the median and the spread over rounds.

The extra cost of the hop is reported per item and per frame, ``(T_ray - T_local) / n``, and as
a ratio of the throughputs: a remote stage pays off where its work per frame is well above
that cost (or where the host has no cores to spare). Ratios, not absolute claims: the actors
run on this machine's own cores, so the hop is measured without a network.

Usage::

    python -m benchmarks.remote --out benchmarks/results/remote.json   # ~3 minutes
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks._common import machine_info, median, print_table, write_json
from torchtune_pipe import Pipeline

KiB = 1 << 10
MiB = 1 << 20
# (label, bytes per item, items per epoch)
SIZES = [("64 B", 64, 4096), ("16 KiB", 16 * KiB, 2048), ("1 MiB", MiB, 256)]
FRAMES = [1, 64]  # items per work unit, hence per frame (at most)
PLACEMENTS = ("local", "ray")


class Tensors:
    """A source of ``n`` float32 tensors of ``nbytes`` each, in units of ``per_unit``."""

    def __init__(self, n: int, nbytes: int, per_unit: int):
        self.n, self.nbytes, self.per_unit = n, nbytes, per_unit

    def units(self, epoch: int = 0) -> list[range]:
        return [range(k, min(k + self.per_unit, self.n)) for k in range(0, self.n, self.per_unit)]

    def read(self, unit: range):
        for i in unit:
            yield torch.full((self.nbytes // 4,), float(i))


def identity(x: Any) -> Any:
    return x


def run_case(placement: str, nbytes: int, n: int, per_unit: int) -> dict[str, Any]:
    """One loader: a warm-up epoch, then a timed one."""
    pipe = Pipeline.from_source(Tensors(n, nbytes, per_unit)).map(
        identity,
        name="hop",
        placement=placement,  # type: ignore[arg-type]
    )
    with pipe.loader() as loader:
        for _ in loader:
            pass
        t0 = time.perf_counter()
        count = sum(1 for _ in loader)
        wall = time.perf_counter() - t0
        snap = loader.tunable.executor.snapshot().stage("hop")  # type: ignore[union-attr]
    assert count == n, (placement, nbytes, per_unit, count)
    frames = -(-n // per_unit)
    if nbytes >= MiB:  # the source frames large items a few MiB at a time
        frames = max(frames, -(-n // 4))
    return {"wall_s": wall, "items_per_s": n / wall, "frames": frames, "cpu_s": snap.cpu_ns / 1e9}


def start_cluster() -> Any:
    import ray
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=2, object_store_memory=256 * MiB)
    c = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    c.add_node(**node)
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
    c.wait_for_nodes()
    return c


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="items per epoch, times this")
    p.add_argument("--out", default="out/remote.json")
    args = p.parse_args(argv)
    import ray

    cluster = start_cluster()
    cases = [(label, nb, max(8, int(n * args.scale)), f) for label, nb, n in SIZES for f in FRAMES]
    runs: dict[str, list[dict]] = {}
    try:
        for r in range(args.rounds):
            order = cases if r % 2 == 0 else cases[::-1]
            for label, nb, n, f in order:
                for placement in PLACEMENTS if r % 2 == 0 else PLACEMENTS[::-1]:
                    key = f"{label}|{f}|{placement}"
                    runs.setdefault(key, []).append(run_case(placement, nb, n, f))
    finally:
        ray.shutdown()
        cluster.shutdown()
    rows = []
    for label, _, n, f in cases:
        loc, rem = runs[f"{label}|{f}|local"], runs[f"{label}|{f}|ray"]
        frames = loc[0]["frames"]
        extra = [(b["wall_s"] - a["wall_s"]) for a, b in zip(loc, rem, strict=True)]
        ratio = [b["items_per_s"] / a["items_per_s"] for a, b in zip(loc, rem, strict=True)]
        rows.append({
            "item": label, "items/frame": n // frames, "local items/s": median(
                [x["items_per_s"] for x in loc]), "ray items/s": median(
                [x["items_per_s"] for x in rem]),
            "ray/local": median(ratio), "ratio min": min(ratio), "ratio max": max(ratio),
            "extra us/item": median(extra) / n * 1e6,
            "extra ms/frame": median(extra) / frames * 1e3,
        })  # fmt: skip
    columns = ["item", "items/frame", "local items/s", "ray items/s", "ray/local", "ratio min",
               "ratio max", "extra us/item", "extra ms/frame"]  # fmt: skip
    print_table(rows, columns, title=f"remote hop vs local process stage, median of "
                f"{args.rounds} rounds (ratio: ray throughput / local)")  # fmt: skip
    write_json(args.out, {"machine": machine_info(), "ray": ray.__version__, "args": vars(args),
                          "rows": rows, "runs": runs})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
