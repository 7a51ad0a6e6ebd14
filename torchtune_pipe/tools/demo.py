"""The demo that ships with the package: a click-through model trained on generated click logs
through a tuned :class:`~torchtune_pipe.DataLoader`, with nothing but torch.

``torchtune-pipe demo`` runs the repository's TorchRec DLRM example (``examples/dlrm``) when
it is run from a clone with TorchRec installed, and this one otherwise. Each sample is a
Criteo-like text line (13 counts, 26 categorical ids, a click label) made from its index,
then parsed and hashed in ``__getitem__``: the CPU work a real click log costs. The loader
runs with ``num_workers="auto"`` (a fetch and a collate stage) and a tuner moving workers and
buffers between them; every decision goes to a tuning log that ``torchtune-pipe watch`` shows
live and ``torchtune-pipe report`` plots.

Example:
    $ torchtune-pipe demo --time-budget-s 20
    $ torchtune-pipe report out/demo/tuning.jsonl
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from torchtune_pipe.dataloader import DataLoader
from torchtune_pipe.tuning.registry import TUNERS

DENSE, SPARSE, BUCKETS = 13, 26, 100
TORCHREC_HINT = (
    "TorchRec's DLRM on Criteo-format data is the repository's version of this demo: in a "
    "clone of the torchtune_pipe repository, `make demo`."
)


class ClickLogs(torch.utils.data.Dataset):
    """Generated click-log rows: ``(dense float[13], sparse int64[26], label float)``.

    Row ``i`` is the same on every call and in every process (drawn from ``seed`` and ``i``);
    it is formatted as a tab-separated line and parsed again, as a text click log would be.
    Clicks follow a hidden logistic model drawn from ``world``: a held-out set is another
    ``seed`` of the same ``world``.
    """

    def __init__(self, rows: int, seed: int = 0, world: int = 0):
        if rows < 1:
            raise ValueError(f"ClickLogs: rows must be >= 1, got {rows}")
        self.rows, self.seed = rows, seed
        g = torch.Generator().manual_seed(world)
        self._w_dense = torch.randn(DENSE, generator=g)
        self._w_sparse = torch.randn(SPARSE, BUCKETS, generator=g)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        counts = torch.poisson(torch.full((DENSE,), 3.0), generator=g).long()
        ids = torch.randint(0, 1 << 30, (SPARSE,), generator=g)
        line = "\t".join([*(str(c) for c in counts.tolist()), *(f"{x:08x}" for x in ids.tolist())])
        return self._parse(line, g)

    def _parse(
        self, line: str, g: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fields = line.split("\t")
        dense = torch.tensor([float(x) for x in fields[:DENSE]]).log1p()
        sparse = torch.tensor([int(x, 16) % BUCKETS for x in fields[DENSE:]])
        logit = dense @ self._w_dense / 3 + self._w_sparse[torch.arange(SPARSE), sparse].sum() / 3
        label = (torch.rand((), generator=g) < torch.sigmoid(logit)).float()
        return dense, sparse, label


class ClickModel(nn.Module):
    """Embeddings of the hashed ids (summed) beside an MLP of the counts, then an MLP."""

    offsets: torch.Tensor

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.EmbeddingBag(SPARSE * BUCKETS, dim, mode="sum")
        self.dense = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, dim))
        self.top = nn.Sequential(nn.Linear(2 * dim, 32), nn.ReLU(), nn.Linear(32, 1))
        self.register_buffer("offsets", torch.arange(SPARSE) * BUCKETS, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        e = self.embed(sparse + self.offsets)
        return self.top(torch.cat([e, self.dense(dense)], dim=1)).squeeze(1)


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (rank statistic; ties get their mean rank)."""
    order = scores.argsort()
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    for v in scores.unique():  # mean rank over ties
        tie = scores == v
        ranks[tie] = ranks[tie].mean()
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="torchtune-pipe demo",
        description="Train a click model on generated click logs through a tuned DataLoader "
        "(torch only). " + TORCHREC_HINT,
    )
    p.add_argument("--rows", type=int, default=200_000, help="generated training rows")
    p.add_argument("--val-rows", type=int, default=5_000, help="generated held-out rows")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--time-budget-s", type=float, default=60.0, help="stop training after this")
    p.add_argument("--tuner", default="intune", choices=TUNERS)
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between tuning steps")
    p.add_argument("--out", default="out/demo", help="where the tuning log is written")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("rows", "val_rows", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; see the module docstring."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "tuning.jsonl"
    log_path.unlink(missing_ok=True)
    model = ClickModel()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    print(
        f"demo: {args.rows:,} generated click-log rows, batch {args.batch_size}, tuner "
        f"{args.tuner}, {args.time_budget_s:g} s; tuning log {log_path}\n"
        f"  watch it live from another terminal: torchtune-pipe watch {log_path}",
        flush=True,
    )
    samples, t0 = 0, time.perf_counter()
    last_print = t0
    with DataLoader(
        ClickLogs(args.rows, seed=args.seed, world=args.seed), batch_size=args.batch_size, shuffle=True,
        num_workers="auto", tuner=args.tuner, tuning_interval_s=args.interval_s,
        tuning_log=str(log_path), generator=torch.Generator().manual_seed(args.seed),
    ) as loader:  # fmt: skip
        epoch = 0
        while time.perf_counter() - t0 < args.time_budget_s:
            loader.set_epoch(epoch)
            for dense, sparse, label in loader:
                loss = loss_fn(model(dense, sparse), label)
                opt.zero_grad()
                loss.backward()
                opt.step()
                samples += len(label)
                now = time.perf_counter()
                if now - last_print >= 5:
                    last_print = now
                    obs = loader.loader.observe()
                    workers = list(obs.workers) if obs is not None else "-"
                    print(
                        f"[{now - t0:5.1f} s] {samples / (now - t0):8,.0f} samples/s  loss "
                        f"{loss.item():.3f}  workers (fetch, collate) {workers}",
                        flush=True,
                    )
                if now - t0 >= args.time_budget_s:
                    break
            epoch += 1
        train_s = time.perf_counter() - t0
    model.eval()
    val = ClickLogs(args.val_rows, seed=args.seed + 1, world=args.seed)
    with torch.no_grad(), DataLoader(val, batch_size=1024) as val_loader:
        scores, labels = zip(*((model(d, s), y) for d, s, y in val_loader), strict=True)
    print("-" * 72)
    print(f"held-out AUROC   {auroc(torch.cat(scores), torch.cat(labels)):.4f}")
    print(f"trained          {samples:,} samples in {train_s:.1f} s = {samples / train_s:,.0f}/s")
    print(f"tuning log       {log_path}")
    print(f"see the tuner    torchtune-pipe report {log_path}   (a PNG; needs matplotlib)")
    print(f"TorchRec         {TORCHREC_HINT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
