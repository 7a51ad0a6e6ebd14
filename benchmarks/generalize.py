"""The generalization battery: every tuner on hundreds of simulated workloads nothing was tuned on.

Cases (``benchmarks/_generalize_cases.py``): 300 workloads drawn by the simulator's generator
and 12 of each of six hand-built families it rarely draws (I/O-heavy lookups, memory-tight,
many cheap stages, one dominant UDF, model-bound, fused and remote stages with a cluster), on
8 to 128 CPUs whose count changes once or twice per episode (e.g. 24 -> 96 -> 48), every seed
above those pre-training, the held-out evaluation and the studies use.

Each tuner runs one noisy episode per case (:func:`~torchtune_pipe.tuning.loop.run_episode`,
every decision through the hard limits), ``--segment`` one-second intervals per CPU level.
Per case and tuner:

* ``steady``: per CPU level, the allocation in force at the level's last interval, judged
  noiselessly with that time's costs, over the best static allocation then (the oracle,
  :func:`~torchtune_pipe.tuning.oracle.best_static` as pre-training's, every stage split or
  every stage that may fuse fused, with a cluster over host and cluster too; held to the
  memory the hard limits let every tuner fill, ``safety.MEMORY_SAFE_SHARE`` of the limit, and
  searching the worker totals that fit it). One sample per level.
* ``time-avg``: mean delivered throughput over the episode (an OOM ends it: the rest counts
  0) over the mean oracle of the intervals' levels (for a workload whose costs drift, the
  oracle of the nearer of the level's middle and end).
* ``/plumber``, ``/autotune``: a case's time-averaged throughput over Plumber-adaptive's and
  AUTOTUNE's on the same case.
* ``churn``: workers started or stopped per interval over the second half of every CPU level,
  where a tuner has had time to settle (:func:`settled_churn`): what the simulator charges
  nothing for and a live pipeline pays in process starts and stops.

Per family: min and median of each, and the OOMs. Targets, per family, for the steady state:
min >= 0.90 and median >= 0.97 of the oracle, median >= 1.0x Plumber-adaptive (time-averaged),
no OOM. Contenders: ``intune``; ``planner`` (the planner alone under the same undo, guard and
rescale: ``make_tuner("planner")``); ``network-only`` (the DQN with the plan action shut:
``InTuneTuner(plan_action=False)``); ``plumber-adaptive``; ``autotune``.

``--set capacity.NEED_SLACK=0`` runs with a module-level constant of the tuning package
changed (every tuning module that imported it too): ``benchmarks/generalize_ab.py`` A/Bs the
InTune stack's rules that way. ``--oracle-cache FILE`` keeps the oracle's values between
runs (keyed by the workload's full description).

Run: ``python -m benchmarks.generalize --out benchmarks/results/generalize.json`` (about 20
minutes on 2 busy cores, most of it the oracle; about 3 with ``--oracle-cache`` filled);
``--quick`` for a smoke run (under a minute).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import hashlib
import importlib
import inspect
import json
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from _common import machine_info, print_table, usable_cores, write_json  # noqa: E402
from _generalize_cases import FAMILIES, Case, battery, drifts  # noqa: E402

from torchtune_pipe.sim.model import SimPipeline  # noqa: E402
from torchtune_pipe.tuning.base import MiB, Observation, Tuner  # noqa: E402
from torchtune_pipe.tuning.loop import run_episode  # noqa: E402
from torchtune_pipe.tuning.oracle import best_static  # noqa: E402
from torchtune_pipe.tuning.registry import make_tuner  # noqa: E402
from torchtune_pipe.tuning.safety import MAX_OVERSUBSCRIBE, MEMORY_SAFE_SHARE  # noqa: E402

SEGMENT_STEPS = 40
# Worker totals per CPU the oracle searches (oracle.best_static's own).
FACTORS = (1.0, 2.0, MAX_OVERSUBSCRIBE)
TARGETS = {"steady_min": 0.90, "steady_median": 0.97, "vs_plumber_median": 1.0, "ooms": 0}


def _network_only() -> Tuner:
    from torchtune_pipe.tuning.intune.agent import InTuneTuner

    return InTuneTuner(plan_action=False)


CONTENDERS: dict[str, Callable[[], Tuner]] = {
    "intune": lambda: make_tuner("intune"),
    "planner": lambda: make_tuner("planner"),
    "network-only": _network_only,
    "plumber-adaptive": lambda: make_tuner("plumber-adaptive"),
    "autotune": lambda: make_tuner("autotune"),
}
BASELINES = ("plumber-adaptive", "autotune")


# -- constants changed for an A/B -----------------------------------------------------------
def parse_set(text: str) -> tuple[str, str, object]:
    """``"capacity.NEED_SLACK=0"`` -> ``("capacity", "NEED_SLACK", 0)``."""
    where, sep, value = text.partition("=")
    module, dot, name = where.strip().rpartition(".")
    if not (sep and dot and name.isupper()):
        raise argparse.ArgumentTypeError(f"--set wants MODULE.CONSTANT=VALUE, got {text!r}")
    return module, name, ast.literal_eval(value.strip())


def apply_overrides(overrides: Sequence[tuple[str, str, object]]) -> None:
    """Set each ``torchtune_pipe.tuning`` module's constant, the same name in every tuning
    module that imported it (``from .planner import MEMORY_SHARE`` binds a copy), and every
    default of their functions that is the constant (``plan(headroom=HEADROOM)`` binds it
    when the function is defined)."""
    for module, name, value in overrides:
        mod = importlib.import_module(f"torchtune_pipe.tuning.{module}")
        if not hasattr(mod, name):
            raise ValueError(f"--set: torchtune_pipe.tuning.{module} has no {name}")
        old = getattr(mod, name)
        tuning = [
            m
            for m in list(sys.modules.values())
            if getattr(m, "__name__", "").startswith("torchtune_pipe.tuning")
        ]
        for other in tuning:
            if getattr(other, name, None) is old:
                setattr(other, name, value)
            for fn in _functions(other):
                positional, keywords = _defaults_naming(fn, name)
                for key in keywords:
                    fn.__kwdefaults__[key] = value
                if positional:
                    fn.__defaults__ = tuple(
                        value if i in positional else v for i, v in enumerate(fn.__defaults__)
                    )


def _defaults_naming(fn, name: str) -> tuple[set[int], list[str]]:
    """The defaults of ``fn`` its source writes as ``name`` (``headroom=HEADROOM``): their
    positions in ``__defaults__`` and their keys in ``__kwdefaults__``. By name, not by value:
    equal constants are one object (every 0.05 of a module), and a default bound to another
    constant of the same value is not the one changed."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return set(), []
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set(), []

    def names(e) -> bool:
        return (isinstance(e, ast.Name) and e.id == name) or (
            isinstance(e, ast.Attribute) and e.attr == name
        )

    args = node.args
    positional = {i for i, d in enumerate(args.defaults) if names(d)}
    keywords = [
        a.arg
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
        if d is not None and names(d)
    ]
    return positional, keywords


def _functions(module) -> list:
    """The functions a module defines, its classes' methods included."""
    out = []
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if isinstance(obj, type):
            out += [f for f in vars(obj).values() if hasattr(f, "__kwdefaults__")]
        elif hasattr(obj, "__kwdefaults__"):
            out.append(obj)
    return out


def _init_worker(overrides: Sequence[tuple[str, str, object]]) -> None:
    import torch

    torch.set_num_threads(1)  # one process per core; the networks are tiny
    importlib.import_module("torchtune_pipe.tuning.intune.agent")  # every module the stack binds
    apply_overrides(overrides)


# -- one case --------------------------------------------------------------------------------
def _sim(case: Case, segment: int, noise: float = 0.02, memory_share: float = 1.0) -> SimPipeline:
    return SimPipeline(
        case.workload, case.schedule(segment), int(case.memory_bytes * memory_share),
        seed=case.seed, noise=noise, cluster_cpus=case.cluster_cpus,
    )  # fmt: skip


def level_ends(case: Case, segment: int) -> list[float]:
    """The time of each level's last observation: ``run_episode``'s reset observes the first
    second, step ``j`` the interval ``[j + 1, j + 2)`` with the CPUs of its start."""
    n = len(case.levels)
    return [float((k + 1) * segment) for k in range(n - 1)] + [float(n * segment + 1)]


def oracle_points(case: Case, segment: int) -> list[tuple[int, float]]:
    """(level, time) pairs the oracle is needed at: each level's end, and its middle for a
    workload whose costs drift."""
    ends = level_ends(case, segment)
    points = []
    for k, end in enumerate(ends):
        if drifts(case):
            points.append((k, k * segment + segment / 2))
        points.append((k, end))
    return points


def oracle_key(case: Case, level: int, t: float) -> str:
    """The cache key of one oracle value: everything it depends on."""
    what = repr((case.workload, case.levels, case.memory_bytes, case.cluster_cpus, level, t,
                 MEMORY_SAFE_SHARE, FACTORS))  # fmt: skip
    return hashlib.sha1(what.encode()).hexdigest()


def _factors(case: Case, cpus: float) -> tuple[float, ...]:
    """Worker totals (per CPU) the oracle searches: ``FACTORS``, and where memory holds fewer
    workers than the largest, the most that fit with 64 MiB buffers (of the worker RSS alone,
    and with the largest per-worker cache): a search from an even split past the memory limit
    sees only zeros around it and cannot climb."""
    wl = case.workload
    room = case.memory_bytes * MEMORY_SAFE_SHARE - sum(s.resident_bytes for s in wl.stages)
    room -= len(wl.stages) * 64 * MiB
    extra = max(s.worker_bytes for s in wl.stages)
    fits = [room / wl.worker_rss_bytes, room / (wl.worker_rss_bytes + extra)]
    more = {round(f / cpus, 4) for f in fits if len(wl.stages) <= f < max(FACTORS) * cpus}
    return tuple(sorted(set(FACTORS) | more))


def oracle_value(case: Case, segment: int, level: int, t: float) -> float:
    """The best static throughput at time ``t`` on the CPUs of ``level``, every stage split or
    every stage that may fuse fused, within the memory the hard limits let a tuner fill
    (``MEMORY_SAFE_SHARE`` of the limit); with a cluster, the best split between host and
    cluster as well."""
    sim = _sim(case, segment, noise=0.0, memory_share=MEMORY_SAFE_SHARE)
    cpus = float(case.levels[level])
    widest = sim.widest_fusion()
    split = {}
    if case.cluster_cpus:
        from cluster_sim import _proportional

        split = {
            "cluster_cpus": case.cluster_cpus,
            "remotable": sim.remotable(),
            "split_starts": _proportional(sim, int(cpus), int(case.cluster_cpus)),
        }
    return best_static(
        lambda a: sim.evaluate(a, cpus=cpus, t=t),
        sim.n_stages,
        cpus,
        [s.max_workers for s in sim.workload.stages],
        factors=_factors(case, cpus),
        fusion=((), widest) if any(widest) else ((),),
        **split,
    )[1]


def run_case(case: Case, segment: int, tuners: Sequence[str], cached: Mapping[str, float]) -> dict:
    """Every tuner in ``tuners`` on ``case``: per tuner its steady ratios (one per level),
    time-averaged ratio, mean throughput and OOM; and the oracle values computed."""
    computed = {}
    oracle: dict[tuple[int, float], float] = {}
    for k, t in oracle_points(case, segment):
        key = oracle_key(case, k, t)
        if key not in cached:
            computed[key] = oracle_value(case, segment, k, t)
        oracle[(k, t)] = cached.get(key, computed.get(key))
    ends = level_ends(case, segment)
    steps = segment * len(case.levels)

    def step_oracle(j: int) -> float:
        k = min(len(case.levels) - 1, (j + 1) // segment)
        t = j + 2.0
        return min(((abs(p - t), v) for (lv, p), v in oracle.items() if lv == k))[1]

    denominator = statistics.fmean(step_oracle(j) for j in range(steps))
    probe = _sim(case, segment, noise=0.0)
    out: dict = {"family": case.family, "name": case.name, "seed": case.seed,
                 "levels": list(case.levels), "cluster_cpus": case.cluster_cpus,
                 "oracle_computed": computed, "tuners": {}}  # fmt: skip
    for name in tuners:
        sim = _sim(case, segment)
        allocs: list = []

        def record(_, sim=sim, allocs=allocs) -> None:
            allocs.append(sim.allocation)  # the allocation the observation ran under

        trace = run_episode(sim, CONTENDERS[name](), steps, on_step=record)
        steady = []
        for k, end in enumerate(ends):
            j = int(end) - 2
            if j >= len(trace) or trace[-1].oom and j >= len(trace) - 1:
                steady.append(0.0)
                continue
            x = probe.evaluate(allocs[j], cpus=case.levels[k], t=end)
            steady.append(x / max(oracle[(k, end)], 1e-12))
        mean = sum(o.throughput for o in trace) / steps  # intervals after an OOM deliver 0
        out["tuners"][name] = {
            "churn": _sig(settled_churn(trace, segment)),
            "steady": [_sig(x) for x in steady],
            "time_avg": _sig(mean / max(denominator, 1e-12)),
            "throughput": _sig(mean),
            "oom": bool(trace and trace[-1].oom),
        }
    return out


def settled_churn(trace: Sequence[Observation], segment: int) -> float:
    """Workers started or stopped per interval over the second half of each ``segment``-step
    level: the sum over stages of the change in running workers (a fused stage runs none)
    between consecutive observations."""
    moves = [
        sum(abs(a.workers - b.workers) for a, b in zip(x.stages, y.stages, strict=True))
        for j, (x, y) in enumerate(zip(trace, trace[1:], strict=False), start=1)
        if j % segment >= segment // 2
    ]
    return statistics.fmean(moves) if moves else 0.0


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (the JSON keeps every case)."""
    return float(f"{x:.4g}")


# -- the battery -----------------------------------------------------------------------------
def run(
    cases: Sequence[Case],
    segment: int,
    tuners: Sequence[str],
    jobs: int,
    overrides: Sequence[tuple[str, str, object]] = (),
    cache: dict[str, float] | None = None,
) -> list[dict]:
    """Every case (in ``jobs`` processes); ``cache`` gains the oracle values computed."""
    cache = {} if cache is None else cache
    args = [
        (c, segment, tuners, {k: cache[k] for k in (oracle_key(c, lv, t)
                                                    for lv, t in oracle_points(c, segment))
                              if k in cache})
        for c in cases
    ]  # fmt: skip
    t0, results = time.monotonic(), []

    def done(r: dict) -> None:
        results.append(r)
        if len(results) % 50 == 0:
            print(f"{len(results)}/{len(args)} cases, {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip

    if jobs <= 1:
        _init_worker(overrides)
        for a in args:
            done(run_case(*a))
    else:
        with concurrent.futures.ProcessPoolExecutor(
            jobs, initializer=_init_worker, initargs=(tuple(overrides),)
        ) as pool:
            for r in pool.map(_run_packed, args, chunksize=2):
                done(r)
    for r in results:
        cache.update(r.pop("oracle_computed"))
    return results


def _run_packed(args: tuple) -> dict:
    return run_case(*args)


def summarize(results: Sequence[dict], tuners: Sequence[str]) -> list[dict]:
    """Per family and tuner: min and median of the steady and time-averaged ratios, the
    medians of the ratios to the baselines, and the OOMs."""
    rows = []
    for family in FAMILIES:
        mine = [r for r in results if r["family"] == family]
        if not mine:
            continue
        for name in tuners:
            steady = [x for r in mine for x in r["tuners"][name]["steady"]]
            avg = [r["tuners"][name]["time_avg"] for r in mine]
            row = {
                "family": family, "tuner": name, "cases": len(mine),
                "steady min": min(steady), "steady med": statistics.median(steady),
                "avg min": min(avg), "avg med": statistics.median(avg),
                "ooms": sum(r["tuners"][name]["oom"] for r in mine),
                "churn": statistics.fmean(r["tuners"][name].get("churn", 0.0) for r in mine),
            }  # fmt: skip
            for base in BASELINES:
                if base in tuners and base != name:
                    ratios = [
                        r["tuners"][name]["throughput"]
                        / max(r["tuners"][base]["throughput"], 1e-12)
                        for r in mine
                    ]
                    row[f"/{base.split('-')[0]}"] = statistics.median(ratios)
            rows.append(row)
    return rows


def targets(rows: Sequence[dict], tuner: str = "intune") -> list[dict]:
    """Per family, ``tuner``'s figures against :data:`TARGETS`, each met or missed."""
    out = []
    for row in (r for r in rows if r["tuner"] == tuner):
        met = {
            "steady min": row["steady min"] >= TARGETS["steady_min"],
            "steady med": row["steady med"] >= TARGETS["steady_median"],
            "/plumber": row.get("/plumber", float("nan")) >= TARGETS["vs_plumber_median"],
            "ooms": row["ooms"] <= TARGETS["ooms"],
        }
        out.append({"family": row["family"], "tuner": tuner, **met, "all": all(met.values())})
    return out


def _tree_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=_HERE, capture_output=True,
            text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: Sequence[str] | None = None) -> dict:
    """Entry point: run the battery, print the tables, write ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generated", type=int, default=300, help="generated workloads")
    p.add_argument("--per-family", type=int, default=12, help="cases per hand-built family")
    p.add_argument("--segment", type=int, default=SEGMENT_STEPS, help="steps per CPU level")
    p.add_argument("--tuners", nargs="*", default=list(CONTENDERS), choices=list(CONTENDERS))
    p.add_argument("--set", dest="overrides", type=parse_set, action="append", default=[],
                   help="MODULE.CONSTANT=VALUE of torchtune_pipe.tuning (repeatable)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=usable_cores())
    p.add_argument("--oracle-cache", type=Path, help="JSON file of oracle values, kept")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (under a minute)")
    args = p.parse_args(argv)
    if args.quick:
        args.generated, args.per_family, args.segment = 3, 1, 8
    t0 = time.monotonic()
    cache = {}
    if args.oracle_cache and args.oracle_cache.is_file():
        cache = json.loads(args.oracle_cache.read_text())
    cases = battery(args.generated, args.per_family)
    results = run(cases, args.segment, args.tuners, args.jobs, args.overrides, cache)
    if args.oracle_cache:
        write_json(args.oracle_cache, cache)
    rows = summarize(results, args.tuners)
    met = [t for name in ("intune", "planner") if name in args.tuners for t in targets(rows, name)]
    result = {
        "machine": machine_info(),
        "commit": _tree_commit(),
        "segment_steps": args.segment,
        "overrides": [f"{m}.{n}={v!r}" for m, n, v in args.overrides],
        "targets": TARGETS,
        "rows": rows,
        "met": met,
        "cases": results,
        "seconds": time.monotonic() - t0,
    }
    columns = ["family", "tuner", "cases", "steady min", "steady med", "avg min", "avg med",
               "/plumber", "/autotune", "ooms", "churn"]  # fmt: skip
    print_table(rows, columns, title=f"{len(cases)} cases, ratios to the oracle (steady per CPU "
                f"level, time-averaged per case); /baseline: time-averaged, median")  # fmt: skip
    if met:
        print()
        print_table(
            met,
            ["family", "tuner", "steady min", "steady med", "/plumber", "ooms", "all"],
            title="targets: steady min >= 0.90, median >= 0.97, /plumber >= 1.0, 0 OOMs",
        )
    print(f"{time.monotonic() - t0:.0f} s")
    if args.out:
        print(f"wrote {write_json(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
