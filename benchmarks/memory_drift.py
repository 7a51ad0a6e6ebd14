"""Memory that drifts: a UDF whose per-worker cache grows, under a memory limit.

Each worker of the ``udf`` stage keeps a cache that grows by ``--grow-kib`` per item up to
``--cap-mib`` (Python objects touched by every worker, as in pytorch/pytorch#13246), so a
pipeline's memory climbs steadily while it runs. A watchdog stands for the kernel's OOM
killer: whenever the pipeline's measured memory passes ``--limit-mib`` it SIGKILLs the
pipeline's largest process. Contenders, each in its own process, side by side in interleaved
rounds:

* ``torchtune_pipe-intune`` and ``torchtune_pipe-autotune``: the Pipeline API with the tuner,
  told the same limit (``memory_limit_bytes``);
* ``dataloader-wN``: torch's DataLoader with N workers (it has no memory knob).

Measured memory is the pipeline's process tree, read by this process from ``/proc``: the
proportional set size of every descendant of the contender's process (workers, fork server,
helpers) plus the contender's own share of shared memory (``Pss_Shmem``: the arenas it maps).
For torchtune_pipe the table also compares what the pipeline reports
(``Observation.memory_used_bytes``, written by the contender at every tuning step) with that
measurement at the same moment.

Usage::

    python -m benchmarks.memory_drift --out out/memory_drift.json   # 3 rounds, ~8 minutes
    python -m benchmarks.memory_drift --quick                        # one short round
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks._common import machine_info, median, percentile, print_table, write_json

REPO = Path(__file__).resolve().parent.parent
_SAMPLE_S = 0.5
MiB = 1 << 20


# ---------------------------------------------------------------------------- the workload
class GrowingCache:
    """A feature UDF whose worker keeps ``grow_bytes`` more per item, up to ``cap_bytes``,
    and spends ``work_s`` of CPU per item. Each worker holds its own copy (picklable)."""

    def __init__(self, grow_bytes: int, cap_bytes: int, work_s: float):
        self.grow_bytes, self.cap_bytes, self.work_s = grow_bytes, cap_bytes, work_s
        self._cache: list = []
        self._held = 0

    def __getstate__(self) -> dict:
        return {"grow_bytes": self.grow_bytes, "cap_bytes": self.cap_bytes, "work_s": self.work_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __call__(self, x: int) -> Any:
        import numpy as np
        import torch

        if self._held < self.cap_bytes:
            self._cache.append(np.full(self.grow_bytes, x & 0xFF, np.uint8))  # touched pages
            self._held += self.grow_bytes
        end = time.thread_time() + self.work_s
        while time.thread_time() < end:
            pass
        return torch.full((1024,), float(x))


class _Ids:
    """Units of ``per_unit`` consecutive ids; any number of workers can share it."""

    def __init__(self, n_units: int, per_unit: int):
        self.n_units, self.per_unit = n_units, per_unit

    def __len__(self) -> int:
        return self.n_units * self.per_unit

    def units(self, epoch: int = 0) -> list[int]:
        return list(range(self.n_units))

    def read(self, unit: int) -> range:
        return range(unit * self.per_unit, (unit + 1) * self.per_unit)


class _Mapped:
    """A map-style dataset of the same items for torch's DataLoader."""

    def __init__(self, n: int, udf: GrowingCache):
        self.n, self.udf = n, udf

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.udf(i)


# ---------------------------------------------------------------------------- one contender
def _batches(spec: dict, reported: list) -> Any:
    udf = GrowingCache(spec["grow_kib"] << 10, spec["cap_mib"] << 20, spec["work_us"] / 1e6)
    n_units, per_unit = 1000, 256
    if spec["tool"] == "dataloader":
        import torch.utils.data as tud

        loader = tud.DataLoader(
            _Mapped(n_units * per_unit, udf), batch_size=spec["batch"],
            num_workers=spec["workers"], persistent_workers=True,
        )  # fmt: skip
        while True:
            yield from loader
    from torchtune_pipe import Pipeline

    pipe = (
        Pipeline.from_source(_Ids(n_units, per_unit), max_workers=4)
        .map(udf, name="udf", workers=1, max_workers=8)
        .batch(spec["batch"])
    )
    with pipe.loader(tuner=spec["tuner"], memory_limit_bytes=spec["limit_mib"] << 20) as loader:
        stop = threading.Event()

        def report() -> None:  # what the tuner saw, at every tuning step
            last = None
            while not stop.wait(0.1):
                obs = loader.tunable.meter.last if loader.tunable is not None else None
                if obs is not None and obs is not last:
                    last = obs
                    reported.append((time.time(), obs.memory_used_bytes, list(obs.workers),
                                     obs.oom))  # fmt: skip

        threading.Thread(target=report, daemon=True).start()
        try:
            while True:
                yield from loader
        finally:
            stop.set()
            probe = loader.tunable.meter.memory if loader.tunable is not None else None
            if probe is not None:
                reported.append(("probe", probe.reads, probe.mean_read_s))


def child(spec_path: str) -> None:
    """Run one contender for ``duration_s`` and write what it saw to ``spec["out"]``."""
    spec = json.loads(Path(spec_path).read_text())
    reported: list = []
    times: list[float] = []
    error = None
    t_end = time.monotonic() + spec["duration_s"]
    gen = _batches(spec, reported)
    try:
        for _ in gen:
            times.append(time.time())
            time.sleep(spec["step_s"])  # the model's step
            if time.monotonic() >= t_end:
                break
    except Exception as e:  # a killed DataLoader worker ends the run: recorded, not raised
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        gen.close()
    Path(spec["out"]).write_text(json.dumps({"times": times, "reported": reported, "error": error}))


# ---------------------------------------------------------------------------- the harness
@dataclass
class Watch:
    """What the watcher measured of one contender's tree."""

    samples: list = field(default_factory=list)  # (time, pipeline bytes)
    kills: list = field(default_factory=list)  # (seconds since start, pid, bytes)


def pipeline_bytes(root: int) -> tuple[int, dict[int, int]]:
    """The pipeline's memory under ``root``: every descendant's PSS plus ``root``'s share of
    shared memory; and each descendant's PSS."""
    from torchtune_pipe.telemetry.memory import smaps_rollup

    try:
        kids = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, {}
    each = {}
    for p in kids:
        fields = smaps_rollup(p.pid)
        if fields is not None:
            each[p.pid] = fields.get("Pss", 0)
    own = smaps_rollup(root) or {}
    return sum(each.values()) + own.get("Pss_Shmem", 0), each


def _watch(proc: subprocess.Popen, limit: int, done: threading.Event, out: Watch) -> None:
    t0 = time.monotonic()
    while not done.wait(_SAMPLE_S):
        total, each = pipeline_bytes(proc.pid)
        if not each:
            continue
        out.samples.append((time.time(), total))
        if total > limit:  # the kernel's OOM killer: the largest process goes
            pid = max(each, key=each.__getitem__)
            try:
                os.kill(pid, signal.SIGKILL)
                out.kills.append((round(time.monotonic() - t0, 1), pid, total))
            except ProcessLookupError:
                pass


def _tracking(reported: list, samples: list) -> dict:
    """Reported memory against the measurement closest in time (within one sample)."""
    errors = []
    for row in reported:
        if row[0] == "probe":
            continue
        t, used = row[0], row[1]
        near = min(samples, key=lambda s: abs(s[0] - t), default=None)
        if near is not None and abs(near[0] - t) <= _SAMPLE_S and near[1] > 0:
            errors.append((used - near[1]) / near[1])
    if not errors:
        return {}
    abs_err = sorted(abs(e) for e in errors)
    return {
        "track_err_median": median(abs_err),
        "track_err_p90": percentile(abs_err, 90),
        "track_bias_median": median(errors),
        "track_pairs": len(errors),
    }


def run_one(label: str, spec: dict, workdir: str) -> dict:
    """One contender in a child process, watched; its measurements."""
    out_path = os.path.join(workdir, f"{label}-{time.monotonic_ns()}.json")
    spec = dict(spec, out=out_path)
    spec_path = out_path + ".spec"
    Path(spec_path).write_text(json.dumps(spec))
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.memory_drift", "--child", spec_path], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watch, done = Watch(), threading.Event()
    limit = spec["limit_mib"] << 20
    watcher = threading.Thread(target=_watch, args=(proc, limit, done, watch), daemon=True)
    watcher.start()
    try:
        _, err = proc.communicate(timeout=spec["duration_s"] + 120)
    except subprocess.TimeoutExpired:
        for p in reversed(psutil.Process(proc.pid).children(recursive=True)):
            p.kill()
        proc.kill()
        _, err = proc.communicate()
    done.set()
    watcher.join()
    result = {"times": [], "reported": [], "error": f"no result: {(err or '')[-300:]}"}
    if os.path.exists(out_path):
        result = json.loads(Path(out_path).read_text())
    times = result["times"]
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    probe = next((r for r in result["reported"] if r[0] == "probe"), None)
    first_over = next((t for t, b in watch.samples if b > limit), None)
    start = watch.samples[0][0] if watch.samples else None
    row = {
        "label": label,
        "batches_per_s": (len(times) - 1) / span if span > 0 else 0.0,
        "batches": len(times),
        "kills": len(watch.kills),
        "peak_mib": max((b for _, b in watch.samples), default=0) / MiB,
        "limit_mib": spec["limit_mib"],
        "first_over_s": round(first_over - start, 1) if first_over and start else None,
        "error": result["error"],
        "kill_log": watch.kills,
        "workers_last": next((r[2] for r in reversed(result["reported"]) if r[0] != "probe"), None),
        "oom_reported": sum(1 for r in result["reported"] if r[0] != "probe" and r[3]),
        "probe_reads": probe[1] if probe else None,
        "probe_read_ms": probe[2] * 1e3 if probe else None,
    }
    row.update(_tracking(result["reported"], watch.samples))
    return row


def main(argv: list[str] | None = None) -> int:
    """Run every contender ``--rounds`` times, interleaved; print a table, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="one short round (smoke test)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per contender")
    ap.add_argument("--limit-mib", type=int, default=700)
    ap.add_argument("--cap-mib", type=int, default=240, help="cache a udf worker reaches")
    ap.add_argument("--grow-kib", type=int, default=16, help="cache growth per item")
    ap.add_argument("--work-us", type=int, default=300, help="CPU per item in the udf")
    ap.add_argument("--dataloader-workers", type=int, default=4)
    ap.add_argument("--out", default="out/memory_drift.json")
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if args.quick:
        args.rounds, args.duration = 1, min(args.duration, 20.0)
    base = {
        "duration_s": args.duration, "limit_mib": args.limit_mib, "cap_mib": args.cap_mib,
        "grow_kib": args.grow_kib, "work_us": args.work_us, "batch": 32, "step_s": 0.002,
    }  # fmt: skip
    w = args.dataloader_workers
    contenders = {
        "torchtune_pipe-intune": dict(tool="torchtune_pipe", tuner="intune"),
        "torchtune_pipe-autotune": dict(tool="torchtune_pipe", tuner="autotune"),
        f"dataloader-w{w}": dict(tool="dataloader", workers=w),
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory_drift_") as workdir:
        for r in range(args.rounds):  # interleaved: slow drift of the machine hits everyone
            for label, extra in contenders.items():
                row = run_one(label, dict(base, **extra), workdir)
                row["round"] = r
                rows.append(row)
                print(f"round {r} {label}: {row['batches_per_s']:.1f} batches/s, "
                      f"{row['kills']} kills, peak {row['peak_mib']:.0f} MiB", flush=True)  # fmt: skip
    summary = []
    for label in contenders:
        mine = [x for x in rows if x["label"] == label]
        rates = [x["batches_per_s"] for x in mine]
        track = [x["track_err_median"] for x in mine if "track_err_median" in x]
        summary.append({
            "label": label,
            "batches_per_s": median(rates),
            "spread": f"{min(rates):.1f}-{max(rates):.1f}",
            "kills": sum(x["kills"] for x in mine),
            "peak_mib": max(x["peak_mib"] for x in mine),
            "first_over_s": min((x["first_over_s"] for x in mine if x["first_over_s"]),
                                default=None),
            "track_err": median(track) if track else None,
            "track_err_p90": max((x["track_err_p90"] for x in mine if "track_err_p90" in x),
                                 default=None),
            "probe_read_ms": median([x["probe_read_ms"] for x in mine if x["probe_read_ms"]])
            if any(x["probe_read_ms"] for x in mine) else None,
            "errors": sum(1 for x in mine if x["error"]),
        })  # fmt: skip
    print_table(summary, ["label", "batches_per_s", "spread", "kills", "peak_mib",
                          "first_over_s", "track_err", "track_err_p90", "probe_read_ms",
                          "errors"])  # fmt: skip
    path = write_json(args.out, {"machine": machine_info(), "args": vars(args),
                                 "summary": summary, "runs": rows})  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
