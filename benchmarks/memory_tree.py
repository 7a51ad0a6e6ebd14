"""Where a contender's memory goes: its process tree at its peak, process by process.

Runs contenders of the execution-shape scenarios of ``benchmarks/peers.py`` (``remote-map``,
``cheap-map``, ``fusion``: the same child processes, ``benchmarks/_mapstyle_fns.py``) in
interleaved rounds and samples every process of each contender's tree from ``/proc/<pid>/
smaps_rollup`` every 0.25 s. At the sample where the tree's proportional set size (PSS) peaks
it records each process's role (``consumer``, ``fork server``, ``resource tracker``,
``worker``), its PSS, the part of it that is shared memory (``Pss_Shmem``: arenas and the file
of stage arrays, ``multiproc.buffers``) and its private dirty pages (what only it holds).
Our drop-in also runs at fixed worker counts (in ``remote-map``, a Pipeline of fixed shape:
fetch workers with 64 reads in flight each, one collate worker): the one of our settings with
the smallest peak that still makes nodes' rows/s is the footprint at the same throughput
(``at_nodes_rate``).

Usage::

    python -m benchmarks.memory_tree --out benchmarks/results/memory_tree.json   # ~2 minutes
    python -m benchmarks.memory_tree --scenarios cheap-map --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from ._peers_shape import SCENARIOS

REPO = Path(__file__).resolve().parent.parent
SAMPLE_S = 0.25
# (label, tool of _mapstyle_fns, workers; -1 is num_workers="auto"): ours, nodes at the
# setting its sweep picks in each scenario (threads: one process), then our drop-in at fixed
# worker counts, for the footprint at nodes' rows/s (``at_nodes_rate``; in remote-map, where
# a fixed count runs one read at a time per worker, 250 rows/s each: a Pipeline of fixed
# shape, 1 or 2 fetch workers at 64 reads in flight each and one collate worker).
CONTENDERS = {
    "remote-map": (("torchtune_pipe-auto", "torchtune_pipe", -1),
                   ("nodes-thread-w64", "nodes-thread", 64),
                   ("torchtune_pipe-f1c1", "torchtune_pipe-shape", 1),
                   ("torchtune_pipe-f2c1", "torchtune_pipe-shape", 2)),
    "cheap-map": (("torchtune_pipe-auto", "torchtune_pipe", -1),
                  ("nodes-thread-w0", "nodes-thread", 0),
                  ("torchtune_pipe-w1", "torchtune_pipe", 1),
                  ("torchtune_pipe-w2", "torchtune_pipe", 2)),
    "fusion": (("torchtune_pipe-intune", "torchtune_pipe-maps", -1),
               ("nodes-thread-w0", "nodes-thread", 0),
               ("torchtune_pipe-w1", "torchtune_pipe", 1),
               ("torchtune_pipe-w2", "torchtune_pipe", 2)),
}  # fmt: skip


def _rollup(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _role(p: psutil.Process, root: int) -> str:
    if p.pid == root:
        return "consumer"
    cmd = " ".join(p.cmdline())
    if "resource_tracker" in cmd:
        return "resource tracker"
    return "fork server" if p.ppid() == root else "worker"


def run_one(scenario: str, tool: str, workers: int, duration_s: float, workdir: str) -> dict:
    """One contender's run: its rows/s and its tree at the peak."""
    out = str(Path(workdir) / f"{tool}-{time.monotonic_ns()}.json")
    spec = dict(SCENARIOS[scenario], duration_s=duration_s, tool=tool, workers=workers,
                tuner=None, out=out)  # fmt: skip
    with open(out + ".spec", "w") as f:
        json.dump(spec, f)
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks._mapstyle_fns", out + ".spec"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    peak, at = 0, []
    while proc.poll() is None:
        time.sleep(SAMPLE_S)
        try:
            root = psutil.Process(proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        rows = []
        for p in procs:
            try:
                r = _rollup(p.pid)
                rows.append(dict(role=_role(p, proc.pid), pss=r.get("Pss", 0),
                                 shmem=r.get("Pss_Shmem", 0), private=r.get("Private_Dirty", 0),
                                 threads=p.num_threads()))  # fmt: skip
            except (OSError, psutil.Error):
                continue
        total = sum(r["pss"] for r in rows)
        if total > peak:
            peak, at = total, rows
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} in {scenario} failed: {err[-2000:]}")
    with open(out) as f:
        result = json.load(f)
    if result.get("error"):
        raise RuntimeError(f"{tool} in {scenario} failed: {result['error']}")
    times, rows = result["times"], result["rows"]  # per batch: when it came, its rows
    rate = sum(rows[1:]) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return dict(samples_per_s=rate, peak_pss=peak, processes=at)


def _by_role(processes: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for p in processes:
        r = out.setdefault(p["role"], dict(n=0, pss=0, shmem=0, private=0))
        r["n"] += 1
        for k in ("pss", "shmem", "private"):
            r[k] += p[k]
    return out


def at_nodes_rate(rows: dict[str, dict], labels: list[str]) -> dict | None:
    """Our contender with the smallest peak PSS among those that make at least nodes' rows/s
    (medians): the footprint at the same throughput. None when none of ours does."""
    nodes = rows[labels[1]]
    ours = [lb for lb in labels[:1] + labels[2:] if lb in rows]
    fast = [lb for lb in ours if rows[lb]["samples_per_s"] >= nodes["samples_per_s"]]
    if not fast:
        return None
    best = min(fast, key=lambda lb: rows[lb]["peak_pss_mib"])
    return dict(
        label=best,
        rows_ratio=rows[best]["samples_per_s"] / nodes["samples_per_s"],
        pss_vs_nodes=rows[best]["peak_pss_mib"] / nodes["peak_pss_mib"],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for rnd in range(args.rounds):
            for scenario in args.scenarios:
                order = CONTENDERS[scenario][:: 1 if rnd % 2 == 0 else -1]  # interleaved
                for label, tool, workers in order:
                    run = run_one(scenario, tool, workers, args.duration, workdir)
                    results.setdefault(scenario, {}).setdefault(label, []).append(run)
                    mib = run["peak_pss"] / 2**20
                    print(f"  {scenario} round {rnd + 1} {label}: {mib:.0f} MiB peak PSS, "
                          f"{run['samples_per_s']:,.0f} rows/s", flush=True)  # fmt: skip
    summary = {}
    for scenario, by_label in results.items():
        print(f"\n== {scenario}: the tree at its peak (the round of the median peak; MiB)")
        print(f"{'contender':<24} {'role':<17} {'n':>2} {'PSS':>6} {'shmem':>6} {'private':>8}")
        rows = {}
        for label, runs in by_label.items():
            med = sorted(runs, key=lambda r: r["peak_pss"])[len(runs) // 2]
            peaks = [r["peak_pss"] / 2**20 for r in runs]
            rows[label] = dict(
                peak_pss_mib=statistics.median(peaks), spread=(min(peaks), max(peaks)),
                samples_per_s=statistics.median(r["samples_per_s"] for r in runs),
                by_role=_by_role(med["processes"]),
            )  # fmt: skip
            for role, r in rows[label]["by_role"].items():
                print(f"{label:<24} {role:<17} {r['n']:>2} {r['pss'] / 2**20:>6.0f} "
                      f"{r['shmem'] / 2**20:>6.0f} {r['private'] / 2**20:>8.0f}")  # fmt: skip
            print(f"{label:<24} {'total':<17} {'':>2} {statistics.median(peaks):>6.0f}"
                  f"  (rounds {min(peaks):.0f}-{max(peaks):.0f})")  # fmt: skip
        labels = [c[0] for c in CONTENDERS[scenario]]
        ours, nodes = rows[labels[0]], rows[labels[1]]
        ratio = ours["peak_pss_mib"] / nodes["peak_pss_mib"]
        print(f"ours / nodes: {ratio:.2f}")
        summary[scenario] = dict(contenders=rows, pss_vs_nodes=ratio,
                                 at_nodes_rate=at_nodes_rate(rows, labels))  # fmt: skip
        if summary[scenario]["at_nodes_rate"] is not None:
            m = summary[scenario]["at_nodes_rate"]
            print(f"at nodes' rows/s: {m['label']} makes {m['rows_ratio']:.2f}x them with "
                  f"{m['pss_vs_nodes']:.2f}x nodes' peak PSS")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(config=vars(args), scenarios=summary, runs=results), f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
