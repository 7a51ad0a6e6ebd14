"""A user's map-style dataset, side by side: torch's DataLoader, torchdata.nodes, torchtune_pipe.

Two scenarios from users' scripts, where the *shape* of execution decides the winner:

- ``remote-map``: ``__getitem__`` waits 4 ms on a remote read (the CPU is idle meanwhile), and a
  collate spends 2 ms of CPU per batch of 32. Concurrency of reads is what counts: torch's best
  is many worker processes, torchdata.nodes' a thread pool.
- ``cheap-map``: rows cost ~15 us of CPU each, default collate, batch 128. A hop between
  processes costs more than the work: torch's best is ``num_workers=0``.

Every peer is swept over its knob (DataLoader's ``num_workers``, nodes' ``num_workers`` with
threads and with processes), so each is compared at its best setting as well as at the common
guess ``num_workers=2``; torchtune_pipe runs as a user writes it,
``DataLoader(num_workers="auto")`` and nothing else. Each contender runs in its own process
(``benchmarks/_mapstyle_fns.py``) watched by :func:`benchmarks.peers.run_one` (startup, rows/s
after the first batch, peak PSS of the process tree). Rounds are interleaved (every contender
once per round, in turn), so a slow spell of the machine lands on every tool; the table shows
medians and the spread (min-max) over rounds.

Usage::

    python -m benchmarks.mapstyle                       # 3 rounds, 8 s windows (~10 min)
    python -m benchmarks.mapstyle --quick               # smoke run (~1 min)
    python -m benchmarks.mapstyle --scenarios cheap-map --rounds 5
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from ._common import machine_info, median, print_table, write_json
from .peers import REPO, Contender, run_one

SCENARIOS: dict[str, dict[str, Any]] = {
    "remote-map": dict(rows=40_000, wait_s=0.004, row_cpu_us=0, collate_cpu_us=2000, batch_size=32),
    "cheap-map": dict(rows=200_000, wait_s=0.0, row_cpu_us=15, collate_cpu_us=0, batch_size=128),
}
# Each peer's knob, swept; 2 is the common guess.
SWEEPS: dict[str, dict[str, tuple[int, ...]]] = {
    "remote-map": {
        "dataloader": (0, 2, 8, 16, 32, 64),
        "nodes-thread": (2, 16, 32, 64),
        "nodes-process": (2, 8),
    },
    "cheap-map": {"dataloader": (0, 1, 2, 4), "nodes-thread": (0, 2), "nodes-process": (2,)},
}
QUICK_SWEEPS: dict[str, dict[str, tuple[int, ...]]] = {
    "remote-map": {"dataloader": (2, 16), "nodes-thread": (16,)},
    "cheap-map": {"dataloader": (0, 2), "nodes-thread": (0,)},
}
MODULE = "benchmarks._mapstyle_fns"
OURS = "torchtune_pipe-auto"


def contenders(scenario: str, quick: bool) -> list[Contender]:
    """The sweep of every peer, then torchtune_pipe as a user writes it."""
    sweep = (QUICK_SWEEPS if quick else SWEEPS)[scenario]
    out = [
        Contender(f"{tool}-w{w}", tool, workers=w, module=MODULE)
        for tool, ws in sweep.items()
        for w in ws
    ]
    out.append(Contender(OURS, "torchtune_pipe", workers=-1, module=MODULE))
    return out


def _spread(xs: list[float]) -> str:
    return f"{min(xs):,.0f}-{max(xs):,.0f}" if xs else "-"


def summarize(scenario: str, runs: dict[str, list[dict]]) -> list[dict]:
    """One row per contender: medians over rounds, spread, ratios against our loader."""
    rows = []
    for label, ms in runs.items():
        rates = [m["samples_per_s"] for m in ms if not m.get("crash")]
        starts = [m["startup_s"] for m in ms if m.get("startup_s") is not None]
        rows.append(
            dict(
                contender=label,
                tool=ms[0]["tool"],
                rows_per_s=median(rates) if rates else 0.0,
                spread=_spread(rates),
                startup_s=median(starts) if starts else None,
                peak_pss_mib=max(m["peak_pss_mib"] for m in ms),
                crashes=sum(bool(m.get("crash")) for m in ms),
            )
        )
    ours = next(r for r in rows if r["contender"] == OURS)["rows_per_s"]
    for r in rows:
        r["ours_vs_this"] = ours / r["rows_per_s"] if r["rows_per_s"] else None
    return rows


def best_of(rows: list[dict], tool_prefix: str) -> dict | None:
    """The best setting of a peer's sweep."""
    mine = [r for r in rows if r["tool"].startswith(tool_prefix)]
    return max(mine, key=lambda r: r["rows_per_s"]) if mine else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.mapstyle", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smoke run: short sweeps, 3 s windows")
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--duration", type=float, help="seconds per contender after its first batch")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/mapstyle.json"))
    args = ap.parse_args(argv)
    duration = args.duration or (3.0 if args.quick else 8.0)
    rounds = args.rounds or (1 if args.quick else 3)
    env = dict(os.environ)
    report: dict[str, Any] = {"machine": machine_info(), "duration_s": duration,
                              "rounds": rounds, "scenarios": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ttp_mapstyle_") as workdir:
        for scenario in args.scenarios:
            spec = dict(SCENARIOS[scenario], duration_s=duration)
            cs = contenders(scenario, args.quick)
            runs: dict[str, list[dict]] = {c.label: [] for c in cs}
            for r in range(rounds):
                for c in cs:
                    m = run_one(c, spec, {}, env, workdir)
                    m["round"] = r
                    runs[c.label].append(m)
                    print(f"  {scenario} round {r + 1}/{rounds} {c.label}: "
                          f"{m['samples_per_s']:,.0f} rows/s, first batch {m['startup_s']} s"
                          + (f" CRASH {m['crash']}" if m.get("crash") else ""), flush=True)  # fmt: skip
            rows = summarize(scenario, runs)
            print_table(
                rows,
                ["contender", "rows_per_s", "spread", "ours_vs_this", "startup_s", "peak_pss_mib",
                 "crashes"],
                title=f"\n{scenario} (median of {rounds} rounds, {duration:.0f} s windows)",
            )  # fmt: skip
            ours = next(r for r in rows if r["contender"] == OURS)
            verdict: dict[str, Any] = {}
            for peer in ("dataloader", "nodes"):
                b = best_of(rows, peer)
                if b is not None and b["rows_per_s"]:
                    verdict[f"vs_best_{peer}"] = {
                        "setting": b["contender"],
                        "ratio": ours["rows_per_s"] / b["rows_per_s"],
                    }
            guess = next((r for r in rows if r["contender"] == "dataloader-w2"), None)
            if guess is not None and guess["rows_per_s"]:
                verdict["vs_dataloader_w2"] = ours["rows_per_s"] / guess["rows_per_s"]
            verdict["startup_s"] = ours["startup_s"]
            print("  torchtune_pipe(num_workers='auto'):", verdict)
            report["scenarios"][scenario] = {"spec": spec, "rows": rows, "verdict": verdict,
                                             "runs": runs}  # fmt: skip
    path = write_json(args.out, report)
    print(f"\nwrote {path}")
    return report


if __name__ == "__main__":
    main()
