"""Side by side with peers: the same Criteo pipeline through every tool on this machine.

Each contender runs in its own process (``benchmarks/_peers_fns.py``) over the same files,
work units, parser, feature UDFs, batch size and collate. tf.data runs in TensorFlow's own
environment (``--tf-python``, built by ``make peers-tf-env``) on ``benchmarks/_peers_tf.py``,
over the same files and work units: ``tfdata-ops`` in TensorFlow ops, ``tfdata-pyfunc`` the
peers' Python work through ``tf.py_function``, both with AUTOTUNE. This process watches the
contender's process tree: proportional memory (PSS, so shared pages count once), CPU time,
and, in the ``rescale`` scenario, takes CPUs away and gives them back with
``os.sched_setaffinity`` on every thread of the tree (all CPUs -> 1 -> all).

Scenarios: ``steady`` (parse + features), ``udf`` (plus ``ExtraCost``, CPU-bound),
``latency`` (a remote-read latency per work unit), ``rescale`` (CPUs taken and given back
mid-run) and ``memory`` (a consumer slower than the pipeline, buffers that want more than a
tree memory cap; a watchdog kills a tree over the cap, as the kernel's OOM killer would).
The execution-shape scenarios ``remote-map``, ``cheap-map`` and ``fusion`` run a user's
map-style dataset instead (``benchmarks/_peers_shape.py``). Every scenario ends with the
tracker's targets checked (ours against each peer's best and the DataLoader's common guess,
time to the first batch, peak PSS against torchdata.nodes).

Usage::

    python -m benchmarks.peers                 # default run, ~45 min on 2 cores
    python -m benchmarks.peers --quick         # smoke run, under a minute
    python -m benchmarks.peers --scenarios udf --duration 20 --rounds 3
    python -m benchmarks.peers --scenarios remote-map cheap-map fusion --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import _peers_shape as shape
from benchmarks._common import machine_info, median, print_table, usable_cores, write_json
from benchmarks._peers_report import COLUMNS, SHAPE_COLUMNS, TARGET_COLUMNS, markdown, plots
from benchmarks._peers_watch import (
    TreeWatch,
    cpu_util_of,
    remove_segments,
    tree_of,
    watch_tree,
)

REPO = Path(__file__).resolve().parent.parent
CRITEO_SCENARIOS = ("steady", "udf", "latency", "rescale", "memory")
SCENARIOS = CRITEO_SCENARIOS + tuple(shape.SCENARIOS)
TUNERS = ("unoptimized", "heuristic", "autotune", "plumber", "intune", "oracle")
DEFAULT_SPDL_PATH = "/tmp/peers-venv/lib/python3.11/site-packages"
DEFAULT_TF_PYTHON = "/tmp/tf-venv/bin/python"
TF_TOOLS = ("tfdata-ops", "tfdata-pyfunc")
TF_SCRIPT = REPO / "benchmarks" / "_peers_tf.py"
# Timed window per contender: the udf scenario's epoch takes ~7 s on 2 cores (fast while the
# source is done reading, slow while it reads), and the tuners act once a second.
DEFAULT_WINDOW_S = 15.0
# The memory scenario: rows per batch (~2.4 MB batches) and the least timed window.
MEMORY_BATCH_ROWS = 8192
MEMORY_WINDOW_S = 20.0


@dataclass(frozen=True)
class Contender:
    """One tool configuration: ``tool`` (see ``_peers_fns.TOOLS`` and ``TF_TOOLS``), workers,
    tuner, and ``python``: the interpreter of a tf.data contender (None: this one)."""

    label: str
    tool: str
    workers: int = 0
    tuner: str | None = None
    python: str | None = None
    module: str = "benchmarks._peers_fns"  # the child's entry point (``-m module SPEC``)


def child_spec(c: Contender, spec: dict, out_path: str) -> dict:
    """The spec one contender's process reads."""
    return dict(spec, tool=c.tool, workers=c.workers, tuner=c.tuner, out=out_path)


def child_command(c: Contender, spec_path: str, env: dict) -> tuple[list[str], dict]:
    """``(argv, environment)`` of one contender's process.

    A tf.data contender runs its own interpreter on ``_peers_tf.py`` with only the repository
    on its path: ``env`` may name SPDL's site-packages, whose numpy is not TensorFlow's.
    """
    if c.python is not None:
        return [c.python, str(TF_SCRIPT), spec_path], dict(env, PYTHONPATH=str(REPO))
    return [sys.executable, "-m", c.module, spec_path], env


def run_one(c: Contender, spec: dict, plan: dict, env: dict, workdir: str) -> dict:
    """Runs one contender in a child process and returns its measurements."""
    out_path = os.path.join(workdir, f"{c.label}-{time.monotonic_ns()}.json")
    spec = child_spec(c, spec, out_path)
    spec_path = out_path + ".spec"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    plan = dict(plan, first_marker=out_path + ".first", duration_s=spec["duration_s"])
    argv, env = child_command(c, spec_path, env)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watch, done = TreeWatch(), threading.Event()
    watcher = threading.Thread(target=watch_tree, args=(proc, plan, done, watch), daemon=True)
    watcher.start()
    limit = spec["duration_s"] + plan.get("startup_limit_s", 90)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        for p in reversed(tree_of(proc.pid)):
            p.kill()
        _, err = proc.communicate()
        watch.killed = watch.killed or f"no result within {limit:.0f} s (hung)"
    wall = time.monotonic() - t0
    done.set()
    watcher.join()
    remove_segments([proc.pid, *watch.cpu_s])
    result: dict[str, Any] = {"times": [], "rows": [], "error": None}
    if os.path.exists(out_path):
        with open(out_path) as f:
            result = json.load(f)
    crash = watch.killed or result["error"]
    if crash is None and proc.returncode not in (0, None):
        crash = f"exit status {proc.returncode}: {(err or '').strip().splitlines()[-1:]}"
    m = summarize(result["times"], result["rows"], spec["duration_s"], result.get("iter_s"))
    cores = usable_cores()
    m.update(
        label=c.label, tool=c.tool, workers=c.workers, tuner=c.tuner,
        peak_pss_mib=watch.peak_pss_bytes / 2**20,
        pss_at_first_mib=(watch.pss_at_first or 0) / 2**20 or None,
        cpu_util=cpu_util_of(watch, cores),
        wall_s=wall,
        load_avg_1m=os.getloadavg()[0],  # other work on the machine skews every number
        crash=(crash or "").strip().splitlines()[-1] if crash else None,
        affinity_events=watch.affinity_events,
    )  # fmt: skip
    return m


def summarize(
    times: list[float], rows: list[int], duration_s: float, iter_s: float | None = None
) -> dict:
    """Throughput of the timed window, 1 s throughput series, time to steady throughput.

    ``times`` count from the start of building the tool, ``iter_s`` is when its first
    ``iter()`` was called: ``startup_s`` runs from there to the first batch (all of
    ``times[0]`` when not given), ``first_batch_s`` from the start of building.
    """
    t_first = times[0] if times else None
    startup = None if t_first is None else t_first - (iter_s or 0.0)
    if len(times) < 2:
        return {"samples_per_s": 0.0, "startup_s": startup, "first_batch_s": t_first,
                "time_to_steady_s": None, "series": []}  # fmt: skip
    span = max(times[-1] - t_first, 1e-9)
    rate = sum(rows[1:]) / span
    n_bins = max(1, int(span))
    bins = [0] * (n_bins + 1)
    for t, r in zip(times, rows, strict=True):
        bins[min(n_bins, int(t - t_first))] += r
    series = [[round(t_first + i + 0.5, 2), b] for i, b in enumerate(bins[:n_bins])]
    steady = median([b for _, b in series[len(series) // 2 :]])
    reach = next((t for t, b in series if b >= 0.9 * steady), None)
    return {"samples_per_s": rate, "startup_s": startup, "first_batch_s": t_first,
            "time_to_steady_s": reach, "series": series, "batches": len(times)}  # fmt: skip


def contenders(
    scenario: str, cores: int, quick: bool, spdl: bool, tf_python: str | None = None
) -> list[Contender]:
    """Who runs in ``scenario``: full worker sweeps for steady and udf, a short list otherwise;
    the execution-shape scenarios' own sweeps (``_peers_shape``).

    ``tf_python``: an interpreter that imports TensorFlow; the tf.data contenders (AUTOTUNE
    sizes them, so there is nothing to sweep) run in every Criteo scenario when it is given.
    """
    if scenario in shape.SCENARIOS:
        return [
            Contender(label, tool, workers, module=shape.MODULE)
            for label, tool, workers in shape.contender_args(scenario, cores, quick, spdl)
        ]
    tf = [Contender(t, t, python=tf_python) for t in TF_TOOLS] if tf_python else []
    if quick:
        return [Contender(f"dataloader-w{cores}", "dataloader", cores),
                Contender(f"nodes-w{cores}", "nodes", cores),
                *tf,
                Contender("torchtune_pipe-intune", "torchtune_pipe", tuner="intune")]  # fmt: skip
    sweep = range(0, 2 * cores + 1) if scenario in ("steady", "udf") else (cores,)
    out = [Contender(f"dataloader-w{w}", "dataloader", w) for w in sweep]
    out += [Contender(f"nodes-w{w}", "nodes", w) for w in sweep]
    if spdl:
        spdl_sweep = (cores, 2 * cores) if scenario in ("steady", "udf") else (cores,)
        out += [Contender(f"spdl-c{w}", "spdl", w) for w in spdl_sweep]
    out += tf
    tuners = TUNERS if scenario in ("steady", "udf") else ("heuristic", "intune")
    out += [Contender(f"torchtune_pipe-{t}", "torchtune_pipe", tuner=t) for t in tuners]
    return out


def scenario_spec(name: str, base: dict, args: argparse.Namespace) -> tuple[dict, dict]:
    """(spec for the child, plan for the watcher) of one scenario."""
    spec, plan = dict(base), {}
    if name in ("udf", "rescale"):
        spec["extra_cost_ns"] = args.extra_cost_ns
    if name == "latency":
        spec["latency_s"] = args.latency_s
    if name == "rescale":
        plan["rescale"] = True
    if name == "memory":
        # Big batches, deep prefetch and a consumer far slower than the producers: whatever a
        # tool lets run ahead piles up. torchtune_pipe's buffers get half the allowance.
        spec.update(batch_size=MEMORY_BATCH_ROWS, prefetch_factor=128, buffer_bytes=256 << 20,
                    step_s=1.0, duration_s=max(spec["duration_s"], MEMORY_WINDOW_S),
                    memory_limit_bytes=args.mem_growth_mib << 19)  # fmt: skip
        plan["mem_growth_bytes"] = args.mem_growth_mib << 20
    return spec, plan


def base_spec(paths: list[str], duration_s: float, table_sizes: list[int] | None = None) -> dict:
    """What every contender of every scenario reads (``scenario_spec`` adds to it);
    ``table_sizes`` None: the example's defaults (which imports torch here, see
    :func:`prepare_data`)."""
    if table_sizes is None:
        from examples.dlrm.criteo import DEFAULT_TABLE_SIZES

        table_sizes = list(DEFAULT_TABLE_SIZES)
    return {
        "paths": paths,
        "chunk_rows": 128,
        "chunk_bytes": 1 << 20,
        "batch_size": 512,
        "duration_s": duration_s,
        "table_sizes": table_sizes,  # Features()'s; tfdata-ops hashes into them
    }


def prepare_data(data_dir: str, files: int, rows: int, criteo: bool) -> tuple[list[str], list[int]]:
    """``(paths, table_sizes)``: :func:`ensure_data` (when ``criteo``) and the example's table
    sizes, from a child process, so that this one maps no library a contender maps
    (``benchmarks/_peers_data.py``: the trees' PSS would be unequally discounted)."""
    argv = [sys.executable, "-m", "benchmarks._peers_data", data_dir, str(files), str(rows),
            "1" if criteo else "0"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"peers: preparing the data failed:\n{done.stderr}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["paths"], out["table_sizes"]


def ensure_data(data_dir: str, files: int, rows: int) -> list[str]:
    """Synthetic Criteo files (``examples/dlrm/generate.py``), written once and reused."""
    from examples.dlrm.generate import generate

    os.makedirs(data_dir, exist_ok=True)
    paths = []
    for i in range(files):
        p = os.path.join(data_dir, f"day_{i}_{rows}.txt")
        if not os.path.exists(p):
            generate(p + ".tmp", rows, seed=i)
            os.replace(p + ".tmp", p)
        paths.append(p)
    return paths


def spdl_env(path: str) -> dict | None:
    """The child environment with SPDL importable, or None when it is not installed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), path]))
    ok = subprocess.run([sys.executable, "-c", "import spdl.pipeline"], env=env, cwd=REPO,
                        capture_output=True).returncode == 0  # fmt: skip
    return env if ok else None


def tf_unavailable(python: str) -> str | None:
    """Why ``python`` cannot run the tf.data contenders, or None when it imports TensorFlow."""
    if not os.access(python, os.X_OK):
        return f"not run: {python} does not exist (make peers-tf-env builds it; see --tf-python)"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([python, "-c", "import tensorflow"], env=env, cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no error output"])[-1]
    return f"not run: {python} cannot import tensorflow ({last})"


OURS = "torchtune_pipe-intune"  # ours in the Criteo scenarios (``shape.OURS`` in the others)


def add_ratios(rows: list[dict], ours: str = OURS) -> None:
    """``vs_intune``: each row's throughput over ours (torchtune_pipe with intune, the default
    tuner of ``num_workers="auto"``), and ``ours_vs_this``, its inverse."""
    ref = next((r["samples_per_s"] for r in rows if r["label"] == ours), 0)
    for r in rows:
        r["vs_intune"] = r["samples_per_s"] / ref if ref else None
        r["ours_vs_this"] = ref / r["samples_per_s"] if ref and r["samples_per_s"] else None


def headline(rows: list[dict], cores: int, ours: str = OURS) -> dict:
    """Ours (intune) against DataLoader's common guess (workers = cores), the best of each
    sweep and tf.data with AUTOTUNE (its two variants); ``ours_row`` has our throughput,
    start-up and peak PSS."""
    me = next((r for r in rows if r["label"] == ours), None)
    guess = next((r for r in rows if r["label"] == f"dataloader-w{cores}"), None)
    out: dict[str, Any] = {"intune": me and me["samples_per_s"], "ours": ours}
    if me is not None:
        out["ours_row"] = {k: me.get(k) for k in ("samples_per_s", "startup_s", "peak_pss_mib")}
    for key, r in (("dataloader_guess", guess), ("dataloader_best", shape.best(rows, "dataloader")),
                   ("nodes_best", shape.best(rows, "nodes")),
                   ("spdl_best", shape.best(rows, "spdl")),
                   ("tfdata_ops", shape.best(rows, "tfdata-ops")),
                   ("tfdata_pyfunc", shape.best(rows, "tfdata-pyfunc"))):  # fmt: skip
        if r is not None:
            out[key] = {"label": r["label"], "samples_per_s": r["samples_per_s"],
                        "peak_pss_mib": r.get("peak_pss_mib"),
                        "intune_ratio": (me["samples_per_s"] / r["samples_per_s"])
                        if me and r["samples_per_s"] else None}  # fmt: skip
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: few contenders, 2-3 s each")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS)
    ap.add_argument("--duration", type=float, help="seconds per contender after its first batch")
    ap.add_argument("--rounds", "--repeats", dest="repeats", type=int, default=1,
                    help="interleaved rounds (every contender once per round)")  # fmt: skip
    ap.add_argument("--extra-cost-ns", type=int, default=20_000, help="ExtraCost per row (udf)")
    ap.add_argument("--latency-s", type=float, default=0.02, help="read latency per unit")
    ap.add_argument("--mem-growth-mib", type=int, default=256,
                    help="memory: tree PSS growth past the first batch that the watchdog allows")  # fmt: skip
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "ttp_peers_data"))
    ap.add_argument("--spdl-path", default=DEFAULT_SPDL_PATH, help="site-packages with spdl")
    ap.add_argument("--tf-python", default=DEFAULT_TF_PYTHON,
                    help="python of an environment with TensorFlow (make peers-tf-env)")  # fmt: skip
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/peers.json"))
    ap.add_argument("--png-dir", default=str(REPO / "benchmarks/results"))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--contenders", nargs="+", help="run only these labels (e.g. nodes-w2)")
    ap.add_argument("--markdown", help="also write the tables as Markdown to this file")
    return ap


def target_row(scenario: str, head: dict) -> dict:
    """The scenario's targets (``_peers_shape.targets``) as one table row of values."""
    limit = (
        shape.startup_target_s(scenario)
        if scenario in shape.SCENARIOS
        else shape.STARTUP_PIPELINE_S
    )
    checked = shape.targets(head, limit)
    row: dict[str, Any] = {"scenario": scenario, "ours": head["ours"], "checked": checked}
    for name, c in checked.items():
        v = c["value"]
        row[name] = "-" if v is None else f"{v:.3g} ({'met' if c['met'] else 'MISSED'})"
    return row


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; prints one table per scenario and the targets; writes JSON (and
    PNGs)."""
    args = _parser().parse_args(argv)
    quick = args.quick
    scenarios = args.scenarios or (("steady",) if quick else SCENARIOS)
    criteo = [n for n in scenarios if n in CRITEO_SCENARIOS]
    duration = args.duration or (2.0 if quick else DEFAULT_WINDOW_S)
    files, rows = (1, 20_000) if quick else (4, 100_000)
    paths, table_sizes = prepare_data(args.data_dir, files, rows, bool(criteo))
    cores = usable_cores()
    env = spdl_env(args.spdl_path)
    spdl_ok = env is not None
    env = env or dict(os.environ, PYTHONPATH=str(REPO))
    base = base_spec(paths, duration, table_sizes)
    results: dict[str, Any] = {
        "machine": machine_info(),
        "config": dict(
            base,
            quick=quick,
            repeats=args.repeats,
            extra_cost_ns=args.extra_cost_ns,
            latency_s=args.latency_s,
            mem_growth_mib=args.mem_growth_mib,
        ),  # fmt: skip
        "not_run": {},
        "scenarios": {},
        "targets": {},
    }
    if not spdl_ok:
        results["not_run"]["spdl"] = f"not run: spdl is not importable from {args.spdl_path}"
    if not criteo:
        why_not_tf = "not run: only in the Criteo scenarios"
    elif args.contenders and not set(args.contenders) & set(TF_TOOLS):
        why_not_tf = "not run: not among --contenders"
    else:
        why_not_tf = tf_unavailable(args.tf_python)  # checked once: importing TF takes seconds
    tf_python = None if why_not_tf else args.tf_python
    if why_not_tf:
        results["not_run"]["tf.data"] = why_not_tf
    with tempfile.TemporaryDirectory(prefix="ttp_peers_") as workdir:
        for name in scenarios:
            if name in shape.SCENARIOS:
                window = args.duration or (shape.QUICK_WINDOW_S if quick else shape.WINDOW_S)
                spec, plan, ours = shape.spec(name, window), {}, shape.OURS[name]
                columns = SHAPE_COLUMNS
            else:
                (spec, plan), ours, columns = scenario_spec(name, base, args), OURS, COLUMNS
            chosen = [
                c
                for c in contenders(name, cores, quick, spdl_ok, tf_python)
                if not args.contenders or c.label in args.contenders
            ]
            # Rounds go round the contenders (each round runs every one once), so a slow
            # spell of a noisy machine lands on all of them rather than on one tool's runs.
            runs: dict[str, list[dict]] = {c.label: [] for c in chosen}
            for k in range(args.repeats):
                for c in chosen:
                    runs[c.label].append(run_one(c, spec, plan, env, workdir))
                    m = runs[c.label][-1]
                    print(f"  {name} round {k + 1}/{args.repeats} {c.label}: "
                          f"{m['samples_per_s']:,.0f} rows/s, startup {m['startup_s']} s"
                          + (f" CRASH {m['crash']}" if m["crash"] else ""), flush=True)  # fmt: skip
            rows_out = [shape.combine_rounds(runs[c.label]) for c in chosen]
            add_ratios(rows_out, ours)
            results["scenarios"][name] = rows_out
            head = results.setdefault("headlines", {})[name] = headline(rows_out, cores, ours)
            results["targets"][name] = target_row(name, head)
            print_table(
                rows_out, columns, title=f"\n== {name} ({cores} cores, {spec['duration_s']:g} s)"
            )
    for tool, why in results["not_run"].items():
        print(f"{tool}: {why}")
    print_table(list(results["targets"].values()), TARGET_COLUMNS, title="\n== targets")
    write_json(args.out, results)
    if not args.no_plots:
        results["plots"] = plots(results, args.png_dir)
        write_json(args.out, results)
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
