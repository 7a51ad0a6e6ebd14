"""The InTune paper's studies, run on the simulator for any set of tuners.

1. ``schedule``: throughput over time, normalised to the unoptimized pipeline (one worker per
   stage), while the CPU count steps 32 -> 64 -> 128 -> 64 -> 32, on both presets.
2. ``complexity``: gain over a baseline tuner as pipelines grow from 3 to 8 stages.
3. ``cpus``: gain over the baseline from 8 to 128 CPUs.
4. ``batch``: gain over the baseline as the batch size grows.
5. ``oom``: out-of-memory episodes and steady throughput under memory pressure (the CPU count
   doubles mid-episode but memory does not).

Every decision passes the hard limits (:class:`~torchtune_pipe.tuning.safety.Guarded`) as it
does on a live pipeline, so study 5 counts OOMs the guard could not prevent, not what a tuner
would do unguarded.

Gains compare steady-state throughput (mean over the second half of an episode). The baseline
is ``autotune`` when it is among the tuners, else the first tuner. Results go to
``results.json`` and one PNG per study in the output folder.

Example:
    python -m torchtune_pipe.sim.studies --out runs/studies --quick --tuners heuristic,autotune
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from torchtune_pipe.sim.model import SimPipeline, Workload
from torchtune_pipe.sim.workloads import PRESETS, generate, with_batch_size
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, Tuner
from torchtune_pipe.tuning.loop import run_episode

__all__ = ["CPU_SCHEDULE", "run_studies", "main"]

log = logging.getLogger(__name__)

TunerFactory = Callable[[], Tuner]
CPU_SCHEDULE = (32, 64, 128, 64, 32)
HELD_OUT_SEED = 10_000  # generated workloads at or above this seed are never trained on
MEMORY_BYTES = 48 * 1024 * MiB


def _episode(sim: SimPipeline, tuner: Tuner, steps: int) -> list[Observation]:
    """``steps`` intervals of ``tuner`` on ``sim`` (:func:`~torchtune_pipe.tuning.run_episode`);
    after an OOM the pipeline is dead and the remaining intervals are recorded as the
    simulator reports them (throughput 0)."""
    seen = run_episode(sim, tuner, steps)
    seen += [sim.observe() for _ in range(steps - len(seen))]
    return seen


def _steady(seen: Sequence[Observation]) -> float:
    tail = seen[len(seen) // 2 :]
    return sum(o.throughput for o in tail) / max(1, len(tail))


def _unoptimized(sim: SimPipeline) -> Allocation:
    st = sim.workload.stages
    return Allocation(tuple(s.min_workers for s in st), (1 * MiB,) * len(st))


def _gains(values: dict[str, float], baseline: str) -> dict[str, float]:
    base = values[baseline]
    return {k: (v / base if base > 0 else math.inf) for k, v in values.items()}


def _geomean(xs: Sequence[float]) -> float:
    xs = [max(x, 1e-12) for x in xs if math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def _steady_by_tuner(
    tuners: dict[str, TunerFactory], make_sim: Callable[[], SimPipeline], steps: int
) -> dict[str, float]:
    return {name: _steady(_episode(make_sim(), f(), steps)) for name, f in tuners.items()}


def study_schedule(tuners: dict[str, TunerFactory], segment_steps: int, seed: int) -> dict:
    """Study 1: normalised throughput over the 32->64->128->64->32 CPU schedule."""
    out = {}
    schedule = [(k * segment_steps, float(c)) for k, c in enumerate(CPU_SCHEDULE)]
    steps = segment_steps * len(CPU_SCHEDULE)
    for preset, build in PRESETS.items():
        wl = build(seed)
        ref_sim = SimPipeline(wl, schedule, MEMORY_BYTES, seed=seed, noise=0)
        unopt = _unoptimized(ref_sim)
        refs, t, cpus = [], [], []
        for _ in range(steps):  # the noiseless unoptimized pipeline at each interval
            o = ref_sim.observe()
            refs.append(ref_sim.evaluate(unopt, o.cpus))
            t.append(o.t)
            cpus.append(o.cpus)
        res: dict = {"t": t, "cpus": cpus, "tuners": {}}
        for name, factory in tuners.items():
            sim = SimPipeline(wl, schedule, MEMORY_BYTES, seed=seed)
            seen = _episode(sim, factory(), steps)
            norm = [o.throughput / r for o, r in zip(seen, refs, strict=True)]
            res["tuners"][name] = {
                "normalised": norm,
                "mean": sum(norm) / len(norm),
                "oom": any(o.oom for o in seen),
            }
            log.info(
                "schedule %s %s: mean %.2fx unoptimized", preset, name, res["tuners"][name]["mean"]
            )
        out[preset] = res
    return out


def study_complexity(
    tuners: dict[str, TunerFactory], stages: Sequence[int], seeds: int, steps: int, baseline: str
) -> dict:
    """Study 2: gain over ``baseline`` for generated pipelines of each length (64 CPUs)."""
    out = {}
    for n in stages:
        per_seed = []
        for k in range(seeds):
            wl = generate(n, HELD_OUT_SEED + 100 * n + k)
            v = _steady_by_tuner(tuners, lambda wl=wl: SimPipeline(wl, 64, MEMORY_BYTES), steps)
            per_seed.append(_gains(v, baseline))
        out[str(n)] = {name: _geomean([g[name] for g in per_seed]) for name in tuners}
        log.info("complexity %d stages: %s", n, out[str(n)])
    return out


def study_cpus(
    tuners: dict[str, TunerFactory], cpus: Sequence[int], steps: int, baseline: str, seed: int
) -> dict:
    """Study 3: steady throughput and gain over ``baseline`` from few to many CPUs."""
    out: dict = {}
    for preset, build in PRESETS.items():
        wl = build(seed)
        out[preset] = {}
        for c in cpus:
            v = _steady_by_tuner(tuners, lambda c=c, wl=wl: SimPipeline(wl, c, MEMORY_BYTES), steps)
            out[preset][str(c)] = {"throughput": v, "gain": _gains(v, baseline)}
    return out


def study_batch(
    tuners: dict[str, TunerFactory], sizes: Sequence[int], steps: int, baseline: str, seed: int
) -> dict:
    """Study 4: items/s and gain over ``baseline`` as the batch size grows (netflix_like, 32 CPUs)."""
    out = {}
    for b in sizes:
        wl: Workload = with_batch_size(PRESETS["netflix_like"](seed), b)
        v = _steady_by_tuner(tuners, lambda wl=wl: SimPipeline(wl, 32, MEMORY_BYTES), steps)
        out[str(b)] = {"items_per_s": {k: x * b for k, x in v.items()}, "gain": _gains(v, baseline)}
    return out


def study_oom(tuners: dict[str, TunerFactory], episodes: int, steps: int) -> dict:
    """Study 5: OOM episodes when CPUs double mid-episode and memory fits ~40 workers."""
    counts = {name: 0 for name in tuners}
    steady = {name: [] for name in tuners}
    for k in range(episodes):
        wl = generate(4 + k % 3, HELD_OUT_SEED + 5000 + k)
        resident = sum(s.resident_bytes for s in wl.stages)
        memory = int(resident + 40 * wl.worker_rss_bytes + 1024 * MiB)
        schedule = [(0.0, 32.0), (steps / 2, 64.0)]
        for name, factory in tuners.items():
            seen = _episode(SimPipeline(wl, schedule, memory, seed=k), factory(), steps)
            counts[name] += any(o.oom for o in seen)
            steady[name].append(_steady(seen))
    return {"episodes": episodes, "oom": counts, "steady_throughput": steady}


def _plot(results: dict, out_dir: Path) -> list[str]:
    from matplotlib.figure import Figure  # no pyplot: no global figure state

    paths = []

    def save(fig: Figure, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        paths.append(str(path))

    sched = results["schedule"]
    fig = Figure(figsize=(6 * len(sched), 4))
    for i, (preset, res) in enumerate(sched.items()):
        ax = fig.add_subplot(1, len(sched), i + 1)
        for name, r in res["tuners"].items():
            ax.plot(res["t"], r["normalised"], label=name)
        ax.set(title=f"{preset}: CPUs {'->'.join(map(str, CPU_SCHEDULE))}", xlabel="t (s)")
        ax.set_ylabel("throughput / unoptimized")
        ax.legend()
    save(fig, "schedule.png")
    for key, title, xlabel in (
        ("complexity", "gain vs pipeline length", "stages"),
        ("batch", "gain vs batch size", "batch size"),
    ):
        data = results[key]
        xs = list(data)
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        names = next(iter(data.values()))
        names = names["gain"] if "gain" in names else names
        for name in names:
            ys = [(data[x]["gain"] if "gain" in data[x] else data[x])[name] for x in xs]
            ax.plot([int(x) for x in xs], ys, marker="o", label=name)
        ax.set(title=f"{title} (over {results['baseline']})", xlabel=xlabel, ylabel="gain")
        ax.legend()
        save(fig, f"{key}.png")
    fig = Figure(figsize=(6 * len(results["cpus"]), 4))
    for i, (preset, data) in enumerate(results["cpus"].items()):
        ax = fig.add_subplot(1, len(results["cpus"]), i + 1)
        xs = [int(x) for x in data]
        for name in next(iter(data.values()))["throughput"]:
            ax.plot(xs, [data[str(x)]["throughput"][name] for x in xs], marker="o", label=name)
        ax.set(title=f"{preset}", xlabel="CPUs", ylabel="batches/s", xscale="log")
        ax.legend()
    save(fig, "cpus.png")
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    oom = results["oom"]["oom"]
    ax.bar(list(oom), list(oom.values()))
    ax.set(title=f"OOM episodes of {results['oom']['episodes']}", ylabel="episodes")
    save(fig, "oom.png")
    return paths


def run_studies(
    tuners: dict[str, TunerFactory],
    out_dir: str | Path,
    quick: bool = False,
    seed: int = 0,
    plot: bool = True,
) -> dict:
    """Run the five studies for every tuner; write ``results.json`` (+ PNGs) to ``out_dir``.

    Args:
        tuners: name -> zero-argument factory; a fresh tuner is built for every episode.
        out_dir: output folder (created).
        quick: a few short episodes per study (seconds), for smoke tests.
        seed: seed of the preset workloads and of the simulator noise.
        plot: also write PNG figures (needs matplotlib).

    Returns:
        The results, as written to ``results.json``.

    Raises:
        ValueError: when ``tuners`` is empty.
    """
    if not tuners:
        raise ValueError("run_studies(): tuners is empty")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    baseline = "autotune" if "autotune" in tuners else next(iter(tuners))
    if quick:
        seg, steps, seeds, stages = 10, 20, 1, (3, 5, 8)
        cpus, sizes, oom_episodes = (8, 32, 128), (256, 1024, 4096), 2
    else:
        seg, steps, seeds, stages = 120, 150, 3, (3, 4, 5, 6, 7, 8)
        cpus, sizes, oom_episodes = (8, 16, 32, 64, 128), (256, 512, 1024, 2048, 4096), 10
    results = {
        "baseline": baseline,
        "quick": quick,
        "seed": seed,
        "schedule": study_schedule(tuners, seg, seed),
        "complexity": study_complexity(tuners, stages, seeds, steps, baseline),
        "cpus": study_cpus(tuners, cpus, steps, baseline, seed),
        "batch": study_batch(tuners, sizes, steps, baseline, seed),
        "oom": study_oom(tuners, oom_episodes, steps),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if plot:
        results["figures"] = _plot(results, out)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``--out DIR --quick --tuners a,b,c --seed S``; prints a summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/studies", help="output folder")
    p.add_argument("--quick", action="store_true", help="short episodes (smoke test)")
    p.add_argument(
        "--tuners",
        default="unoptimized,heuristic,autotune,plumber,intune",
        help="comma-separated tuner names from torchtune_pipe.tuning.make_tuner",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from torchtune_pipe.tuning import make_tuner

    names = [n.strip() for n in args.tuners.split(",") if n.strip()]
    tuners = {n: (lambda n=n: make_tuner(n)) for n in names}
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run_studies(tuners, args.out, quick=args.quick, seed=args.seed)
    print(f"baseline: {res['baseline']}; results in {Path(args.out) / 'results.json'}")
    for preset, r in res["schedule"].items():
        means = ", ".join(f"{k} {v['mean']:.2f}x" for k, v in r["tuners"].items())
        print(f"schedule {preset} (vs unoptimized): {means}")
    for n, g in res["complexity"].items():
        print(
            f"{n} stages (vs {res['baseline']}): " + ", ".join(f"{k} {v:.2f}" for k, v in g.items())
        )
    print("OOM episodes: " + ", ".join(f"{k} {v}" for k, v in res["oom"]["oom"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
