"""Batches bigger than a worker's share of the budget: rows/s, ours against torch's DataLoader.

The dataset zoo's ``big-items`` member (``benchmarks/_zoo_datasets.py`` ``BigItems``: 8 MiB
float32 ``.npy`` files, ``np.load`` per item) in batches of 4: 32 MiB batches, bigger than
each of two workers' share of the default 64 MiB budget, so every batch spills
(:mod:`multiproc.policy`). Contenders, each in its own process (``benchmarks/_zoo_child.py``),
side by side in interleaved rounds:

* ``torch-w2``: torch's ``DataLoader(num_workers=2)``, workers not persistent (its default);
* ``ours-w2``: ``torchtune_pipe.DataLoader(num_workers=2)`` of this checkout;
* ``ours-w2@LABEL`` for each ``--tree LABEL=PATH``: the same from another checkout (e.g. a
  ``git worktree`` of the commit before a change), run with that checkout as its working
  directory.

Each run times ``--window`` seconds from its first batch, epoch after epoch. The table shows
each contender's median rows/s with its spread and, per round, its rows/s over torch's in the
same round (the machine is noisy: compare ratios).

Usage::

    python -m benchmarks.spill_rate --rounds 3 --out out/spill_rate.json
    git worktree add /tmp/before HEAD~1
    python -m benchmarks.spill_rate --tree before=/tmp/before --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._common import fmt, machine_info, median, print_table, write_json
from benchmarks._zoo_members import MEMBERS
from benchmarks.peers import summarize

REPO = Path(__file__).resolve().parent.parent
MEMBER = MEMBERS["big-items"]
WORKERS = 2
WINDOW_S = 4.0
LIMIT_S = 120  # a run is killed this long past its window (a stall is an outcome)


def prepare_data(data_dir: str) -> str:
    """The member's data folder, written once by a child process (this one maps no numpy)."""
    argv = [sys.executable, "-m", "benchmarks._zoo_data", data_dir, f"big-items={MEMBER.items}"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"spill_rate: writing the data failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])["big-items"]


def run_one(tool: str, tree: Path, data: str, window_s: float, workdir: str) -> dict:
    """One contender's run in a child process, in ``tree``: rows/s of its timed window."""
    out = os.path.join(workdir, f"{tool}-{os.getpid()}-{len(os.listdir(workdir))}.json")
    spec = {"member": MEMBER.name, "data": data, "items": MEMBER.items, "tool": tool,
            "workers": WORKERS, "batch_size": MEMBER.batch_size, "duration_s": window_s,
            "compare_batches": 0, "digest_path": out + ".digests", "out": out}  # fmt: skip
    with open(out + ".spec", "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [sys.executable, "-m", "benchmarks._zoo_child", out + ".spec"]
    try:
        done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=window_s + LIMIT_S)  # fmt: skip
        crash = None if done.returncode == 0 else done.stderr.strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        crash = f"no result within {window_s + LIMIT_S:.0f} s"
    if not os.path.exists(out):
        return {"samples_per_s": 0.0, "crash": crash or "no result"}
    with open(out) as f:
        result = json.load(f)
    m = summarize(result["times"], result["rows"], window_s, result.get("iter_s"))
    m.pop("series", None)
    m["crash"] = crash or result["error"]
    return m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=WINDOW_S, help="seconds timed per run")
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                   help="also run ours from the checkout at PATH, labelled ours-w2@LABEL")  # fmt: skip
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "ttp_zoo_data"))
    p.add_argument("--out", default="out/spill_rate.json")
    args = p.parse_args(argv)
    data = prepare_data(args.data_dir)
    contenders = [("torch-w2", "torch-np", REPO), ("ours-w2", "ours", REPO)]
    for t in args.tree:
        label, _, path = t.partition("=")
        contenders.append((f"ours-w2@{label}", "ours", Path(path).resolve()))
    runs: dict[str, list[dict]] = {c[0]: [] for c in contenders}
    with tempfile.TemporaryDirectory(prefix="ttp_spill_rate_") as workdir:
        for r in range(args.rounds):
            # Interleaved, each round in another order: drift on a shared machine hits all.
            order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
            for label, tool, tree in order:
                m = run_one(tool, tree, data, args.window, workdir)
                runs[label].append(m)
                print(f"  round {r + 1} {label}: {m['samples_per_s']:.1f} rows/s"
                      + (f" CRASH {m['crash']}" if m["crash"] else ""), flush=True)  # fmt: skip
    torch_rates = [m["samples_per_s"] for m in runs["torch-w2"]]
    rows = []
    for label, _, tree in contenders:
        rates = [m["samples_per_s"] for m in runs[label]]
        ratios = [a / b if b else float("nan") for a, b in zip(rates, torch_rates, strict=True)]
        rows.append({"contender": label, "rows_per_s": median(rates),
                     "spread": f"{min(rates):.1f}-{max(rates):.1f}",
                     "vs_torch": median(ratios),
                     "per_round_vs_torch": " ".join(fmt(x) for x in ratios),
                     "crashes": sum(bool(m["crash"]) for m in runs[label]),
                     "tree": str(tree)})  # fmt: skip
    print_table(rows, ["contender", "rows_per_s", "spread", "vs_torch", "per_round_vs_torch",
                       "crashes"],
                title=f"\nbig-items, batch {MEMBER.batch_size} (32 MiB), {WORKERS} workers, "
                f"{args.window:g} s windows, median of {args.rounds} rounds")  # fmt: skip
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "rows": rows,
                          "runs": runs})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
