"""The execution-shape scenarios of ``benchmarks/peers.py``, and the targets every scenario is
judged by.

Three scenarios where the *shape* of execution, more than a worker count, decides the winner:

- ``remote-map``: a user's map-style dataset whose ``__getitem__`` waits 4 ms on a remote read
  (the CPU is idle meanwhile), and a collate that spends 2 ms of CPU per batch of 32.
  Concurrency of reads is what counts: torch's best is many worker processes, torchdata.nodes'
  a thread pool.
- ``cheap-map``: rows that cost ~15 us of CPU each, default collate, batch 128. A hop between
  processes costs more than the work: torch's best is ``num_workers=0``.
- ``fusion``: six cheap maps of 1-3 us of CPU per row, built the way each tool builds a chain:
  the DataLoader runs them inside ``__getitem__``, torchdata.nodes as ``Mapper`` nodes, SPDL as
  ``pipe`` stages, torchtune_pipe as ``Pipeline.from_source(ds).map(f1)...map(f6)`` with
  intune (which may fuse stages while running), and the same with every map fused from the
  start. A hop per map costs more than the map.

Every peer is swept over its knob; torchtune_pipe runs as a user writes it:
``DataLoader(num_workers="auto")`` with nothing else (intune is its default tuner) in the
map-style scenarios. Contenders run in their own processes (``benchmarks/_mapstyle_fns.py``).
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import median

SCENARIOS: dict[str, dict[str, Any]] = {
    "remote-map": dict(rows=40_000, wait_s=0.004, row_cpu_us=0, collate_cpu_us=2000, batch_size=32),
    "cheap-map": dict(rows=200_000, wait_s=0.0, row_cpu_us=15, collate_cpu_us=0, batch_size=128),
    "fusion": dict(
        rows=200_000,
        wait_s=0.0,
        row_cpu_us=0,
        collate_cpu_us=0,
        batch_size=128,
        steps_us=[1, 2, 3, 1, 2, 3],
        shuffle=False,
    ),  # fmt: skip
}
# Each peer's knob, swept (the DataLoader's also over the common guess, workers = cores).
SWEEPS: dict[str, dict[str, tuple[int, ...]]] = {
    "remote-map": {
        "dataloader": (0, 2, 4, 8, 16, 32),
        "nodes-thread": (2, 16, 32, 64),
        "nodes-process": (2, 8),
        "spdl": (16, 64),
    },
    "cheap-map": {
        "dataloader": (0, 1, 2, 4),
        "nodes-thread": (0, 2),
        "nodes-process": (2,),
        "spdl": (1, 2),
    },
    "fusion": {
        "dataloader": (0, 1, 2, 4),
        "nodes-thread": (0, 2),
        "nodes-process": (2,),
        "spdl": (1, 2),
    },
}
QUICK_SWEEPS: dict[str, dict[str, tuple[int, ...]]] = {
    "remote-map": {"dataloader": (2, 16), "nodes-thread": (16,)},
    "cheap-map": {"dataloader": (0, 2), "nodes-thread": (0,)},
    "fusion": {"dataloader": (0, 2), "nodes-thread": (0,)},
}
# torchtune_pipe's contenders: (label, tool of _mapstyle_fns, workers; -1 is "auto").
OURS_CONTENDERS: dict[str, tuple[tuple[str, str, int], ...]] = {
    "remote-map": (("torchtune_pipe-auto", "torchtune_pipe", -1),),
    "cheap-map": (("torchtune_pipe-auto", "torchtune_pipe", -1),),
    "fusion": (
        ("torchtune_pipe-intune", "torchtune_pipe-maps", 0),
        ("torchtune_pipe-intune-fused", "torchtune_pipe-fused", 0),
        ("torchtune_pipe-auto", "torchtune_pipe", -1),  # the drop-in, maps in __getitem__
    ),
}
# The contender every other is compared with (the ``vs_intune``/``intune_ratio`` ratios).
OURS = {"remote-map": "torchtune_pipe-auto", "cheap-map": "torchtune_pipe-auto",
        "fusion": "torchtune_pipe-intune"}  # fmt: skip
MODULE = "benchmarks._mapstyle_fns"
WINDOW_S = 8.0  # timed window per contender; 3 s with --quick
QUICK_WINDOW_S = 3.0

# The targets of the tracker's issue 14 ("Shown by").
TARGET_VS_BEST = 1.0  # ours over the best setting of every peer's sweep
TARGET_VS_GUESS = 1.5  # ours over the DataLoader's common guess (num_workers = cores)
STARTUP_DROP_IN_S = 1.0  # iter() to the first batch, torchtune_pipe.DataLoader
STARTUP_PIPELINE_S = 1.5  # the same for a Pipeline (the DLRM pipeline, the fusion chain)
TARGET_PSS_VS_NODES = 1.3  # peak PSS of the tree over torchdata.nodes' (at its best setting)


def spec(scenario: str, duration_s: float) -> dict:
    """What every contender's process reads in ``scenario``."""
    return dict(SCENARIOS[scenario], duration_s=duration_s)


def startup_target_s(scenario: str) -> float:
    """The start-up target of our contender in ``scenario``: the drop-in's or a Pipeline's."""
    return STARTUP_DROP_IN_S if OURS[scenario] == "torchtune_pipe-auto" else STARTUP_PIPELINE_S


def contender_args(scenario: str, cores: int, quick: bool, spdl: bool) -> list[tuple]:
    """``(label, tool, workers)`` of every contender: each peer's sweep, then ours."""
    sweep = dict((QUICK_SWEEPS if quick else SWEEPS)[scenario])
    sweep["dataloader"] = tuple(sorted({*sweep["dataloader"], cores}))  # the common guess
    if not spdl:
        sweep.pop("spdl", None)
    out = [(f"{tool}-w{w}", tool, w) for tool, ws in sweep.items() for w in ws]
    return out + list(OURS_CONTENDERS[scenario])


def combine_rounds(runs: list[dict]) -> dict:
    """One row from a contender's rounds: the median run's record, with the median rows/s of
    the runs that did not crash, their spread, the median ``startup_s`` and the peak PSS of
    all rounds."""
    row = dict(sorted(runs, key=lambda r: r["samples_per_s"])[len(runs) // 2])
    rates = [r["samples_per_s"] for r in runs if not r.get("crash")]
    starts = [r["startup_s"] for r in runs if r.get("startup_s") is not None]
    row.update(
        runs_samples_per_s=[r["samples_per_s"] for r in runs],
        samples_per_s=median(rates) if rates else 0.0,
        spread=f"{min(rates):,.0f}-{max(rates):,.0f}" if rates else "-",
        startup_s=median(starts) if starts else None,
        peak_pss_mib=max(r.get("peak_pss_mib") or 0.0 for r in runs),
        crashes=sum(bool(r.get("crash")) for r in runs),
    )
    return row


def best(rows: list[dict], tool: str) -> dict | None:
    """The fastest row that did not crash among ``tool``'s (``nodes`` covers ``nodes-thread``
    and ``nodes-process``)."""
    mine = [
        r
        for r in rows
        if (r["tool"] == tool or r["tool"].startswith(tool + "-")) and not r.get("crash")
    ]
    return max(mine, key=lambda r: r["samples_per_s"]) if mine else None


def targets(head: dict, startup_limit_s: float) -> dict:
    """The issue's targets checked on one scenario's :func:`benchmarks.peers.headline`:
    ``{target: {"value", "aim", "met"}}`` (``met`` None where it could not be measured)."""

    def check(value: float | None, aim: float, at_least: bool) -> dict:
        met = None if value is None else (value >= aim if at_least else value <= aim)
        return {"value": value, "aim": aim, "met": met}

    peers = [v for k, v in head.items() if k.endswith("_best") or k.startswith("tfdata_")]
    worst = min((p["intune_ratio"] for p in peers if p["intune_ratio"]), default=None)
    guess = head.get("dataloader_guess")
    ours = head.get("ours_row") or {}
    nodes = head.get("nodes_best")
    pss = (
        ours["peak_pss_mib"] / nodes["peak_pss_mib"]
        if ours.get("peak_pss_mib") and nodes and nodes.get("peak_pss_mib")
        else None
    )
    return {
        "vs_every_best": check(worst, TARGET_VS_BEST, True),
        "vs_dataloader_guess": check(guess and guess["intune_ratio"], TARGET_VS_GUESS, True),
        "startup_s": check(ours.get("startup_s"), startup_limit_s, False),
        "pss_vs_nodes": check(pss, TARGET_PSS_VS_NODES, False),
    }
