"""The dataset zoo: the drop-in DataLoader against the datasets users bring.

Eleven datasets (``benchmarks/_zoo_members.py``), each a ``Dataset`` or ``IterableDataset``
class written as a training script has it (``benchmarks/_zoo_datasets.py``), over files this
benchmark generates once (``benchmarks/_zoo_data.py``): a JPEG folder decoded and augmented
with PIL, JSON lines tokenized in pure Python, TSV shards split by ``get_worker_info()``, a
Hugging Face Arrow table, packed binary records read through a handle opened in
``__init__``, WebDataset tar shards, reads that wait on a remote store, ~10 us rows, 8 MiB
items, a numpy memmap and a ``__getitem__`` of torch tensor ops.

For each member, every contender runs in its own process (``benchmarks/_zoo_child.py``, timed
by ``benchmarks/peers.py``'s ``run_one``, which samples the process tree's PSS): torch's
``DataLoader`` over ``num_workers`` 0..2 x cores, with and without persistent workers,
torchdata.nodes (threads and processes; map-style members only), and
``torchtune_pipe.DataLoader`` with ``num_workers="auto"`` and with ``num_workers`` = cores.
The first round runs them all; the later rounds (interleaved) run the finalists: ours, torch's
common guess (``num_workers`` = cores, non-persistent as torch defaults), torch's two fastest
settings of the first round and nodes' fastest; torch's best is the fastest of those that ran
every round. Each run times ``--window`` seconds from its first batch, over as many epochs as
that takes; the first batch counts from the loader's construction. The first batches of every
run are hashed and compared with torch's.

The targets (issue 36), checked per member: ours ``"auto"`` >= 1.0x torch's best setting
(0.95x counts where the rounds' spreads overlap), first batch no later than torch's guess +
0.1 s, peak PSS <= 1.2x torch's at its best setting, the same batches as torch; and >= 1.3x
torch's guess at the zoo's median.

Usage::

    python -m benchmarks.zoo --rounds 3                     # ~15 minutes on 2 cores
    python -m benchmarks.zoo --members images,remote-store --rounds 3
    python -m benchmarks.zoo --quick                        # smoke run: tiny data, 3 settings
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import fmt, machine_info, median, print_table, usable_cores, write_json
from benchmarks._peers_shape import best, combine_rounds
from benchmarks._zoo_members import MEMBERS, Member
from benchmarks.peers import Contender, run_one

REPO = Path(__file__).resolve().parent.parent
MODULE = "benchmarks._zoo_child"
WINDOW_S = 1.5  # timed per run: an epoch takes about a second at torch's best setting
QUICK_WINDOW_S = 0.5
# A run is killed this long past its window (a stall is an outcome, not a wait).
STARTUP_LIMIT_S = 45
PSS_EVERY = 2  # PSS every other 0.25 s sample: runs are short

TARGET_VS_BEST = 1.0
TARGET_VS_BEST_OVERLAP = 0.95  # counts where ours' and torch's best's spreads overlap
TARGET_VS_GUESS = 1.3  # at the zoo's median
FIRST_BATCH_SLACK_S = 0.1
TARGET_PSS_VS_BEST = 1.2

COLUMNS = ["label", "samples_per_s", "spread", "ours_vs_this", "first_batch_s",
           "peak_pss_mib", "cpu_util", "rounds", "same_batches", "crashes"]  # fmt: skip
TARGET_COLUMNS = ["member", "torch_best", "vs_best", "vs_guess", "first_batch_s",
                  "pss_vs_best", "same_batches", "met"]  # fmt: skip


def guess_label(cores: int) -> str:
    """torch's common guess: ``num_workers`` = cores, workers not persistent (its default)."""
    return f"torch-w{cores}"


def contenders(member: Member, cores: int, quick: bool) -> list[Contender]:
    """Who runs on ``member``: torch's sweep, nodes (map-style members), ours."""
    ours = [Contender("ours-auto", "ours", -1, module=MODULE),
            Contender(f"ours-w{cores}", "ours", cores, module=MODULE)]  # fmt: skip
    if quick:
        return [Contender(guess_label(cores), "torch-np", cores, module=MODULE), *ours]
    out = [Contender("torch-w0", "torch-np", 0, module=MODULE)]
    for w in range(1, 2 * cores + 1):
        out += [Contender(f"torch-w{w}", "torch-np", w, module=MODULE),
                Contender(f"torch-w{w}-p", "torch", w, module=MODULE)]  # fmt: skip
    if not member.iterable:
        threads = 16 if member.waits else 2 * cores
        out += [Contender(f"nodes-thread-w{threads}", "nodes-thread", threads, module=MODULE),
                Contender(f"nodes-process-w{cores}", "nodes-process", cores, module=MODULE)]  # fmt: skip
    return out + ours


def finalists(first_round: dict[str, dict], cores: int) -> set[str]:
    """The labels the later rounds run: ours, torch's guess, torch's two fastest settings and
    nodes' fastest in the first round (one noisy round picks the best less surely than two)."""
    ok = {k: r for k, r in first_round.items() if not r.get("crash")}

    def fastest(prefix: str, n: int) -> set[str]:
        mine = sorted((k for k in ok if k.startswith(prefix)), key=lambda k: ok[k]["samples_per_s"])
        return set(mine[-n:])

    keep = {k for k in first_round if k.startswith("ours-")} | {guess_label(cores)}
    return keep | fastest("torch-", 2) | fastest("nodes-", 1)


def prepare_data(data_dir: str, members: list[Member], quick: bool) -> dict[str, str]:
    """Each member's data folder, written by a child process (this one maps no numpy)."""
    sizes = [f"{m.name}={m.quick_items if quick else m.items}" for m in members]
    argv = [sys.executable, "-m", "benchmarks._zoo_data", data_dir, *sizes]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"zoo: writing the data failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _read_digests(path: str) -> list[str]:
    """A run's batch digests (none when the run died before writing them)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def tree_commit() -> str | None:
    """The commit of the tree measured (None outside a git checkout)."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None


def same(a: list[str], b: list[str]) -> bool | None:
    """Whether two runs' first batches agree (over the batches both hashed; None: neither
    has any)."""
    n = min(len(a), len(b))
    return None if n == 0 else a[:n] == b[:n]


def compare_batches(rows: dict[str, dict], member: Member, cores: int) -> None:
    """``same_batches`` of ours' rows: every run's first batches equal torch's. The reference
    is torch's guess; for an iterable member (whose batches depend on the shard count) ours
    ``"auto"`` may match any torch setting, named in ``same_as``."""
    torch_rows = {k: r for k, r in rows.items() if k.startswith("torch-") and r["digests"]}
    ref = rows.get(guess_label(cores), {}).get("digests") or []
    for label, r in rows.items():
        if not label.startswith("ours-") or not r["digests"]:
            continue
        r["same_as"] = [t for t, tr in torch_rows.items()
                        if all(same(d, tr["digests"][0]) for d in r["digests"])]  # fmt: skip
        if member.iterable and label == "ours-auto":
            r["same_batches"] = bool(r["same_as"])
        else:
            r["same_batches"] = bool(ref) and all(same(d, ref[0]) for d in r["digests"])


def member_targets(rows: dict[str, dict], member: Member, cores: int) -> dict[str, Any]:
    """The member's targets: ``{target: {"value", "aim", "met"}}`` plus the labels compared."""
    ours, guess = rows.get("ours-auto"), rows.get(guess_label(cores))
    # torch's best: the fastest of the settings that ran every round (a setting run once
    # cannot win on one lucky round)
    full = max(r["rounds"] for r in rows.values())
    top = best([r for r in rows.values() if r["rounds"] == full], "torch")
    ok = ours is not None and not ours["crashes"] and ours["samples_per_s"] > 0

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    vs_best = ratio(ours["samples_per_s"], top["samples_per_s"]) if ok and top else None
    overlap = ok and top and max(ours["runs_samples_per_s"]) >= min(top["runs_samples_per_s"])
    aim_best = TARGET_VS_BEST_OVERLAP if overlap else TARGET_VS_BEST
    first = (ours["first_batch_s"] - guess["first_batch_s"]
             if ok and guess and guess["first_batch_s"] is not None else None)  # fmt: skip
    pss = ratio(ours["peak_pss_mib"], top["peak_pss_mib"]) if ok and top else None
    return {
        "torch_best": top and top["label"],
        "vs_best": {"value": vs_best, "aim": aim_best,
                    "met": vs_best is not None and vs_best >= aim_best},
        "vs_guess": {"value": ratio(ours["samples_per_s"], guess["samples_per_s"])
                     if ok and guess else None, "aim": TARGET_VS_GUESS, "met": None},
        "first_batch_s": {"value": first, "aim": FIRST_BATCH_SLACK_S,
                          "met": first is not None and first <= FIRST_BATCH_SLACK_S},
        "pss_vs_best": {"value": pss, "aim": TARGET_PSS_VS_BEST,
                        "met": pss is not None and pss <= TARGET_PSS_VS_BEST},
        "same_batches": {"value": ours and ours.get("same_batches"), "aim": True,
                         "met": bool(ok and ours.get("same_batches"))},
    }  # fmt: skip


def target_row(name: str, t: dict) -> dict:
    """One member's targets as a table row (``met``: how many of the four per-member ones)."""
    row: dict[str, Any] = {"member": name, "torch_best": t["torch_best"]}
    for k in ("vs_best", "vs_guess", "first_batch_s", "pss_vs_best", "same_batches"):
        c = t[k]
        v = c["value"] if not isinstance(c["value"], float) else fmt(c["value"])
        row[k] = f"{v}" + ("" if c["met"] is None else " (met)" if c["met"] else " (MISSED)")
    mine = [t[k]["met"] for k in ("vs_best", "first_batch_s", "pss_vs_best", "same_batches")]
    row["met"] = f"{sum(mine)}/{len(mine)}"
    return row


def run_member(member: Member, folder: str, args: argparse.Namespace, workdir: str) -> dict:
    """Every round of ``member``'s contenders; its rows (by label) and targets."""
    cores, quick = usable_cores(), args.quick
    chosen = contenders(member, cores, quick)
    window = args.window or (QUICK_WINDOW_S if quick else WINDOW_S)
    spec = {"member": member.name, "data": folder, "batch_size": member.batch_size,
            "items": member.quick_items if quick else member.items, "duration_s": window,
            "compare_batches": min(member.compare_batches, 3) if quick else member.compare_batches}  # fmt: skip
    plan = {"startup_limit_s": STARTUP_LIMIT_S, "pss_every": PSS_EVERY}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    runs: dict[str, list[dict]] = {c.label: [] for c in chosen}
    for k in range(1 if quick else args.rounds):
        if k == 1:
            keep = finalists({label: r[0] for label, r in runs.items()}, cores)
            chosen = [c for c in chosen if c.label in keep]
        for c in chosen:
            digest_path = os.path.join(workdir, f"{member.name}-{c.label}-{k}.digests")
            m = run_one(c, dict(spec, digest_path=digest_path), plan, env, workdir)
            m["digests"] = _read_digests(digest_path)
            runs[c.label].append(m)
            print(f"  {member.name} round {k + 1} {c.label}: {m['samples_per_s']:,.0f} rows/s, "
                  f"first batch {fmt(m['first_batch_s'])} s"
                  + (f" CRASH {m['crash']}" if m["crash"] else ""), flush=True)  # fmt: skip
    rows = {}
    for label, rs in runs.items():
        row = combine_rounds(rs)
        row.pop("series", None)
        row.update(rounds=len(rs), digests=[r["digests"] for r in rs],
                   first_batch_s=median([r["first_batch_s"] for r in rs
                                         if r["first_batch_s"] is not None]))  # fmt: skip
        rows[label] = row
    compare_batches(rows, member, cores)
    ours = rows.get("ours-auto", {}).get("samples_per_s")
    for r in rows.values():
        r["ours_vs_this"] = ours / r["samples_per_s"] if ours and r["samples_per_s"] else None
    return {"rows": list(rows.values()), "targets": member_targets(rows, member, cores),
            "window_s": window}  # fmt: skip


def zoo_targets(members: dict[str, dict]) -> dict:
    """The zoo-wide target: ours ``"auto"`` over torch's guess at the members' median."""
    ratios = [m["targets"]["vs_guess"]["value"] for m in members.values()]
    ratios = [r for r in ratios if r is not None]
    value = median(ratios) if ratios else None
    return {"median_vs_guess": {"value": value, "aim": TARGET_VS_GUESS,
                                "met": value is not None and value >= TARGET_VS_GUESS}}  # fmt: skip


def markdown(results: dict) -> str:
    """The zoo as one Markdown table (a row per member), then the zoo-wide target."""
    cores = results["machine"]["usable_cores"]
    cols = ["member", "torch best", "torch guess", "nodes best", "ours auto", "ours w" + str(cores),
            "auto / best", "auto / guess", "first batch auto / guess (s)", "PSS auto / best",
            "same batches", "targets met"]  # fmt: skip
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def rate(r: dict | None, label: bool = False) -> str:
        if r is None:
            return "-"
        if r["crashes"] == r["rounds"]:
            return f"crashed ({(r.get('crash') or '')[:60]})"
        s = f"{r['samples_per_s']:,.0f} ({r['spread']})"
        return f"{r['label']}: {s}" if label else s

    for name, m in results["members"].items():
        rows = {r["label"]: r for r in m["rows"]}
        t = m["targets"]
        ours, guess = rows.get("ours-auto"), rows.get(guess_label(cores))
        firsts = f"{fmt(ours and ours['first_batch_s'])} / {fmt(guess and guess['first_batch_s'])}"
        cells = [name, rate(rows.get(t["torch_best"]), True), rate(guess),
                 rate(best(m["rows"], "nodes"), True), rate(ours),
                 rate(rows.get(f"ours-w{cores}")), fmt(t["vs_best"]["value"]),
                 fmt(t["vs_guess"]["value"]), firsts, fmt(t["pss_vs_best"]["value"]),
                 fmt(t["same_batches"]["value"]), target_row(name, t)["met"]]  # fmt: skip
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    z = results["zoo"]["median_vs_guess"]
    out.append(f"\nAt the zoo's median, ours \"auto\" / torch's guess: {fmt(z['value'])} "
               f"(aim >= {z['aim']}: {'met' if z['met'] else 'MISSED'}).")  # fmt: skip
    return "\n".join(out) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3 for spreads)")
    ap.add_argument("--members", help="comma-separated members (default: all): "
                    + ",".join(MEMBERS))  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny data, one round, torch's guess and ours only")  # fmt: skip
    ap.add_argument("--window", type=float, help="seconds timed per run after its first batch")
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "ttp_zoo_data"))
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/zoo.json"))
    ap.add_argument("--markdown", help="also write the summary table as Markdown to this file")
    return ap


def main(argv: list[str] | None = None) -> dict:
    """Runs the zoo; prints a table per member and the targets; writes JSON."""
    args = _parser().parse_args(argv)
    names = args.members.split(",") if args.members else list(MEMBERS)
    unknown = [n for n in names if n not in MEMBERS]
    if unknown:
        raise SystemExit(f"zoo: unknown members {unknown}; choose from {', '.join(MEMBERS)}")
    members = [MEMBERS[n] for n in names]
    folders = prepare_data(args.data_dir, members, args.quick)
    cores = usable_cores()
    results: dict[str, Any] = {
        "machine": machine_info(),
        "commit": tree_commit(),
        "config": {"rounds": 1 if args.quick else args.rounds, "quick": args.quick,
                   "members": names, "window_s": args.window},
        "members": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ttp_zoo_") as workdir:
        for member in members:
            res = results["members"][member.name] = run_member(
                member, folders[member.name], args, workdir
            )
            ordered = sorted(res["rows"], key=lambda r: -r["samples_per_s"])
            print_table(ordered, COLUMNS, title=f"\n== {member.name}: {member.what} "
                        f"(batch {member.batch_size}, {cores} cores, {res['window_s']:g} s)")  # fmt: skip
    results["zoo"] = zoo_targets(results["members"])
    targets = [target_row(n, m["targets"]) for n, m in results["members"].items()]
    print_table(targets, TARGET_COLUMNS, title='\n== targets (ours num_workers="auto")')
    z = results["zoo"]["median_vs_guess"]
    print(f"zoo median of ours / torch's guess: {fmt(z['value'])} (aim >= {z['aim']}: "
          f"{'met' if z['met'] else 'MISSED'})")  # fmt: skip
    written = [str(write_json(args.out, results))]
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
        written.append(args.markdown)
    print("wrote " + ", ".join(written))
    return results


if __name__ == "__main__":
    main()
