"""The timed consumer loop every contender of ``benchmarks/peers.py`` runs in its own process.

Dependency-free, so TensorFlow's environment (``_peers_tf.py``) runs the same loop as the
torch tools (``_peers_fns.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

Build = Callable[[dict], tuple[Callable[[int], Iterator[Any]], Callable[[], None] | None]]


def consume(
    spec: dict,
    build: Build,
    rows_of: Callable[[Any], int],
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Iterates ``build(spec)`` for ``spec["duration_s"]`` after its first batch, epoch after
    epoch; returns batch times (from the start of building), ``iter_s`` (when the first
    ``iter()`` was called, on the same clock), rows per batch (``rows_of``), any error and the
    tool's ``stop``.

    ``spec["step_s"]`` emulates the training step: the consumer burns that much CPU-free time
    per batch (a wait on the clock, as a GPU step leaves the host CPU idle). When ``spec`` has
    ``out``, the file ``out + ".first"`` tells the watching parent that the timed window began.
    """
    t0 = clock()
    times: list[float] = []
    rows: list[int] = []
    error = None
    stop = None
    iter_s = None
    step_s = spec.get("step_s", 0.0)
    try:
        epoch_iter, stop = build(spec)
        epoch = 0
        deadline = float("inf")  # the timed window starts at the first batch
        while clock() < deadline:
            if iter_s is None:
                iter_s = clock() - t0
            for batch in epoch_iter(epoch):
                now = clock()
                if not times:
                    deadline = now + spec["duration_s"]
                    if "out" in spec:
                        open(spec["out"] + ".first", "w").close()
                times.append(now - t0)
                rows.append(rows_of(batch))
                if step_s:
                    time.sleep(step_s)  # stands for an accelerator step; not a wait for data
                if clock() >= deadline:
                    break
            epoch += 1
    except Exception:  # reported in the result: a crash is a benchmark outcome
        error = traceback.format_exc(limit=4)
    return {"times": times, "iter_s": iter_s, "rows": rows, "error": error, "stop": stop}


def run_child(spec_path: str, build: Build, rows_of: Callable[[Any], int], warm=None) -> int:
    """A contender process: read the spec, ``warm(spec)`` before the clock starts, consume,
    write the result (before shutdown, so a tool that hangs on shutdown still reports), stop
    the tool. Returns the exit status (3: the tool failed)."""
    with open(spec_path) as f:
        spec = json.load(f)
    if warm is not None:
        warm(spec)
    result = consume(spec, build, rows_of)
    stop = result.pop("stop")
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec["out"])
    if stop is not None:
        stop()
    return 0 if result["error"] is None else 3


def exit_now(code: int) -> None:
    """Ends a contender process whose result is on disk without interpreter teardown, where
    torchdata.nodes' prefetch thread can abort the process ("terminate called without an
    active exception"). Worker processes are killed first: skipped teardown would leave them
    holding the harness's pipes."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    sys.stdout.flush()
    os._exit(code)
