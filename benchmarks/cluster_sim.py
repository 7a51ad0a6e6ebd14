"""Two budgets in the simulator: a trainer host of 8 cores fed by 0-256 cluster CPUs.

Each workload family runs on a host of ``--cpus`` cores (8) with a cluster of C CPUs for its
remote workers (``SimPipeline(cluster_cpus=C)``, ``Allocation.remote``), C in 0, 8, 16, 32,
64, 128, 256. Contenders:

* ``intune``: the InTune agent; it splits stages between host and cluster through its plan
  action (``planner.plan``, ``tuning/placement.py``), its network moves workers as before;
* ``planner``: the same tuner with the planner alone (``InTuneTuner(plan_only=True)``: the
  network's place taken by a no-op), the split as the planner makes it;
* ``plumber``: Plumber's LP with cluster CPUs as a second resource (``tuning/plumber.py``);
* ``autotune``: tf.data's AUTOTUNE, local only (tf.data has no cluster; faithful);
* ``oracle``: the best static split (``oracle.best_static`` with ``cluster_cpus``: coordinate
  search over local and remote workers per stage, ``tuning/split_search.py``);
* ``all-remote``: the best static allocation with every stage that may run remote running all
  its workers remote ("everything remote"; ``split_search(all_remote=True)``).

Each tuner runs a noisy episode (``--steps`` intervals of 1 s) from one worker per stage; its
last allocation is judged noiselessly, as the held-out evaluation judges the agent.

Measures, per run: ``rows/s`` (items leaving the pipeline per second; for the batching families
the rows inside them: batches times the batch size), ``/oracle`` (throughput over the best
static split's) and **cost efficiency**: rows/s per CPU paid, where the CPUs paid are the host
cores the pipeline keeps busy (its local workers' CPU plus the remote workers' hops, CPU
seconds per second, from the steady state's stage stats) plus the cluster CPUs its remote
workers hold (one each, busy or waiting: Ray reserves it). ``eff/all-remote`` is a run's cost
efficiency over the everything-remote yardstick's on the same seed. Both yardsticks are charged
only the remote workers they need: the fewest, stage by stage, that keep 99.9% of their
throughput (a static search keeps workers that neither help nor hurt). ``eff2/all-remote`` is
the same ratio with the host rented whole: its cores paid whether the pipeline keeps them busy
or not (CPUs paid = ``--cpus`` plus the cluster CPUs held), the trainer host's case. Targets (issue 19):
throughput >= 0.95 of the best static split, cost efficiency >= 1.15x everything remote.
``split`` names, for seed 0, each movable stage's local+remote workers.

The hop's costs are ``benchmarks/remote.py``'s, measured on this machine (BENCHMARKS.md,
"Remote stages"): a remote call 1.3-1.5 ms (``rpc_s`` 1.4 ms), 1.5-2 ms per MiB each way
(``network_bytes_per_s``: 1 MiB per 1.75 ms); the host's share of a call (``rpc_cpu_s``,
0.3 ms) and the four host copies of each byte are this project's estimates
(``tuning/cluster.py``). Frames: 256 rows per remote call for the row families (a remote stage
after a 256-row source frame, as the README's example), 16 images for ``images_like``.

Run: ``python benchmarks/cluster_sim.py --out benchmarks/results/cluster_sim.json``;
``--quick`` for a smoke run.
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

from torchtune_pipe.sim.model import SimPipeline, Workload  # noqa: E402
from torchtune_pipe.sim.workloads import (  # noqa: E402
    criteo_like,
    images_like,
    netflix_like,
    with_frames,  # noqa: E402
)
from torchtune_pipe.tuning import run_episode  # noqa: E402
from torchtune_pipe.tuning.autotune import AutotuneTuner  # noqa: E402
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, Tuner  # noqa: E402
from torchtune_pipe.tuning.intune.agent import InTuneTuner  # noqa: E402
from torchtune_pipe.tuning.oracle import best_static  # noqa: E402
from torchtune_pipe.tuning.plumber import PlumberTuner  # noqa: E402
from torchtune_pipe.tuning.split_search import split_search  # noqa: E402

MEMORY_BYTES = 64 << 30
# A yardstick keeps this share of its throughput with the fewest remote workers.
TRIM_KEEP = 0.999
CLUSTERS = (0, 8, 16, 32, 64, 128, 256)
FAMILIES: dict[str, Callable[[int], Workload]] = {
    "criteo_like (DLRM)": lambda seed: with_frames(criteo_like(seed), 256),
    "netflix_like": lambda seed: with_frames(netflix_like(seed), 256),
    "images_like": images_like,
}
TUNERS: dict[str, Callable[[], Tuner]] = {
    "intune": InTuneTuner,
    "planner": lambda: InTuneTuner(plan_only=True),
    "plumber": PlumberTuner,
    "autotune": AutotuneTuner,
}
COLUMNS = (
    "family", "cluster", "tuner", "rows/s", "/oracle", "min-max", "cpus paid",
    "eff/all-remote", "eff2/all-remote", "split",
)  # fmt: skip


def _sim(family: str, seed: int, cpus: int, cluster: int, noise: float = 0.02, initial=None):
    return SimPipeline(
        FAMILIES[family](seed), cpus, MEMORY_BYTES, seed=seed, cluster_cpus=cluster,
        noise=noise, initial=initial,
    )  # fmt: skip


def _rows_per_item(wl: Workload) -> float:
    out = 1.0
    for s in wl.stages:
        out *= s.ratio if s.kind == "batch" else 1.0
    return out


def _paid(family: str, seed: int, cpus: int, cluster: int, alloc: Allocation, t: float):
    """Host cores kept busy and cluster CPUs held by ``alloc`` (module docstring), from a
    noiseless run of it."""
    sim = _sim(family, seed, cpus, cluster, noise=0.0, initial=alloc)
    obs: Observation | None = None
    for _ in range(6):  # workers started, buffers at their steady fill
        obs = sim.observe()
    assert obs is not None
    host = sum(
        (s.items_per_s - s.remote_items_per_s) * s.cpu_s_per_item
        + s.remote_items_per_s * s.hop_cpu_s_per_item
        for s in obs.stages
    )
    return min(float(cpus), host) + sum(obs.remote_workers)


def _split(sim: SimPipeline, alloc: Allocation) -> str:
    remote = alloc.remote or (0,) * len(alloc.workers)
    movable = [i for i, ok in enumerate(sim.remotable()) if ok]
    return " ".join(
        f"{sim.workload.stages[i].name}:{alloc.workers[i] - remote[i]}+{remote[i]}" for i in movable
    )


def _proportional(sim: SimPipeline, cpus: int, cluster: int) -> list[Allocation]:
    """Starts for the oracle's split search that a simulator can draw from the workload: the
    local workers in proportion to each stage's wall time per pipeline item, and the cluster's
    CPUs over the stages that may move (all of them, or each one alone) in proportion to a
    remote worker's time per item."""
    wl, n = sim.workload, sim.n_stages
    per_item = [1.0] * n  # stage-i input items per pipeline item
    for i in range(n - 2, -1, -1):
        per_item[i] = per_item[i + 1] * wl.stages[i + 1].ratio
    per_item = [per_item[i] * wl.stages[i].ratio for i in range(n)]
    wall = [per_item[i] * (s.cpu_s_per_item + s.io_s_per_item) for i, s in enumerate(wl.stages)]
    net = [wl.rpc_s / s.items_per_call + 2 * s.bytes_per_item / wl.network_bytes_per_s
           for s in wl.stages]  # fmt: skip
    far = [wall[i] + per_item[i] * net[i] for i in range(n)]
    movable = [i for i, ok in enumerate(sim.remotable()) if ok]
    hi = [s.max_workers for s in wl.stages]
    out = []
    for moved in [movable] + [[i] for i in movable]:
        remote = [0] * n
        for i in moved:
            remote[i] = round(cluster * far[i] / sum(far[j] for j in moved))
        stay = [i for i in range(n) if i not in moved]
        local = [0] * n
        for i in stay:
            local[i] = max(1, round(cpus * wall[i] / sum(wall[j] for j in stay)))
        workers = [min(hi[i], max(1, local[i] + remote[i])) for i in range(n)]
        remote = [min(r, w) for r, w in zip(remote, workers, strict=True)]
        out.append(Allocation(tuple(workers), (64 * MiB,) * n, remote=tuple(remote)))
    return out


def _placement(alloc: Allocation) -> str:
    """Every stage's local+remote workers (``f`` for a fused stage), in pipeline order."""
    remote = alloc.remote or (0,) * len(alloc.workers)
    fused = alloc.fused or (False,) * len(alloc.workers)
    return " ".join(
        "f" if f else f"{w - r}+{r}" for w, r, f in zip(alloc.workers, remote, fused, strict=True)
    )


def _static(family, seed, cpus, cluster, all_remote: bool) -> tuple[Allocation, float]:
    sim = _sim(family, seed, cpus, cluster, noise=0.0)
    hi = [s.max_workers for s in sim.workload.stages]
    remotable = sim.remotable()
    if not all_remote:
        shapes = ((), sim.widest_fusion()) if any(sim.widest_fusion()) else ((),)
        return best_static(
            sim.evaluate, sim.n_stages, cpus, hi, fusion=shapes, cluster_cpus=cluster,
            remotable=remotable, split_starts=_proportional(sim, cpus, cluster),
        )  # fmt: skip
    must = sim.n_stages - sum(remotable)
    found = [
        split_search(sim.evaluate, sim.n_stages, max(must, cpus * f), cluster, hi, remotable,
                     all_remote=True)
        for f in (1, 2, 4)
    ]  # fmt: skip
    return max(found, key=lambda item: item[1])


def _fewest_remote(sim: SimPipeline, alloc: Allocation, x: float) -> Allocation:
    """``alloc`` with, stage by stage, the fewest remote workers that keep ``TRIM_KEEP`` of its
    throughput ``x``: a static search keeps workers that neither help nor hurt, and a
    yardstick must not be charged for cluster CPUs it does not need."""
    remote = list(alloc.remote or (0,) * len(alloc.workers))
    workers = list(alloc.workers)
    for i in range(len(remote)):
        lo, hi = 0, remote[i]
        while lo < hi:  # the fewest remote workers of stage i that keep the throughput
            mid = (lo + hi) // 2
            w, r = list(workers), list(remote)
            w[i], r[i] = workers[i] - remote[i] + mid, mid
            trial = alloc.replace(workers=tuple(w), remote=tuple(r))
            ok = w[i] >= 1 and sim.evaluate(trial) >= TRIM_KEEP * x
            lo, hi = (lo, mid) if ok else (mid + 1, hi)
        workers[i] -= remote[i] - lo
        remote[i] = lo
    return alloc.replace(workers=tuple(workers), remote=tuple(remote))


def run(seeds: Sequence[int], cpus: int, clusters: Sequence[int], steps: int) -> dict:
    """Every contender on every (family, cluster, seed); medians and spreads over seeds."""
    rows, runs = [], []
    for family in FAMILIES:
        for cluster in clusters:
            per: dict[str, list[dict]] = {}
            for seed in seeds:
                sim0 = _sim(family, seed, cpus, cluster, noise=0.0)
                rows_per = _rows_per_item(sim0.workload)
                oracle, x_oracle = _static(family, seed, cpus, cluster, all_remote=False)
                oracle = _fewest_remote(sim0, oracle, x_oracle)
                found: dict[str, tuple[Allocation, float, float]] = {
                    "oracle": (oracle, x_oracle, 0.0)
                }
                if cluster > 0:
                    far, x_far = _static(family, seed, cpus, cluster, all_remote=True)
                    found["all-remote"] = (_fewest_remote(sim0, far, x_far), x_far, 0.0)
                for name, make in TUNERS.items():
                    sim = _sim(family, seed, cpus, cluster)
                    trace = run_episode(sim, make(), steps)
                    t = trace[-1].t
                    found[name] = (sim.allocation, sim.evaluate(sim.allocation, t=t), t)
                for name, (alloc, x, t) in found.items():
                    paid = _paid(family, seed, cpus, cluster, alloc, t)
                    held = min(cluster, sum(alloc.remote)) if alloc.remote else 0
                    per.setdefault(name, []).append(
                        {"seed": seed, "rows_s": x * rows_per, "oracle_rows_s": x_oracle * rows_per,
                         "paid": paid, "eff": x * rows_per / paid if paid > 0 else 0.0,
                         "eff_host_whole": x * rows_per / (cpus + held),
                         "split": _split(sim0, alloc), "remote": held,
                         "placement": _placement(alloc)}
                    )  # fmt: skip
            far = {r["seed"]: r for r in per.get("all-remote", [])}
            for name, results in per.items():
                ratios = [r["rows_s"] / r["oracle_rows_s"] for r in results]
                effs = [r["eff"] / far[r["seed"]]["eff"] for r in results if r["seed"] in far]
                whole = [
                    r["eff_host_whole"] / far[r["seed"]]["eff_host_whole"]
                    for r in results
                    if r["seed"] in far
                ]
                rows.append(
                    {"family": family, "cluster": cluster, "tuner": name,
                     "rows/s": statistics.median(r["rows_s"] for r in results),
                     "/oracle": statistics.median(ratios),
                     "min-max": f"{min(ratios):.2f}-{max(ratios):.2f}",
                     "cpus paid": statistics.median(r["paid"] for r in results),
                     "eff/all-remote": statistics.median(effs) if effs else None,
                     "eff min-max": f"{min(effs):.2f}-{max(effs):.2f}" if effs else None,
                     "eff2/all-remote": statistics.median(whole) if whole else None,
                     "split": results[0]["split"]}
                )  # fmt: skip
                runs += [
                    {"family": family, "cluster": cluster, "tuner": name, **r} for r in results
                ]
    return {"rows": rows, "runs": runs}


def targets(rows: Sequence[dict], tuner: str = "intune") -> dict:
    """Whether ``tuner`` meets the issue's targets on every row with a cluster."""
    mine = [r for r in rows if r["tuner"] == tuner and r["cluster"] > 0]
    return {
        "tuner": tuner,
        "throughput_vs_oracle_min": min(r["/oracle"] for r in mine),
        "eff_vs_all_remote_min": min(r["eff/all-remote"] for r in mine),
        "eff2_vs_all_remote_min": min(r["eff2/all-remote"] for r in mine),
        "throughput_met": all(r["/oracle"] >= 0.95 for r in mine),
        "efficiency_met": all(r["eff/all-remote"] >= 1.15 for r in mine),
        "efficiency2_met": all(r["eff2/all-remote"] >= 1.15 for r in mine),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """Entry point: run, print the table, write ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="workload seeds 0..N-1")
    p.add_argument("--cpus", type=int, default=8, help="the trainer host's cores")
    p.add_argument("--clusters", type=int, nargs="*", default=list(CLUSTERS))
    p.add_argument("--steps", type=int, default=40, help="tuning steps per episode")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.clusters, args.steps = 1, [0, 32], 10
    t0 = time.monotonic()
    result = run(range(args.seeds), args.cpus, args.clusters, args.steps)
    result |= {
        "machine": machine_info(),
        "cpus": args.cpus,
        "memory_bytes": MEMORY_BYTES // MiB,
        "steps": args.steps,
        "seeds": args.seeds,
        "targets": {t: targets(result["rows"], t) for t in ("intune", "planner", "plumber")},
        "seconds": time.monotonic() - t0,
    }
    print_table(
        result["rows"],
        COLUMNS,
        title=f"{args.cpus}-core host, cluster of C CPUs (medians over {args.seeds} seeds)",
    )
    for t in result["targets"].values():
        print(t)
    if args.out:
        print(f"wrote {write_json(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
