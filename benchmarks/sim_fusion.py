"""Fusion in the simulator: each tuner with and without the fusion knob, side by side.

The ``fusion_like`` family (a source, six stateless maps of 1-3 us of CPU per row, a batch;
hops of 2.5 us per row, BENCHMARKS.md) on 2-16 CPUs. Each contender runs a noisy episode from
one worker per stage, and its last allocation is judged noiselessly, as the held-out
evaluation judges the InTune agent; the yardstick is the best static allocation over worker
counts and fusion shapes (``oracle.fusion_shapes``). Unfused against fused:

* intune: ``InTuneTuner(fusion=False)`` against ``InTuneTuner()`` (the plan decides the shape);
* autotune: tf.data's defaults (no map fusion) against ``map_fusion=True`` (every stage that
  may be fused, fused once at reset);
* plumber: it never fuses; profiled on the pipeline split against the pipeline started with
  every stage that may be fused fused (its LP then sees a group as one node);
* oracle: the best static allocation split against the best over fusion shapes.

Run: ``python benchmarks/sim_fusion.py --out out/sim_fusion.json``; ``--quick`` for a smoke
test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from _common import machine_info, print_table, write_json  # noqa: E402

from torchtune_pipe.sim.model import SimPipeline  # noqa: E402
from torchtune_pipe.sim.workloads import fusion_like  # noqa: E402
from torchtune_pipe.tuning import run_episode  # noqa: E402
from torchtune_pipe.tuning.autotune import AutotuneTuner  # noqa: E402
from torchtune_pipe.tuning.base import Allocation, MiB, Tuner  # noqa: E402
from torchtune_pipe.tuning.intune.agent import InTuneTuner  # noqa: E402
from torchtune_pipe.tuning.oracle import best_static, fusion_shapes  # noqa: E402
from torchtune_pipe.tuning.plumber import PlumberTuner  # noqa: E402

MEMORY_BYTES = 16 << 30
COLUMNS = ("tuner", "cpus", "unfused", "fused", "fused/unfused", "unfused/oracle", "fused/oracle")

# name -> (tuner factory, start fused?) for the unfused and the fused side.
Side = tuple[Callable[[], Tuner], bool]
CONTENDERS: dict[str, tuple[Side, Side]] = {
    "intune": ((lambda: InTuneTuner(fusion=False), False), (InTuneTuner, False)),
    "autotune": ((AutotuneTuner, False), (lambda: AutotuneTuner(map_fusion=True), False)),
    "plumber": ((PlumberTuner, False), (PlumberTuner, True)),
}


def _simulator(seed: int, cpus: int, fused: bool) -> SimPipeline:
    wl = fusion_like(seed)
    sim = SimPipeline(wl, cpus, MEMORY_BYTES, seed=seed)
    n = sim.n_stages
    start = Allocation((1,) * n, (wl.initial_buffer_bytes,) * n)
    if fused:
        start = start.replace(fused=sim.widest_fusion())
    return SimPipeline(wl, cpus, MEMORY_BYTES, seed=seed, initial=start)


def _steady(seed: int, cpus: int, side: Side, steps: int) -> float:
    make, fused = side
    sim = _simulator(seed, cpus, fused)
    trace = run_episode(sim, make(), steps)
    return sim.evaluate(sim.allocation, t=trace[-1].t)


def _oracle(seed: int, cpus: int, fusion: bool) -> float:
    sim = _simulator(seed, cpus, False)
    shapes = fusion_shapes(sim.widest_fusion()) if fusion else [()]
    hi = [s.max_workers for s in sim.workload.stages]
    return best_static(sim.evaluate, sim.n_stages, cpus, hi, fusion=shapes)[1]


def run(seeds: Sequence[int], cpu_counts: Sequence[int], steps: int) -> dict:
    """Every contender on every (seed, CPU count); medians over seeds per row."""
    rows, runs = [], []
    for cpus in cpu_counts:
        oracle = {s: (_oracle(s, cpus, False), _oracle(s, cpus, True)) for s in seeds}
        results: dict[str, list[tuple[float, float]]] = {
            name: [(_steady(s, cpus, a, steps), _steady(s, cpus, b, steps)) for s in seeds]
            for name, (a, b) in CONTENDERS.items()
        }
        results["oracle"] = [oracle[s] for s in seeds]
        for name, pairs in results.items():
            best = [oracle[s][1] for s in seeds]
            row = {
                "tuner": name,
                "cpus": cpus,
                "unfused": statistics.median(u for u, _ in pairs),
                "fused": statistics.median(f for _, f in pairs),
                "fused/unfused": statistics.median(f / u for u, f in pairs),
                "unfused/oracle": statistics.median(
                    u / b for (u, _), b in zip(pairs, best, strict=True)
                ),
                "fused/oracle": statistics.median(
                    f / b for (_, f), b in zip(pairs, best, strict=True)
                ),
            }
            rows.append(row)
            for s, (u, f) in zip(seeds, pairs, strict=True):
                runs.append({"tuner": name, "cpus": cpus, "seed": s, "unfused": u, "fused": f})
    return {"rows": rows, "runs": runs}


def main(argv: Sequence[str] | None = None) -> dict:
    """Entry point: run, print the table, write ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=4, help="fusion_like seeds 0..N-1")
    p.add_argument("--cpus", type=int, nargs="*", default=[2, 4, 8, 16])
    p.add_argument("--steps", type=int, default=60, help="tuning steps per episode")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (seconds)")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.cpus, args.steps = 1, [4], 10
    t0 = time.monotonic()
    result = run(range(args.seeds), args.cpus, args.steps)
    result |= {
        "machine": machine_info(),
        "memory_bytes": MEMORY_BYTES // MiB,
        "steps": args.steps,
        "seconds": time.monotonic() - t0,
    }
    print_table(
        result["rows"],
        COLUMNS,
        title=f"fusion_like, batches of 256 rows/s delivered (medians over {args.seeds} seeds)",
    )
    if args.out:
        print(f"wrote {write_json(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
