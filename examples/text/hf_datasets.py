"""Text from a Hugging Face ``datasets.Dataset`` through the drop-in DataLoader.

A ``datasets.Dataset`` is a map-style dataset (``__getitem__(int)`` -> a dict of columns,
``__len__``), so ``torchtune_pipe.DataLoader`` takes it as torch's DataLoader does. The
dataset here is made on the fly with ``Dataset.from_dict`` (no download): short reviews built
from positive and negative words, labelled by which kind dominates. The collate function
tokenizes (hashing words into a fixed vocabulary) and pads, the CPU work a tokenizer does;
with ``num_workers="auto"`` fetching and collating are two stages the tuner balances.

Without the ``datasets`` package, the same class of dataset (``__getitem__`` returning a dict
of columns, ``__len__``) is built by hand, and everything else runs unchanged.

Usage::

    python -m examples.text.hf_datasets --rows 4000 --epochs 2
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from torchtune_pipe import DataLoader

POSITIVE = "good great fine superb lovely fun bright warm clever solid".split()
NEGATIVE = "bad awful poor dull boring weak grim cold clumsy flat".split()
NEUTRAL = "the a film plot actor scene story music ending pace and but it was".split()
VOCAB, MAX_LEN = 4096, 32


def reviews(rows: int, seed: int = 0) -> dict[str, list]:
    """Columns ``text`` and ``label`` (1: more positive than negative words)."""
    rng = random.Random(seed)
    text, label = [], []
    for _ in range(rows):
        pos, neg = rng.randint(0, 4), rng.randint(0, 4)
        words = rng.sample(POSITIVE, pos) + rng.sample(NEGATIVE, neg)
        words += rng.choices(NEUTRAL, k=rng.randint(4, 16))
        rng.shuffle(words)
        text.append(" ".join(words))
        label.append(int(pos > neg))
    return {"text": text, "label": label}


class Columns(torch.utils.data.Dataset):
    """What ``datasets.Dataset`` looks like to a loader, for when it is not installed."""

    def __init__(self, columns: dict[str, list]):
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[i] for k, v in self.columns.items()}


def make_dataset(rows: int, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` made in memory (or :class:`Columns` without ``datasets``)."""
    try:
        from datasets import Dataset
    except ModuleNotFoundError:
        return Columns(reviews(rows, seed))
    return Dataset.from_dict(reviews(rows, seed))


def tokenize(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Collate: hash each word into ``VOCAB`` ids (0 is padding), pad to ``MAX_LEN``."""
    import zlib

    ids = torch.zeros(len(samples), MAX_LEN, dtype=torch.long)
    for row, s in enumerate(samples):
        tokens = [1 + zlib.crc32(w.encode()) % (VOCAB - 1) for w in s["text"].split()][:MAX_LEN]
        ids[row, : len(tokens)] = torch.tensor(tokens)
    return {"ids": ids, "label": torch.tensor([s["label"] for s in samples], dtype=torch.float)}


class BagOfWords(nn.Module):
    """Mean word embedding -> logit."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCAB, dim, mode="mean", padding_idx=0)
        self.out = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids)).squeeze(1)


def main(argv: Sequence[str] | None = None) -> int:
    """Train for ``--epochs`` and print the accuracy."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--tuner", default="heuristic")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    dataset = make_dataset(args.rows, args.seed)
    net = BagOfWords()
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    t0 = time.perf_counter()
    with DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers="auto",
        collate_fn=tokenize, tuner=args.tuner,
        generator=torch.Generator().manual_seed(args.seed),
    ) as loader:  # fmt: skip
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            seen = correct = 0
            for batch in loader:
                logits = net(batch["ids"])
                loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen += len(logits)
                correct += int(((logits > 0).float() == batch["label"]).sum())
            print(f"epoch {epoch}: {seen} reviews, train accuracy {correct / max(seen, 1):.2f}")
    kind = type(dataset).__module__.split(".")[0]
    elapsed = time.perf_counter() - t0
    print(f"{args.epochs * args.rows / elapsed:,.0f} reviews/s from a {kind} dataset")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
