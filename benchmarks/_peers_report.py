"""What the peers benchmark (``benchmarks/peers.py``) shows: its tables' columns, Markdown for
BENCHMARKS.md, and plots."""

from __future__ import annotations

import os

from benchmarks import _peers_shape as shape
from benchmarks._common import fmt


def plots(results: dict, png_dir: str) -> list[str]:
    """Bar chart of throughput per scenario and throughput over time under rescaling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(png_dir, exist_ok=True)
    written = []
    for name in ("steady", "udf"):
        rows = results["scenarios"].get(name)
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.bar([r["label"] for r in rows], [r["samples_per_s"] for r in rows])
        ax.set_ylabel("samples/s")
        ax.set_title(f"{name}: throughput (median of repeats)")
        ax.tick_params(axis="x", rotation=70, labelsize=7)
        fig.tight_layout()
        written.append(os.path.join(png_dir, f"peers_{name}.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    rows = results["scenarios"].get("rescale")
    if rows:
        fig, ax = plt.subplots(figsize=(9, 4))
        for r in rows:
            if r["series"]:
                ax.plot([t - r["first_batch_s"] for t, _ in r["series"]],
                        [b for _, b in r["series"]], label=r["label"])  # fmt: skip
        d = results["config"]["duration_s"]
        ax.axvspan(d / 3, 2 * d / 3, color="grey", alpha=0.2, label="1 CPU")
        ax.set_xlabel("s since first batch")
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(os.path.join(png_dir, "peers_rescale.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


COLUMNS = ["label", "samples_per_s", "vs_intune", "peak_pss_mib", "cpu_util", "startup_s",
           "time_to_steady_s", "crash"]  # fmt: skip
# The execution-shape scenarios' table: rows/s with its spread over rounds, ours over each.
SHAPE_COLUMNS = ["label", "samples_per_s", "spread", "ours_vs_this", "startup_s", "peak_pss_mib",
                 "cpu_util", "crashes"]  # fmt: skip
TARGET_COLUMNS = ["scenario", "ours", "vs_every_best", "vs_dataloader_guess", "startup_s",
                  "pss_vs_nodes"]  # fmt: skip


def _md_table(rows: list[dict], cols: list[str]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [fmt(r.get(c)) if c != "samples_per_s" else f"{r[c]:,.0f}" for c in cols]
        out.append("| " + " | ".join(cells) + " |")
    return out


def markdown(results: dict) -> str:
    """The results as Markdown tables, one per scenario, then the targets (for BENCHMARKS.md)."""
    out = []
    for name, rows in results["scenarios"].items():
        out += [f"\n**{name}**\n", *_md_table(rows, SHAPE_COLUMNS if name in shape.SCENARIOS
                                               else COLUMNS)]  # fmt: skip
    if results.get("targets"):
        out += ["\n**targets**\n", *_md_table(list(results["targets"].values()), TARGET_COLUMNS)]
    if results.get("not_run"):
        out += [
            "\n**not run**\n",
            *(f"- {tool}: {why}" for tool, why in results["not_run"].items()),
        ]
    return "\n".join(out) + "\n"
