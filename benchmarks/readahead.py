"""Batches read side by side in a fetch worker (``multiproc.readahead``), against one at a time.

``remote-map``'s dataset (``__getitem__`` waits 4 ms on a remote read, a collate with 2 ms of
CPU per batch of 32, ``shuffle=True``) through a Pipeline of fixed shape: a fetch stage of
``w`` workers at 64 calls in flight, then a collate stage of 2 workers (``collate0``: the
collate fused into the fetch workers). A batch has 32 samples, so a fetch worker at 64 calls
reads two batches at once; the contender ``-one`` reads through a source that does not say how
many calls a batch runs (no ``calls_per_unit``), so its workers read one batch at a time, 32
calls in flight, as before read-ahead; ``-after`` starts a worker's next batch only once the
one before is committed (``multiproc.readahead.READ_DURING_COMMIT`` off: the rule before),
where the others start it as soon as the one before is read. Each
contender runs in its own process; rounds interleave; the table shows the medians of the rounds
and their spread, and each shape's rows/s side by side over one at a time.

Usage::

    python -m benchmarks.readahead --out benchmarks/results/readahead.json   # 3 rounds, ~2 min
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import machine_info, median, print_table, write_json

REPO = Path(__file__).resolve().parent.parent
CALLS = 64
BATCH = 32
SHAPES = ((1, 2), (2, 2), (2, 0))  # (fetch workers, collate workers; 0: fused)
MODES = ("", "-one", "-after")


def _source(one_at_a_time: bool, seed: int = 0):
    import torch

    from benchmarks._mapstyle_fns import Rows
    from torchtune_pipe.sources.map_dataset import MapDatasetSource

    class OneAtATime(MapDatasetSource):
        """The same source, without ``calls_per_unit``: its batches are read one at a time."""

        calls_per_unit = None

    cls = OneAtATime if one_at_a_time else MapDatasetSource
    g = torch.Generator().manual_seed(seed)
    return cls(Rows(40_000, 0.004, 0), batch_size=BATCH, shuffle=True, generator=g)


def child(fetch: int, collate: int, mode: str, duration_s: float) -> dict:
    """Run one contender for ``duration_s`` after its first batch; its rows/s."""
    from benchmarks._mapstyle_fns import Collate
    from multiproc import readahead
    from torchtune_pipe import Pipeline

    readahead.READ_DURING_COMMIT = mode != "-after"  # before the fork server copies it
    pipe = Pipeline.from_source(
        _source(mode == "-one"), name="fetch", workers=fetch, concurrency=CALLS,
        max_concurrency=CALLS,
    ).map(Collate(2000), name="collate", workers=max(1, collate), fused=not collate)  # fmt: skip
    rows = 0
    t0 = None
    with pipe.loader() as loader:
        while True:
            for batch in loader:
                if t0 is None:
                    t0 = time.perf_counter()
                    continue
                rows += len(batch[1])
                if time.perf_counter() - t0 >= duration_s:
                    return {"rows_per_s": rows / (time.perf_counter() - t0)}


def _label(fetch: int, collate: int, mode: str) -> str:
    return f"fetch{fetch}-collate{collate}{mode}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=6.0, help="seconds after the first batch")
    p.add_argument("--out", default="out/readahead.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        fetch, collate, mode = json.loads(args.child)
        print(json.dumps(child(fetch, collate, mode, args.duration)))
        return 0
    contenders = [(f, c, mode) for f, c in SHAPES for mode in MODES]
    runs: dict[str, list[float]] = {_label(*k): [] for k in contenders}
    for r in range(args.rounds):
        for k in contenders if r % 2 == 0 else contenders[::-1]:
            cmd = [sys.executable, "-m", "benchmarks.readahead", "--child", json.dumps(k),
                   "--duration", str(args.duration)]  # fmt: skip
            out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])["rows_per_s"]
            runs[_label(*k)].append(got)
            print(f"  round {r + 1}/{args.rounds} {_label(*k)}: {got:,.0f} rows/s", flush=True)
    rows = []
    for f, c in SHAPES:
        side = runs[_label(f, c, "")]
        for mode in MODES:
            xs = runs[_label(f, c, mode)]
            rows.append({"contender": _label(f, c, mode), "rows_per_s": median(xs),
                         "spread": f"{min(xs):,.0f}-{max(xs):,.0f}",
                         "side_by_side_vs_this": median(side) / median(xs) if mode else None})  # fmt: skip
    print_table(
        rows, ["contender", "rows_per_s", "spread", "side_by_side_vs_this"],
        title=f"remote-map's dataset, {CALLS} calls in flight per fetch worker, median of "
        f"{args.rounds} rounds",
    )  # fmt: skip
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "runs": runs,
                          "table": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
