"""The single measurements behind ``benchmarks.executor``: each builds one executor (or one
peer loader), runs it, and returns rates and CPU accounting. Stage functions live in
``_bench_fns`` so worker processes can import them."""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import torch.multiprocessing as tmp

from multiproc import Executor, ExecutorSpec, StageSpec

from . import _bench_fns as fns
from ._common import CpuWindow, SteadyClock, usable_cores

MiB = 1 << 20


def _drain(it, clock: SteadyClock, check: Callable[[object], None] | None = None) -> int:
    n = 0
    for x in it:
        if check is not None and n == 0:
            check(x)
        n += 1
        clock.tick()
        del x  # drop the reference now: executor frames are released when it goes
    return n


def _expect(what: str, got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(f"{what}: received {got} items, expected {want}")


# ---------------------------------------------------------------- (a) bandwidth
def _check_batch(b) -> None:
    if not isinstance(b, dict) or b["dense"].shape[1] != fns.DENSE_FEATURES:
        raise RuntimeError(f"bandwidth: malformed batch {type(b).__name__}")


def _worker_pids(ex: Executor) -> list[int]:
    snap = ex.snapshot(per_worker=True)
    return [w.pid for s in snap.stages for w in s.per_worker if w.pid]


def executor_bandwidth(
    n_batches: int,
    rows: int,
    relay: bool = False,
    torch_threads: int | None = None,
    warm_batches: int = 28,
) -> dict:
    """Fresh batches from one source worker to this process: GB/s and CPU ms per batch.

    Args:
        relay: pass them through an identity map stage too (one more hop, one more copy).
        torch_threads: intra-op threads per worker; None keeps StageSpec's default.
        warm_batches: batches held at once before timing (fills the arena once).
    """
    kw = {} if torch_threads is None else {"torch_threads": torch_threads}
    stages = [
        StageSpec("batches", "source", fns.dlrm_batches, frame_items=1, buffer_bytes=64 * MiB, **kw)
    ]
    if relay:
        stages.append(StageSpec("relay", "map", fns.identity, buffer_bytes=64 * MiB, **kw))
    per_unit = 4
    units = [(per_unit, rows)] * max(1, n_batches // per_unit)
    n = per_unit * len(units)
    with Executor(ExecutorSpec(tuple(stages), name="bench_bw")) as ex:
        # Warm-up: hold nearly a budget's worth of batches at once, so every arena page has
        # been written once (steady state: a fresh arena page-faults on each 4 KiB first use).
        warm = min(warm_batches, 64 * MiB // fns.batch_nbytes(rows) - 4)
        held = list(ex.run([(warm, rows)]))
        _expect("executor bandwidth warm-up", len(held), warm)
        del held
        clock = SteadyClock(n)
        cpu = CpuWindow(_worker_pids(ex))
        _expect("executor bandwidth", _drain(ex.run(units), clock, _check_batch), n)
        used = cpu.stop()
    return {
        "gbps": clock.rate() * fns.batch_nbytes(rows) / 1e9,
        "producer_cpu_ms_per_batch": used["procs_cpu_s"] / n * 1e3,
        "consumer_cpu_ms_per_batch": used["self_cpu_s"] / n * 1e3,
        "machine_busy_cores": used["machine_busy_cores"],
    }


def queue_bandwidth(n_batches: int, rows: int) -> dict:
    """The same batches from one producer process over torch.multiprocessing.Queue (torch's
    default sharing strategy; at most 32 batches, 64 MiB, queued): GB/s and CPU ms per batch."""
    ctx = tmp.get_context("forkserver")
    q = ctx.Queue(maxsize=32)
    done = ctx.Event()
    p = ctx.Process(target=fns.queue_producer, args=(q, done, n_batches, rows), daemon=True)
    p.start()
    clock = SteadyClock(n_batches)
    n = 0
    try:
        cpu = CpuWindow([p.pid])
        while True:
            b = q.get(timeout=60.0)
            if b is None:
                break
            if n == 0:
                _check_batch(b)
            n += 1
            clock.tick()
            del b
        used = cpu.stop()
    finally:
        done.set()
        p.join(10.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
        q.close()
    _expect("queue bandwidth", n, n_batches)
    # The producer's CPU includes its start-up (imports are preloaded by the fork server).
    return {
        "gbps": clock.rate() * fns.batch_nbytes(rows) / 1e9,
        "producer_cpu_ms_per_batch": used["procs_cpu_s"] / n * 1e3,
        "consumer_cpu_ms_per_batch": used["self_cpu_s"] / n * 1e3,
        "machine_busy_cores": used["machine_busy_cores"],
    }


def producer_only_bandwidth(n_batches: int, rows: int) -> dict:
    """Making fresh batches in this process, nothing transferred: the producer's ceiling."""
    fns.dlrm_batch(rows)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n_batches):
        b = fns.dlrm_batch(rows)
        del b
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {
        "gbps": n_batches * fns.batch_nbytes(rows) / wall / 1e9,
        "producer_cpu_ms_per_batch": cpu / n_batches * 1e3,
        "consumer_cpu_ms_per_batch": 0.0,
    }


# ---------------------------------------------------------------- (b) tiny items
TINY_WORKERS = 3  # one per stage of the executor; the baselines get the same count


def executor_tiny(n: int, unit: int) -> float:
    """Items/s of ints through source -> map -> map, one worker each, default framing."""
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", fns.int_range),
            StageSpec("a", "map", fns.add_one),
            StageSpec("b", "map", fns.add_one),
        ),
        name="bench_tiny",
    )
    units = [(lo, min(lo + unit, n)) for lo in range(0, n, unit)]
    with Executor(spec) as ex:
        _expect("executor tiny warm-up", sum(1 for _ in ex.run([(0, 256)])), 256)
        clock = SteadyClock(n)
        total = 0
        for x in ex.run(units):
            total += x
            clock.tick()
    if total != n * (n - 1) // 2 + 2 * n:
        raise RuntimeError(f"executor tiny: wrong sum {total}")
    return clock.rate()


def parallel_mapper_tiny(n: int, workers: int) -> float:
    """Items/s through torchdata.nodes.ParallelMapper(method='process'), unordered."""
    from torchdata.nodes import IterableWrapper, ParallelMapper

    node = ParallelMapper(
        IterableWrapper(range(n)),
        fns.add_two,
        num_workers=workers,
        method="process",
        in_order=False,
    )
    clock = SteadyClock(n)
    try:
        got = _drain(node, clock)
    finally:
        del node  # it has no close(); dropping it stops and joins its workers
    _expect("ParallelMapper tiny", got, n)
    return clock.rate()


def dataloader_tiny(n: int, workers: int) -> float:
    """Items/s through DataLoader over a map-style dataset of n ints, batch_size=None."""
    from torch.utils.data import DataLoader

    clock = SteadyClock(n)
    with warnings.catch_warnings():  # more workers than cores is this comparison's premise
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        dl = DataLoader(fns.ChainDataset(n), batch_size=None, num_workers=workers, in_order=False)
        _expect("DataLoader tiny", _drain(iter(dl), clock), n)
    return clock.rate()


# ---------------------------------------------------------------- (c) CPU efficiency
def allocate_workers(costs: Sequence[float], cores: int) -> tuple[int, ...]:
    """Workers per stage proportional to per-item cost, at least one each, summing to
    ``cores`` (or to the stage count when there are fewer cores than stages).

    Raises:
        ValueError: a cost is not positive, or cores < 1.
    """
    if cores < 1 or not costs or any(c <= 0 for c in costs):
        raise ValueError(
            f"allocate_workers: need cores >= 1 and positive costs, got {cores}, {costs}"
        )
    total = max(cores, len(costs))
    ideal = [total * c / sum(costs) for c in costs]
    got = [max(1, int(x)) for x in ideal]
    while sum(got) > total:  # the floor of one worker overshot: shrink the largest
        got[max(range(len(got)), key=lambda i: got[i])] -= 1
    by_remainder = sorted(range(len(costs)), key=lambda i: ideal[i] - got[i], reverse=True)
    for i in by_remainder[: total - sum(got)]:
        got[i] += 1
    return tuple(got)


def executor_cpu(n: int, stage_s: Sequence[float], workers: Sequence[int]) -> dict:
    """A CPU-bound source -> map -> map pipeline: steady items/s and where the CPU went."""
    src_s, a_s, b_s = stage_s
    spec = ExecutorSpec(
        (
            StageSpec(
                "read", "source", functools.partial(fns.cpu_source, cpu_s=src_s), workers=workers[0]
            ),
            StageSpec(
                "udf_a", "map", functools.partial(fns.cpu_map, cpu_s=a_s), workers=workers[1]
            ),
            StageSpec(
                "udf_b", "map", functools.partial(fns.cpu_map, cpu_s=b_s), workers=workers[2]
            ),
        ),
        name="bench_cpu",
    )
    unit = 256
    units = [(lo, min(lo + unit, n)) for lo in range(0, n, unit)]
    with Executor(spec) as ex:
        _expect("executor cpu warm-up", sum(1 for _ in ex.run([(0, 64)])), 64)
        clock = SteadyClock(n)
        cpu = CpuWindow(_worker_pids(ex))
        _expect("executor cpu", _drain(ex.run(units), clock), n)
        used = cpu.stop()
    ours = used["procs_cpu_s"] + used["self_cpu_s"]
    return {
        "items_per_s": clock.rate(),
        # Cores this pipeline obtained (workers + consumer/router), and how much of that CPU
        # was stage work: low share with a busy machine means other load, not the executor.
        "cpu_share": ours / used["wall_s"] / usable_cores(),
        "useful_cpu_fraction": n * sum(stage_s) / ours if ours else float("nan"),
        "worker_overhead_ms_per_item": (used["procs_cpu_s"] / n - sum(stage_s)) * 1e3,
        "main_process_cpu_ms_per_item": used["self_cpu_s"] / n * 1e3,
        "machine_busy_cores": used["machine_busy_cores"],
    }


# ---------------------------------------------------------------- (d) start latency
def _wait_started(ex: Executor, count: int, timeout_s: float = 20.0) -> None:
    # The executor exposes no "worker ready" event; poll with a deadline. The latency itself
    # is stamped by the executor (start request -> first message), not by this loop.
    deadline = time.monotonic() + timeout_s
    while len(ex.start_latencies_ms()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"start latency: {count} workers not started in {timeout_s} s")
        time.sleep(0.0005)


def executor_start_latency(n_start: int, loaded: bool) -> dict:
    """Start ``n_start`` workers on a warm executor, one or two per ``resize`` (retired again
    after each step, so the worker count stays near the core count, as a tuner keeps it);
    ``loaded``: while a CPU-bound run keeps the machine busy."""
    spec = ExecutorSpec(
        (
            StageSpec("read", "source", fns.int_range, max_workers=4),
            StageSpec("udf", "map", functools.partial(fns.cpu_map, cpu_s=2e-4), max_workers=3),
        ),
        name="bench_start",
    )
    observed = []
    with Executor(spec) as ex:
        _expect("executor start warm-up", sum(1 for _ in ex.run([(0, 64)])), 64)
        stop = threading.Event()
        consumer = None
        if loaded:
            units = [(lo, lo + 256) for lo in range(0, 10_000_000, 256)]

            def consume() -> None:
                for _ in ex.run(units):
                    if stop.is_set():
                        break

            consumer = threading.Thread(target=consume, name="bench-consumer", daemon=True)
            consumer.start()
        n0 = len(ex.start_latencies_ms())
        started, step = 0, 1
        try:
            while started < n_start:
                k = min(step, n_start - started)
                t0 = time.perf_counter()
                ex.resize("udf", 1 + k)
                _wait_started(ex, n0 + started + k)
                observed.append((time.perf_counter() - t0) * 1e3)
                ex.resize("udf", 1)
                started += k
                step = 3 - step  # 1, 2, 1, 2, ...
            lat = ex.start_latencies_ms()[n0:]
        finally:
            stop.set()
            if consumer is not None:
                consumer.join(10.0)
    return {"latencies_ms": lat, "resize_to_ready_ms": observed}
