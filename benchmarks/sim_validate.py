"""Does the simulator predict real pipelines? Fit it from one profiling run, then compare.

For each recipe of :mod:`_real_fns` the script starts the pipeline once and:

1. **Profiles** it at one allocation (``--profile-workers``, default one worker per stage):
   after ``--settle`` seconds it takes two executor snapshots ``--profile`` seconds apart and
   fits, per stage, ``cpu_s_per_item = d(cpu_ns) / d(items_in)`` and ``io_s_per_item`` =
   (worker time not blocked on channels - CPU time) per item, plus bytes per output item.
   Each worker's run-queue delay (``/proc/<pid>/schedstat``) over the same window separates
   waiting from being descheduled: a stage whose CPU time is at least half its busy time less
   that delay is CPU-bound and gets no I/O time. The main process's own CPU time per
   delivered item (router thread, consumer) becomes a final one-worker ``prefetch`` stage,
   because on two cores it competes with the stage workers.
   Contention among the pipeline's own processes is the simulator's job (processor
   sharing); CPU time the rest of the machine used over the window (``/proc/stat`` busy time
   less the pipeline's) is taken off the simulated CPU count.
2. **Builds** a :class:`~torchtune_pipe.sim.model.Workload` from those costs and asks a
   noiseless :class:`~torchtune_pipe.sim.model.SimPipeline` (``cpus`` = this process's CPU
   affinity) for the steady-state throughput of each allocation in ``ALLOCATIONS``.
3. **Measures** the same allocations on the live pipeline (``executor.resize``, then
   ``--settle`` seconds to settle and ``--measure`` seconds counted at the consumer).

Reported: simulated and measured throughput (pipeline outputs per second: batches for a
batching pipeline), the absolute percentage error of each allocation, and the median absolute
percentage error (MdAPE) per pipeline and overall.

``--threads`` runs the thread case instead: one map stage on every core, as processes and as
threads of this process (``StageSpec(worker_type=...)``), on a pure-Python function and on
``zlib.compress`` (which releases the interpreter lock), against the simulator's ratio of the
two kinds with ``gil_share`` priors of 1 and 0.05 and this process's own CPU per item as the
consumer's share of the lock.

Run: ``.venv/bin/python benchmarks/sim_validate.py --out sim_validate.json``; ``--quick`` for
a smoke test.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

import _real_fns  # noqa: E402
from _common import machine_info, write_json  # noqa: E402
from tuners_real import table  # noqa: E402

from multiproc import Executor, ExecutorSpec, Snapshot, StageSpec  # noqa: E402
from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload  # noqa: E402
from torchtune_pipe.tuning.base import Allocation, waits_on_io  # noqa: E402

log = logging.getLogger("sim_validate")

ALLOCATIONS: tuple[tuple[int, int, int], ...] = (
    (1, 1, 1),
    (2, 1, 1),
    (1, 1, 2),
    (3, 1, 1),
    (1, 1, 3),
    (2, 1, 2),
)


def run_delay_ns(snapshot: Snapshot) -> list[int]:
    """Per stage, nanoseconds its live workers spent runnable but waiting for a CPU.

    Read from ``/proc/<pid>/schedstat`` (second field); 0 where the kernel does not export it.
    """
    out = []
    for st in snapshot.stages:
        total = 0
        for w in st.per_worker:
            try:
                with open(f"/proc/{w.pid}/schedstat", encoding="ascii") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a worker that already exited, or no schedstat
        out.append(total)
    return out


def fit_stages(
    recipe: _real_fns.Recipe,
    kinds: Sequence[str],
    prev: Snapshot,
    cur: Snapshot,
    delays: tuple[Sequence[int], Sequence[int]],
    main_cpu_s: float,
    ratios: Sequence[float],
) -> tuple[list[StageModel], list[dict]]:
    """Stage models from two snapshots of one profiling run, and the fitted numbers.

    I/O time is busy time minus CPU time minus run-queue delay (``delays``: the
    :func:`run_delay_ns` of each snapshot, read right after it).
    """
    delay0, delay1 = delays
    models, fitted = [], []
    for i, (p, c) in enumerate(zip(prev.stages, cur.stages, strict=True)):
        items_in = max(1, c.items_in - p.items_in)
        items_out = max(1, c.items_out - p.items_out)
        busy_s = max(0, c.busy_ns - p.busy_ns) / 1e9 / items_in
        cpu_s = max(0, c.cpu_ns - p.cpu_ns) / 1e9 / items_in
        wait_s = max(0, delay1[i] - delay0[i]) / 1e9 / items_in
        # A waiting stage keeps its wake-up delays (they lengthen every wait it makes); a
        # computing stage's run-queue delay is CPU it did not get, charged below via share.
        cpu_bound = not waits_on_io(cpu_s, max(busy_s - wait_s, 1e-12))  # telemetry's rule
        # A waiting stage's wait is read from its workers' whole lives (less the time blocked
        # on the channels), not only from busy time: a source waits before its first item too.
        active_ns = c.worker_ns - p.worker_ns
        active_ns -= (c.blocked_in_ns - p.blocked_in_ns) + (c.blocked_out_ns - p.blocked_out_ns)
        io_s = 0.0 if cpu_bound else max(0.0, max(busy_s, active_ns / 1e9 / items_in) - cpu_s)
        nbytes = max(1, (c.bytes_out - p.bytes_out) // items_out)
        models.append(
            StageModel(
                name=c.name,
                kind=kinds[i],
                cpu_s_per_item=max(cpu_s, 1e-7),
                io_s_per_item=io_s,
                ratio=ratios[i],
                bytes_per_item=int(nbytes),
                cpu_cv=0.2,
                max_workers=_real_fns.MAX_WORKERS,
            )
        )
        fitted.append(
            {
                "stage": c.name,
                "items_in": items_in,
                "busy_ms": busy_s * 1e3,
                "cpu_ms": cpu_s * 1e3,
                "runqueue_ms": wait_s * 1e3,
                "io_ms": io_s * 1e3,
                "bytes_per_item": int(nbytes),
            }
        )
    # The last stage's items, not the executor's deliveries (those count the end marks too).
    delivered = max(1, cur.stages[-1].items_out - prev.stages[-1].items_out)
    main_s = main_cpu_s / delivered
    models.append(StageModel("main", "prefetch", max(main_s, 1e-7), max_workers=1))
    fitted.append({"stage": "main", "items_in": delivered, "cpu_ms": main_s * 1e3})
    return models, fitted


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent not idle (``/proc/stat``; 0 if unreadable)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pipeline_cpu_s(prev: Snapshot, cur: Snapshot, main_cpu_s: float) -> float:
    """CPU seconds the pipeline's workers and its main process used between two snapshots."""
    workers = sum(max(0, c.cpu_ns - p.cpu_ns) for p, c in zip(prev.stages, cur.stages, strict=True))
    return workers / 1e9 + main_cpu_s


def _set(ex: Any, workers: Sequence[int]) -> None:
    for i, n in enumerate(workers):
        if ex.workers(i) != n:
            ex.resize(i, n)


def _consume(it: Iterator[Any], seconds: float) -> int:
    """Take items for ``seconds``; returns how many arrived."""
    end, n = time.perf_counter() + seconds, 0
    for _ in it:
        n += 1
        if time.perf_counter() >= end:
            break
    return n


def validate(
    recipe: _real_fns.Recipe,
    allocations: Sequence[tuple[int, ...]],
    profile_workers: Sequence[int],
    settle_s: float,
    profile_s: float,
    measure_s: float,
) -> dict:
    """Profile, fit, simulate and measure one recipe."""
    pipe = recipe.build(profile_workers)
    kinds = [s.kind for s in pipe.stages]  # one vocabulary (multiproc.spec.PipelineKind)
    ratios = [float(s.size) if s.kind == "batch" else 1.0 for s in pipe.stages]
    buffers = [s.buffer_bytes for s in pipe.stages]
    cpus = len(os.sched_getaffinity(0))
    measured = []
    with pipe.loader(timeout_s=60.0) as loader:
        it = iter(loader)
        next(it)
        ex = loader.tunable.executor
        _consume(it, settle_s)
        prev, c0 = ex.snapshot(per_worker=True), time.process_time()
        m0, t0 = machine_busy_s(), time.perf_counter()
        d0 = run_delay_ns(prev)
        _consume(it, profile_s)
        cur, c1 = ex.snapshot(per_worker=True), time.process_time()
        m1, t1 = machine_busy_s(), time.perf_counter()
        d1 = run_delay_ns(cur)
        models, fitted = fit_stages(recipe, kinds, prev, cur, (d0, d1), c1 - c0, ratios)
        # Cores the rest of the machine kept busy while profiling: not the pipeline's to use.
        others = max(0.0, (m1 - m0) - pipeline_cpu_s(prev, cur, c1 - c0)) / max(t1 - t0, 1e-9)
        fitted.append({"stage": "other_load", "cores": others})
        for w in allocations:
            _set(ex, w)
            _consume(it, settle_s)
            t0 = time.perf_counter()
            n = _consume(it, measure_s)
            measured.append(n / (time.perf_counter() - t0))
    workload = Workload(recipe.name, tuple(models), worker_start_s=0.0)
    sim_cpus = max(0.5, cpus - others)
    sim = SimPipeline(workload, cpus=sim_cpus, memory_limit_bytes=1 << 40, noise=0.0)
    rows = []
    for w, real in zip(allocations, measured, strict=True):
        alloc = Allocation(tuple(w) + (1,), tuple(buffers) + (buffers[-1],))
        predicted = sim.evaluate(alloc)
        ape = abs(predicted - real) / real if real > 0 else None
        rows.append({"workers": str(list(w)), "measured": real, "simulated": predicted, "ape": ape})
    apes = [r["ape"] for r in rows if r["ape"] is not None]
    return {
        "cpus": cpus,
        "sim_cpus": sim_cpus,
        "profile_workers": list(profile_workers),
        "fitted": fitted,
        "rows": rows,
        "mdape": statistics.median(apes) if apes else None,
    }


def _pure_python(x: int) -> int:
    total = 0
    for k in range(20_000):
        total += (x ^ k) & 7
    return total


_BLOB = (bytes(range(256)) * 64 + os.urandom(4096)) * 16


def _compress(x: int) -> int:
    return len(zlib.compress(_BLOB, 6))


def _read(unit: int) -> range:
    return range(unit * 64, unit * 64 + 64)


def _sample(ex: Executor) -> tuple[Snapshot, float, float, float]:
    return ex.snapshot(), machine_busy_s(), time.process_time(), time.perf_counter()


def thread_case(fn: Any, gil_share: float, settle_s: float, measure_s: float) -> dict:
    """Items per second of one map on every core, as processes and as threads, measured and
    simulated (on the cores the rest of the machine left); the main process's CPU per item
    (process run) is the consumer's share of the lock."""
    cpus = len(os.sched_getaffinity(0))
    t0 = time.process_time()
    for i in range(20):
        fn(i)
    cpu_s = (time.process_time() - t0) / 20
    rates, others, main_s = {}, [], 0.0
    for kind in ("process", "thread"):
        work = StageSpec("work", "map", fn, workers=cpus, worker_type=kind)
        with Executor(ExecutorSpec((StageSpec("read", "source", _read), work))) as ex:
            it = ex.run(range(100_000))
            _consume(it, settle_s)
            (s0, m0, c0, t0), n = _sample(ex), _consume(it, measure_s)
            s1, m1, c1, t1 = _sample(ex)
        # CPU of the worker processes; the thread workers' is this process's own.
        procs_s = sum((b.cpu_ns - b.thread_cpu_ns) - (a.cpu_ns - a.thread_cpu_ns)
                      for a, b in zip(s0.stages, s1.stages, strict=True)) / 1e9  # fmt: skip
        others.append(max(0.0, m1 - m0 - (c1 - c0) - procs_s) / (t1 - t0))
        rates[kind] = n / (t1 - t0)
        main_s = main_s or (c1 - c0) / max(1, n)  # the process run's: the consumer's own
    stages = (
        StageModel("read", "source", 2e-6, max_workers=1),
        StageModel("work", "map", cpu_s, gil_share=gil_share, threadable=True),
        StageModel("main", "prefetch", max(main_s, 1e-7), max_workers=1),
    )
    wl = Workload(fn.__name__, stages, worker_start_s=0.0, consumer_gil_s_per_item=main_s)
    # Each kind on the cores the rest of the machine left it while it ran.
    sim_cpus = [max(0.5, cpus - o) for o in others]
    sim = SimPipeline(wl, cpus=cpus, memory_limit_bytes=1 << 40, noise=0.0)
    procs = Allocation((1, cpus, 1), (16 << 20,) * 3, threads=(0, 0, 0))
    threads = sim.evaluate(procs.replace(threads=(0, cpus, 0)), cpus=sim_cpus[1])
    simulated = threads / sim.evaluate(procs, cpus=sim_cpus[0])
    measured = rates["thread"] / rates["process"]
    print(f"{fn.__name__}: cpu {cpu_s * 1e3:.2f} ms/item, main {main_s * 1e3:.3f} ms/item, "
          f"other load {others[0]:.2f}/{others[1]:.2f} cores; processes "
          f"{rates['process']:.0f}/s, threads {rates['thread']:.0f}/s; threads/processes "
          f"measured {measured:.2f}, simulated {simulated:.2f}", flush=True)  # fmt: skip
    return {"cpu_s": cpu_s, "main_s": main_s, "sim_cpus": sim_cpus, "rates": rates,
            "measured": measured, "simulated": simulated, "gil_share": gil_share}  # fmt: skip


COLUMNS = (
    ("workers", "workers", "s"),
    ("measured", "measured/s", ".1f"),
    ("simulated", "simulated/s", ".1f"),
    ("ape", "abs % err", ".1%"),
)


def main(argv: Sequence[str] | None = None) -> dict:
    """Entry point: validate every recipe, print the tables, write ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settle", type=float, default=1.0, help="seconds before each measurement")
    p.add_argument("--profile", type=float, default=3.0, help="profiling window, s")
    p.add_argument("--measure", type=float, default=2.5, help="measurement per allocation, s")
    p.add_argument("--profile-workers", type=int, nargs="*", default=[1, 1, 1])
    p.add_argument("--pipelines", nargs="*", help=f"subset of {list(_real_fns.recipes())}")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (< 30 s)")
    p.add_argument("--threads", action="store_true", help="the thread case, not the recipes")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.threads:
        cases = ((_pure_python, 1.0), (_compress, 0.05))
        found = {fn.__name__: thread_case(fn, g, args.settle, args.measure) for fn, g in cases}
        out = {"machine": machine_info(), "threads": found}
        if args.out:
            write_json(args.out, out)
        return out
    allocations = ALLOCATIONS
    if args.quick:
        args.settle, args.profile, args.measure = 0.3, 0.75, 0.5
        args.pipelines = args.pipelines or ["remote_read"]
        allocations = ALLOCATIONS[:2]
    recipes = _real_fns.recipes(0.25 if args.quick else 1.0)
    result: dict = {"machine": machine_info(), "pipelines": {}}
    for name in args.pipelines or list(recipes):
        res = validate(
            recipes[name],
            allocations,
            args.profile_workers,
            args.settle,
            args.profile,
            args.measure,
        )
        result["pipelines"][name] = res
        fit = ", ".join(
            f"{f['stage']}: cpu {f['cpu_ms']:.3f} io {f.get('io_ms', 0.0):.3f} ms"
            for f in res["fitted"]
            if "cpu_ms" in f
        )
        fit += f"; other load {res['fitted'][-1]['cores']:.2f} cores"
        print(f"\n== {name}  fitted per input item: {fit}")
        print(table(res["rows"], COLUMNS))
        print(f"MdAPE {res['mdape']:.1%}", flush=True)
    apes = [r["ape"] for res in result["pipelines"].values() for r in res["rows"] if r["ape"]]
    result["mdape"] = statistics.median(apes) if apes else None
    result["load_avg_1m_end"] = os.getloadavg()[0]
    if result["mdape"] is not None:
        print(f"\noverall MdAPE {result['mdape']:.1%} over {len(apes)} allocations")
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
