"""Every tuner side by side on real pipelines running on this machine.

For each recipe of :mod:`_real_fns` (UDF-heavy, remote-read, batch-heavy) the script:

1. **Oracle search.** Runs the pipeline once with no tuner and walks a grid of static
   allocations on the live executor (``executor.resize``): every worker tuple with
   ``1 <= w_i <= --oracle-max-stage`` and ``sum(w) <= --oracle-max-total``. Each candidate
   settles for ``--settle`` seconds (worker start, buffers refilling) and is then measured for
   ``--measure`` seconds at the consumer. The best one is the oracle allocation.
2. **Tuner runs.** Starts a fresh loader per tuner (``unoptimized``, ``heuristic``,
   ``autotune``, ``plumber``, ``intune``, its ablations ``planner`` and ``network-only``, and
   ``oracle``: the oracle allocation as a static pipeline), all from one worker per stage,
   ``--rounds`` times, the tuners interleaved round by round, and consumes for ``--duration``
   seconds counted from the first item delivered (worker start-up, a few seconds and the same for every tuner,
   is reported apart as ``startup_s``). Throughput is binned every tuning interval, with the
   allocation in force at each bin's end.

Reported per tuner (the run of its median steady state, and the steady states' spread over the
rounds): steady state (mean of the last third of the bins), time-averaged throughput,
both as ratios to the oracle run's steady state and to the unoptimized run's, and the time at
which a 3-bin moving average first reaches 0.9 of the oracle's steady state. Throughput is in
samples per second (a batch counts its samples).

Run: ``.venv/bin/python benchmarks/tuners_real.py --out tuners_real.json``;
``--quick`` shrinks everything for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

import _real_fns  # noqa: E402
from _common import machine_info, write_json  # noqa: E402

from torchtune_pipe.tuning.base import Allocation, MiB  # noqa: E402
from torchtune_pipe.tuning.oracle import oracle_search  # noqa: E402

log = logging.getLogger("tuners_real")

# "planner" and "network-only": InTune's two ablations (the plan alone; the network alone).
TUNERS = ("unoptimized", "heuristic", "autotune", "plumber", "intune", "planner", "network-only",
          "oracle")  # fmt: skip
TARGET = 0.9


# ---------------------------------------------------------------------------- measuring
def search_live(
    recipe: _real_fns.Recipe,
    max_stage: int,
    max_total: int,
    settle_s: float,
    measure_s: float,
) -> dict:
    """Measure every static worker tuple with ``1 <= w_i <= max_stage`` and ``sum(w) <=
    max_total`` on one live pipeline (the library's :func:`oracle_search`, exhaustive, with a
    live measurement as its ``evaluate``); returns the scores and the best."""
    n = len(recipe.stages)
    scores: list[dict] = []
    with recipe.build((1,) * n).loader(timeout_s=60.0) as loader:
        it = iter(loader)
        next(it)  # workers are up once the first item arrives
        ex = loader.tunable.executor

        def measure(alloc: Allocation) -> float:
            for i, w in enumerate(alloc.workers):
                if ex.workers(i) != w:
                    ex.resize(i, w)
            t0 = time.perf_counter()
            settle_end, end = t0 + settle_s, t0 + settle_s + measure_s
            samples, started = 0, None
            for x in it:
                now = time.perf_counter()
                if now >= end:
                    break
                if now >= settle_end:
                    if started is None:
                        started = now
                    samples += _samples(x, recipe)
            rate = samples / max(1e-9, time.perf_counter() - (started or settle_end))
            scores.append({"workers": list(alloc.workers), "throughput": rate})
            log.info("oracle %s %s: %.1f samples/s", recipe.name, alloc.workers, rate)
            return rate

        oracle_search(measure, n, max_total, max_stage, exhaustive_limit=1 << 62)
    best = max(scores, key=lambda s: s["throughput"])
    # The tuners' hard limit charges every worker a core unless its stage waits on I/O, so
    # the best candidate within one worker per core (or one per stage) is reported apart.
    cap = max(n, len(os.sched_getaffinity(0)))
    capped = [s for s in scores if sum(s["workers"]) <= cap]
    return {
        "method": "grid of static allocations on one live pipeline",
        "settle_s": settle_s,
        "measure_s": measure_s,
        "scores": scores,
        "best": best,
        "best_within_cpu_cap": max(capped, key=lambda s: s["throughput"]) if capped else None,
    }


def _samples(x: Any, recipe: _real_fns.Recipe) -> int:
    return len(x) if recipe.items_per_delivery > 1 else 1


def run_tuner(
    recipe: _real_fns.Recipe,
    tuner: str,
    duration_s: float,
    interval_s: float,
    oracle_workers: Sequence[int],
) -> dict:
    """Consume ``recipe`` for ``duration_s`` under ``tuner``; the binned throughput trace."""
    n = len(recipe.stages)
    if tuner == "oracle":
        pipe, name = recipe.build(oracle_workers), None
    else:
        pipe, name = recipe.build((1,) * n), tuner
    trace: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "decisions.jsonl")
        loader = pipe.loader(
            tuner=name, tuning_interval_s=interval_s, tuning_log=log_path, timeout_s=60.0
        )
        with loader:
            it = iter(loader)
            start = time.perf_counter()
            first = next(it)
            t0 = time.perf_counter()
            startup_s = t0 - start
            next_bin, count, total = t0 + interval_s, _samples(first, recipe), 0
            for x in it:
                k = _samples(x, recipe)
                now = time.perf_counter()
                while now >= next_bin:  # close every bin that ended before this item
                    trace.append(_bin(loader, next_bin - t0, count / interval_s))
                    total += count
                    count = 0
                    next_bin += interval_s
                if now - t0 >= duration_s:
                    break
                count += k
        decisions = _decisions(log_path)
    total += count
    return {
        "tuner": tuner,
        "startup_s": startup_s,
        "trace": trace,
        "decisions": decisions,
        "samples": total,
    }


def _bin(loader: Any, t: float, rate: float) -> dict:
    alloc = loader.tunable.allocation() if loader.tunable is not None else None
    return {
        "t": round(t, 3),
        "throughput": rate,
        "workers": list(alloc.workers) if alloc else None,
        "buffer_mib": [round(b / MiB, 2) for b in alloc.buffer_bytes] if alloc else None,
    }


def _decisions(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "allocation" in rec:
                out.append(
                    {
                        "wall_s": rec["wall_s"],
                        "workers": rec["allocation"]["workers"],
                        "throughput": rec["obs"]["throughput"],
                    }
                )
    return out


# ---------------------------------------------------------------------------- summarising
def summarise(run: dict, duration_s: float, oracle: float, unoptimized: float | None) -> dict:
    """Steady state, time average, ratios and time to ``TARGET`` of the oracle for one run."""
    rates = [b["throughput"] for b in run["trace"]]
    tail = rates[-max(1, len(rates) // 3) :] if rates else [0.0]
    steady = sum(tail) / len(tail)
    average = run["samples"] / duration_s
    reach = None
    for i in range(len(rates)):
        window = rates[max(0, i - 2) : i + 1]
        if len(window) == 3 and sum(window) / 3 >= TARGET * oracle:
            reach = run["trace"][i]["t"]
            break
    last = run["trace"][-1]["workers"] if run["trace"] else None
    return {
        "tuner": run["tuner"],
        "steady": steady,
        "average": average,
        "steady_vs_oracle": steady / oracle if oracle > 0 else None,
        "steady_vs_unoptimized": steady / unoptimized if unoptimized else None,
        "average_vs_oracle": average / oracle if oracle > 0 else None,
        "time_to_target_s": reach,
        "final_workers": last,
    }


def median_index(values: Sequence[float]) -> int:
    """The index of the median of ``values`` (the lower of the two middle ones for an even
    count)."""
    ranked = sorted(range(len(values)), key=values.__getitem__)
    return ranked[(len(ranked) - 1) // 2]


def table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain-text table: ``columns`` are (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else format(r[k], f) for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].rjust(widths[i]) for i in range(len(columns))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


COLUMNS = (
    ("tuner", "tuner", "s"),
    ("steady", "steady/s", ".1f"),
    ("spread", "rounds' steady/s", "s"),
    ("average", "avg/s", ".1f"),
    ("steady_vs_oracle", "vs oracle", ".2f"),
    ("steady_vs_unoptimized", "vs unopt", ".2f"),
    ("time_to_target_s", "t(0.9 oracle) s", ".1f"),
    ("final_workers", "final workers", "s"),
)


def bench(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; returns the JSON-ready result."""
    scale = 0.25 if args.quick else 1.0
    recipes = _real_fns.recipes(scale)
    chosen = args.pipelines or list(recipes)
    tuners = args.tuners or list(TUNERS)
    result: dict = {
        "machine": machine_info(),
        "config": {
            "duration_s": args.duration,
            "interval_s": args.interval,
            "quick": args.quick,
            "oracle_max_stage": args.oracle_max_stage,
            "oracle_max_total": args.oracle_max_total,
            "rounds": args.rounds,
        },
        "pipelines": {},
    }
    for name in chosen:
        recipe = recipes[name]
        search = search_live(
            recipe, args.oracle_max_stage, args.oracle_max_total, args.settle, args.measure
        )
        best = search["best"]["workers"]
        rounds: dict[str, list[dict]] = {t: [] for t in tuners}
        for _ in range(max(1, args.rounds)):
            for t in tuners:
                rounds[t].append(run_tuner(recipe, t, args.duration, args.interval, best))
        steadies = {
            t: [summarise(x, args.duration, 1.0, None)["steady"] for x in rs]
            for t, rs in rounds.items()
        }
        runs = {t: rs[median_index(steadies[t])] for t, rs in rounds.items()}
        oracle_run = runs.get("oracle")
        oracle = (
            summarise(oracle_run, args.duration, 1.0, None)["steady"]
            if oracle_run
            else search["best"]["throughput"]
        )
        unopt = runs.get("unoptimized")
        unopt_steady = summarise(unopt, args.duration, 1.0, None)["steady"] if unopt else None
        rows = [summarise(r, args.duration, oracle, unopt_steady) for r in runs.values()]
        for r in rows:
            r["final_workers"] = str(r["final_workers"])
            lo, hi = min(steadies[r["tuner"]]), max(steadies[r["tuner"]])
            r["steady_min"], r["steady_max"] = lo, hi
            r["spread"] = f"{lo:.1f}-{hi:.1f}"
        result["pipelines"][name] = {
            "stages": list(recipe.stages),
            "oracle_search": search,
            "oracle_steady": oracle,
            "summary": rows,
            "runs": runs,
            "round_steadies": steadies,
        }
        print(
            f"\n== {name}  stages {recipe.stages}  oracle allocation {best} "
            f"(grid of {len(search['scores'])}: {search['best']['throughput']:.1f}/s)"
        )
        print(table(rows, COLUMNS), flush=True)
    result["load_avg_1m_end"] = os.getloadavg()[0]
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (``--quick`` overrides the timing options with small values)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per tuner run")
    p.add_argument("--rounds", type=int, default=1, help="runs per tuner, interleaved")
    p.add_argument("--interval", type=float, default=1.0, help="tuning interval and bin, s")
    p.add_argument("--settle", type=float, default=0.75, help="oracle: settle per candidate, s")
    p.add_argument("--measure", type=float, default=1.5, help="oracle: measure per candidate, s")
    p.add_argument("--oracle-max-stage", type=int, default=3)
    p.add_argument("--oracle-max-total", type=int, default=5)
    p.add_argument("--pipelines", nargs="*", help=f"subset of {list(_real_fns.recipes())}")
    p.add_argument("--tuners", nargs="*", help=f"subset of {list(TUNERS)}")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (< 30 s)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.interval, args.settle, args.measure = 1.5, 0.5, 0.2, 0.4
        args.oracle_max_stage, args.oracle_max_total = 2, 4
        args.pipelines = args.pipelines or ["remote_read"]
        args.tuners = args.tuners or ["unoptimized", "oracle"]
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Entry point: run, print the tables, write ``--out``."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    args = parse_args(argv)
    result = bench(args)
    if args.out:
        write_json(args.out, result)
        print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
