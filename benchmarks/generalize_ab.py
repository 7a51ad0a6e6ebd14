"""A/B of the InTune stack's rules and thresholds on the generalization battery.

Each variant changes one module-level constant of ``torchtune_pipe.tuning`` (``generalize.py
--set``): most switch a rule off, some move a threshold. intune runs the whole battery
(``benchmarks/generalize.py``) as shipped and under every variant; per family, the min and
median of the steady and time-averaged ratios to the oracle are compared with the shipped
stack's. A rule *helps* a family when switching it off lowers one of those four figures by
more than ``TOL``, and *hurts* it when switching it off raises one by more than ``TOL`` (the
battery is deterministic: its seeds fix every draw, so a difference is the rule's, not noise).
Verdicts: ``keep`` (helps some family, hurts none), ``drop`` (hurts some, helps none),
``mixed``, and ``no effect`` (the simulator measures nothing the rule reads, e.g. run-queue
delay, or it never binds there).

Run: ``python -m benchmarks.generalize_ab --oracle-cache runs/oracle.json --out
benchmarks/results/generalize_ab.json`` (after ``generalize.py`` filled the cache: about a
minute per variant on 2 cores); ``--only NAME ...`` for some variants.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from _common import machine_info, print_table, usable_cores, write_json  # noqa: E402
from _generalize_cases import battery  # noqa: E402
from generalize import SEGMENT_STEPS, parse_set, run, summarize  # noqa: E402

# Changing a figure by less than this is no change.
TOL = 0.005
FIGURES = ("steady min", "steady med", "avg min", "avg med")
# (name, what the variant does, the constants it sets). "off": the rule switched off.
VARIANTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("undo off", "REVERT_DROP 0.06 -> 1", ("intune.agent.REVERT_DROP=1.0",)),
    ("undo 3%", "REVERT_DROP 0.06 -> 0.03", ("intune.agent.REVERT_DROP=0.03",)),
    ("tabu 1 step", "TABU_STEPS 10 -> 1", ("intune.agent.TABU_STEPS=1",)),
    ("guard off", "GUARD_DROP 0.05 -> 1", ("intune.agent.GUARD_DROP=1.0",)),
    ("plan gain 2%", "PLAN_MIN_GAIN 0.05 -> 0.02", ("intune.agent.PLAN_MIN_GAIN=0.02",)),
    ("plan gain 10%", "PLAN_MIN_GAIN 0.05 -> 0.10", ("intune.agent.PLAN_MIN_GAIN=0.1",)),
    ("grow gain off", "GROW_MIN_GAIN 0.02 -> 0", ("intune.agent.GROW_MIN_GAIN=0.0",)),
    ("settle 1", "SETTLE_MAX 3 -> 1", ("intune.agent.SETTLE_MAX=1",)),
    ("keep buffers off", "KEEP_BUFFER_BYTES 64 -> 1 MiB",
     ("intune.space.KEEP_BUFFER_BYTES=1048576",)),
    ("grow busy off", "GROW_MIN_BUSY 0.5 -> 0", ("intune.space.GROW_MIN_BUSY=0.0",)),
    ("flat out off", "FLAT_OUT_BUSY 0.9 -> 2", ("intune.space.FLAT_OUT_BUSY=2.0",)),
    ("consumer bound off", "CONSUMER_BOUND 0.9 -> 2", ("intune.space.CONSUMER_BOUND=2.0",)),
    ("buffer fill off", "BUFFER_GROW_MIN_FILL 0.5 -> 0",
     ("intune.space.BUFFER_GROW_MIN_FILL=0.0",)),
    ("reader waits off", "READER_WAIT_MIN 0.05 -> 0", ("intune.space.READER_WAIT_MIN=0.0",)),
    ("need mask off", "CORES_FULL 0.95 -> 0 (removals below the need open)",
     ("intune.space.CORES_FULL=0.0",)),
    ("lean buffers off", "LEAN_MIN_GAIN 0.02 -> 1e9", ("planner.LEAN_MIN_GAIN=1e9",)),
    ("headroom 1.1", "HEADROOM 1.2 -> 1.1", ("planner.HEADROOM=1.1",)),
    ("headroom 1.3", "HEADROOM 1.2 -> 1.3", ("planner.HEADROOM=1.3",)),
    ("memory share .9", "planner.MEMORY_SHARE 0.95 -> 0.9", ("planner.MEMORY_SHARE=0.9",)),
    ("need slack off", "NEED_SLACK 0.02 -> 0", ("capacity.NEED_SLACK=0.0",)),
    ("wait noise off", "WAIT_NOISE 0.05 -> 0", ("planner.WAIT_NOISE=0.0",)),
    ("saturated off", "SATURATED 0.8 -> 0", ("run_queue.SATURATED=0.0",)),
    ("fuse gain 0", "FUSE_MIN_GAIN 0.02 -> 0", ("planner.FUSE_MIN_GAIN=0.0",)),
    ("cheap hops off", "CHEAP_HOPS 2 -> 0", ("planner.CHEAP_HOPS=0.0",)),
    ("remote headroom off", "REMOTE_HEADROOM 1.05 -> 1.2",
     ("capacity.REMOTE_HEADROOM=1.2",)),
    ("move gain 0", "MOVE_MIN_GAIN 0.1 -> 0", ("placement.MOVE_MIN_GAIN=0.0",)),
)  # fmt: skip


def compare(base: Sequence[dict], variant: Sequence[dict]) -> dict:
    """Per family, the figures that switching the rule off lowered (the rule helps) and
    raised (it hurts), and the verdict."""
    helps, hurts = [], []
    for b, v in zip(base, variant, strict=True):
        for fig in FIGURES:
            delta = v[fig] - b[fig]
            if delta < -TOL:
                helps.append(f"{b['family']} {fig} {-delta:+.3f}")
            elif delta > TOL:
                hurts.append(f"{b['family']} {fig} {-delta:+.3f}")
    verdict = {
        (True, False): "keep",
        (False, True): "drop",
        (True, True): "mixed",
        (False, False): "no effect",
    }[(bool(helps), bool(hurts))]
    return {"helps": helps, "hurts": hurts, "verdict": verdict}


def main(argv: Sequence[str] | None = None) -> dict:
    """Entry point: the shipped stack and every variant on the battery; the A/B table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generated", type=int, default=300)
    p.add_argument("--per-family", type=int, default=12)
    p.add_argument("--segment", type=int, default=SEGMENT_STEPS)
    p.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    p.add_argument("--jobs", type=int, default=usable_cores())
    p.add_argument("--oracle-cache", type=Path, help="JSON file of oracle values, kept")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args(argv)
    variants = [v for v in VARIANTS if not args.only or v[0] in args.only]
    t0 = time.monotonic()
    cache = {}
    if args.oracle_cache and args.oracle_cache.is_file():
        cache = json.loads(args.oracle_cache.read_text())
    cases = battery(args.generated, args.per_family)

    def figures(sets: Sequence[str]) -> list[dict]:
        overrides = [parse_set(s) for s in sets]
        results = run(cases, args.segment, ["intune"], args.jobs, overrides, cache)
        return summarize(results, ["intune"])

    base = figures(())
    rows, out = [], {"shipped": base, "variants": {}}
    for name, what, sets in variants:
        got = figures(sets)
        verdict = compare(base, got)
        out["variants"][name] = {"sets": sets, "rows": got, **verdict}
        rows.append({"variant": name, "change": what, "verdict": verdict["verdict"],
                     "rule helps": "; ".join(verdict["helps"]) or "-",
                     "rule hurts": "; ".join(verdict["hurts"]) or "-"})  # fmt: skip
        print(f"{name}: {verdict['verdict']}", file=sys.stderr, flush=True)
    if args.oracle_cache:
        write_json(args.oracle_cache, cache)
    print_table(rows, ["variant", "change", "verdict", "rule helps", "rule hurts"],
                title="intune on the battery, each rule switched off or moved (figures: "
                "what the shipped rule adds over the variant)")  # fmt: skip
    out |= {"machine": machine_info(), "tol": TOL, "seconds": time.monotonic() - t0}
    if args.out:
        print(f"wrote {write_json(args.out, out)}")
    return out


if __name__ == "__main__":
    main()
