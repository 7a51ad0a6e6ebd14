"""The executor's evidence: four measurements, each against its target, in one run.

(a) bandwidth: 2 MiB DLRM-like batches from one source worker to the consumer, against a
    ``torch.multiprocessing.Queue`` fed by one producer process (target: >= 3x).
(b) tiny items: ints through a three-stage pipeline, against ``torchdata.nodes.ParallelMapper``
    (process workers) and ``torch.utils.data.DataLoader`` with the same worker count
    (target: >= 1x each).
(c) CPU efficiency: a three-stage pipeline of known per-item CPU cost, throughput over the
    bound ``cores / CPU seconds per item`` (target: >= 0.85).
(d) worker start latency after ``resize`` on a warm executor (target: p50 < 50 ms).

Rates are steady-state (items 10%..90% of each stream), repeated ``--repeats`` times; the
medians are reported. Run from the repository root:

    python -m benchmarks.executor --out out/bench_executor.json
    python -m benchmarks.executor --quick          # smoke run, a few seconds
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from multiproc import Executor, ExecutorSpec, StageSpec

from . import _bench_fns as fns
from ._common import machine_info, median, percentile, print_table, usable_cores, write_json
from ._executor_cases import (
    TINY_WORKERS,
    _expect,
    allocate_workers,
    dataloader_tiny,
    executor_bandwidth,
    executor_cpu,
    executor_start_latency,
    executor_tiny,
    parallel_mapper_tiny,
    producer_only_bandwidth,
    queue_bandwidth,
)

SECTIONS = ("bandwidth", "tiny_items", "cpu_efficiency", "start_latency")
TARGETS = {
    "bandwidth": 3.0,  # x torch.multiprocessing.Queue
    "tiny_items": 1.0,  # x the slower-to-beat of ParallelMapper and DataLoader
    "cpu_efficiency": 0.85,  # measured / bound
    "start_latency": 50.0,  # p50 ms
}


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of one benchmark run.

    Args:
        repeats: runs per measurement; medians are reported.
        bw_batches: batches per bandwidth run; bw_rows: rows per batch (8192: 2 MiB);
            bw_warm_batches: batches held at once before timing (fills the arena once).
        tiny_items: ints per tiny-item run; tiny_unit: ints per work unit.
        cpu_items: items per CPU-efficiency run; cpu_stage_ms: CPU ms per item per stage.
        start_workers: workers started (one or two at a time) for the latency measurement.
    """

    repeats: int = 3
    bw_batches: int = 300
    bw_rows: int = fns.BATCH_ROWS
    bw_warm_batches: int = 28
    tiny_items: int = 60_000
    tiny_unit: int = 4096
    cpu_items: int = 6000
    cpu_stage_ms: tuple[float, ...] = (0.3, 0.3, 0.3)
    start_workers: int = 20

    @classmethod
    def quick(cls) -> BenchConfig:
        """A smoke-test size: every code path, seconds not minutes; numbers are rough."""
        return cls(
            repeats=1,
            bw_batches=12,
            bw_rows=2048,
            bw_warm_batches=2,
            tiny_items=2000,
            tiny_unit=1024,
            cpu_items=200,
            start_workers=2,
        )


def _exec_bw(c: BenchConfig, **kw) -> dict:
    return executor_bandwidth(c.bw_batches, c.bw_rows, warm_batches=c.bw_warm_batches, **kw)


BW_VARIANTS = {  # key: (label, measure)
    "executor": ("executor, source -> consumer", _exec_bw),
    "executor_relay": (
        "executor, source -> map -> consumer",
        functools.partial(_exec_bw, relay=True),
    ),
    "executor_all_threads": (
        f"executor, source -> consumer, torch_threads={usable_cores()}",
        functools.partial(_exec_bw, torch_threads=usable_cores()),
    ),
    "mp_queue": (
        "torch.multiprocessing.Queue, 1 producer (1 thread)",
        lambda c: queue_bandwidth(c.bw_batches, c.bw_rows),
    ),
    "producer_only": (
        "making batches alone, no transfer (1 thread)",
        lambda c: producer_only_bandwidth(min(c.bw_batches, 50), c.bw_rows),
    ),
}


def bench_bandwidth(cfg: BenchConfig) -> dict:
    """(a): GB/s of the executor and of torch.multiprocessing.Queue, and their ratio."""
    runs: dict[str, list] = {k: [] for k in BW_VARIANTS}
    for _ in range(cfg.repeats):  # interleaved, so drifting machine load hits every variant
        for key, (_, fn) in BW_VARIANTS.items():
            runs[key].append(fn(cfg))
    med = {k: {m: median([r[m] for r in v]) for m in v[0]} for k, v in runs.items()}
    queue = med["mp_queue"]["gbps"]
    ratio = med["executor"]["gbps"] / queue

    def cpu_per_batch(k: str) -> float:
        return med[k]["producer_cpu_ms_per_batch"] + med[k]["consumer_cpu_ms_per_batch"]

    cpu_ratio = cpu_per_batch("mp_queue") / cpu_per_batch("executor")
    rows = [
        {
            "variant": label,
            "GB/s": med[k]["gbps"],
            "vs queue": med[k]["gbps"] / queue,
            "producer CPU ms/batch": med[k]["producer_cpu_ms_per_batch"],
            "consumer CPU ms/batch": med[k]["consumer_cpu_ms_per_batch"],
        }
        for k, (label, _) in BW_VARIANTS.items()
    ]
    return _section(
        "bandwidth",
        "executor / mp.Queue GB/s",
        ratio,
        TARGETS["bandwidth"],
        ratio >= TARGETS["bandwidth"],
        unit="x",
        rows=rows,
        runs=runs,
        medians=med,
        cpu_ratio=cpu_ratio,
        note=(
            f"CPU per batch (producer + consumer), queue / executor: {cpu_ratio:.2f}x; "
            "GB/s on a host busy with other work tracks the CPU each side gets"
        ),
        batch_bytes=fns.batch_nbytes(cfg.bw_rows),
        batches=cfg.bw_batches,
    )


# ---------------------------------------------------------------- (b) tiny items
def bench_tiny(cfg: BenchConfig) -> dict:
    """(b): items/s of the executor, ParallelMapper and DataLoader at equal worker counts."""
    runs = {"executor": [], "parallel_mapper": [], "dataloader": []}
    for _ in range(cfg.repeats):
        runs["executor"].append(executor_tiny(cfg.tiny_items, cfg.tiny_unit))
        runs["parallel_mapper"].append(parallel_mapper_tiny(cfg.tiny_items, TINY_WORKERS))
        runs["dataloader"].append(dataloader_tiny(cfg.tiny_items, TINY_WORKERS))
    med = {k: median(v) for k, v in runs.items()}
    vs_pm = med["executor"] / med["parallel_mapper"]
    vs_dl = med["executor"] / med["dataloader"]
    worst = min(vs_pm, vs_dl)
    return _section(
        "tiny_items",
        "executor / best peer items/s",
        worst,
        TARGETS["tiny_items"],
        worst >= TARGETS["tiny_items"],
        unit="x",
        rows=[
            {
                "variant": f"executor (3 stages x 1 worker, frame_items={StageSpec.frame_items})",
                "items/s": med["executor"],
                "executor/this": 1.0,
            },
            {
                "variant": f"ParallelMapper(process, {TINY_WORKERS} workers)",
                "items/s": med["parallel_mapper"],
                "executor/this": vs_pm,
            },
            {
                "variant": f"DataLoader({TINY_WORKERS} workers, batch_size=None)",
                "items/s": med["dataloader"],
                "executor/this": vs_dl,
            },
        ],
        runs=runs,
        median_items_per_s=med,
        ratio_vs_parallel_mapper=vs_pm,
        ratio_vs_dataloader=vs_dl,
        items=cfg.tiny_items,
        workers=TINY_WORKERS,
    )


# ---------------------------------------------------------------- (c) CPU efficiency
def bench_cpu(cfg: BenchConfig) -> dict:
    """(c): measured throughput over the CPU bound, workers allocated to total the cores."""
    cores = usable_cores()
    stage_s = [ms / 1e3 for ms in cfg.cpu_stage_ms]
    workers = allocate_workers(stage_s, cores)
    bound = cores / sum(stage_s)
    runs = [executor_cpu(cfg.cpu_items, stage_s, workers) for _ in range(cfg.repeats)]
    med = {m: median([r[m] for r in runs]) for m in runs[0]}
    eff = med["items_per_s"] / bound
    note = (
        ""
        if sum(workers) == cores
        else (
            f"{len(stage_s)} stages need >= {len(stage_s)} workers; {cores} cores are time-shared"
        )
    )
    row = {
        "cores": cores,
        "workers": "+".join(map(str, workers)),
        "CPU ms/item": sum(cfg.cpu_stage_ms),
        "bound items/s": bound,
        "items/s": med["items_per_s"],
        "efficiency": eff,
        "CPU share": med["cpu_share"],
        "useful CPU": med["useful_cpu_fraction"],
        "main CPU ms/item": med["main_process_cpu_ms_per_item"],
        "machine busy cores": med["machine_busy_cores"],
    }
    return _section(
        "cpu_efficiency",
        "throughput / bound",
        eff,
        TARGETS["cpu_efficiency"],
        eff >= TARGETS["cpu_efficiency"],
        unit="",
        rows=[row],
        runs=runs,
        medians=med,
        cores=cores,
        workers=workers,
        stage_cpu_ms=cfg.cpu_stage_ms,
        bound_items_per_s=bound,
        note=note,
    )


# ---------------------------------------------------------------- (d) start latency
def bench_start_latency(cfg: BenchConfig) -> dict:
    """(d): p50/p95 of worker start latency after ``resize``, idle and under load."""
    rows, detail = [], {}
    modes = {"idle": False, "loaded": True}
    for name, loaded in modes.items():
        runs = [executor_start_latency(cfg.start_workers, loaded) for _ in range(cfg.repeats)]
        p50 = median([percentile(r["latencies_ms"], 50) for r in runs])
        p95 = median([percentile(r["latencies_ms"], 95) for r in runs])
        obs50 = median([percentile(r["resize_to_ready_ms"], 50) for r in runs])
        rows.append(
            {
                "executor": name,
                "p50 ms": p50,
                "p95 ms": p95,
                "max ms": max(max(r["latencies_ms"]) for r in runs),
                "resize->seen p50 ms": obs50,
            }
        )
        detail[name] = {"p50_ms": p50, "p95_ms": p95, "runs": runs}
    p50 = detail["idle"]["p50_ms"]
    return _section(
        "start_latency",
        "p50 ms (idle warm executor)",
        p50,
        TARGETS["start_latency"],
        p50 < TARGETS["start_latency"],
        unit="ms",
        rows=rows,
        workers_started=cfg.start_workers,
        note="workers are forked by a fork server that has torch and the stage modules imported",
        **detail,
    )


# ---------------------------------------------------------------- driver
def _section(
    name: str,
    metric: str,
    measured: float,
    target: float,
    ok: bool,
    unit: str,
    rows: list,
    **details,
) -> dict:
    return {
        "name": name,
        "metric": metric,
        "measured": measured,
        "target": target,
        "unit": unit,
        "pass": bool(ok),
        "rows": rows,
        **details,
    }


BENCHES: dict[str, Callable[[BenchConfig], dict]] = {
    "bandwidth": bench_bandwidth,
    "tiny_items": bench_tiny,
    "cpu_efficiency": bench_cpu,
    "start_latency": bench_start_latency,
}


def _warm_forkserver() -> None:
    # The first executor starts the shared fork server with torch preloaded; baselines that
    # use it afterwards (and every later executor) start their processes from it.
    spec = ExecutorSpec((StageSpec("warm", "source", fns.int_range),), name="bench_warm")
    with Executor(spec) as ex:
        _expect("warm-up", sum(1 for _ in ex.run([(0, 8)])), 8)


def run_benchmarks(
    cfg: BenchConfig, sections: Sequence[str] = SECTIONS, echo: Callable[[str], None] = print
) -> dict:
    """Run the chosen sections; print each table; return the JSON-ready result."""
    unknown = set(sections) - set(BENCHES)
    if unknown:
        raise ValueError(
            f"run_benchmarks: unknown sections {sorted(unknown)}; choose from {SECTIONS}"
        )
    torch.set_num_threads(1)
    _warm_forkserver()
    result = {"machine": machine_info(), "config": asdict(cfg), "targets": TARGETS, "sections": {}}
    for name in sections:
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        sec = BENCHES[name](cfg)
        sec["wall_s"] = time.perf_counter() - t0
        sec["load_avg_1m"] = [load0, os.getloadavg()[0]]  # before, after: other load on the host
        result["sections"][name] = sec
        cols = list(dict.fromkeys(c for r in sec["rows"] for c in r))
        print_table(sec["rows"], cols, title=f"\n({name})", print_fn=echo)
        if sec.get("note"):
            echo(f"note: {sec['note']}")
    summary = [
        {
            "section": s["name"],
            "metric": s["metric"],
            "measured": s["measured"],
            "target": s["target"],
            "result": s["pass"],
        }
        for s in result["sections"].values()
    ]
    result["summary"] = summary
    print_table(
        summary,
        ["section", "metric", "measured", "target", "result"],
        title=f"\nsummary (median of {cfg.repeats} runs, {usable_cores()} cores)",
        print_fn=echo,
    )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m benchmarks.executor [--quick] [--out PATH]``."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.executor", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--out", default="out/bench_executor.json", help="JSON result path")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per measurement (median)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    args = ap.parse_args(argv)
    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    if args.repeats is not None:
        if args.repeats < 1:
            ap.error(f"--repeats must be >= 1, got {args.repeats}")
        cfg = BenchConfig(**{**asdict(cfg), "repeats": args.repeats})
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    result = run_benchmarks(cfg, sections)
    path = write_json(args.out, result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
