"""The dataset zoo's datasets, each written as its users write it: a plain ``Dataset`` or
``IterableDataset`` class of a training script, over the files ``benchmarks/_zoo_data.py``
generates. Random augmentations draw from the sample's index (the README's recipe for the
same batches under any loader), so every loader's batches can be compared with torch's.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import tarfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from benchmarks import _zoo_data as data

IMAGE_OUT = 112
IMAGE_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
IMAGE_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
MAX_TOKENS = 128
STORE_LATENCY_S = 0.003


class ImageFolder(Dataset):
    """``root/class_k/*.jpg``: PIL decode, random resized crop, flip, brightness, normalise."""

    def __init__(self, root: str, seed: int = 0):
        classes = sorted(d for d in os.listdir(root) if d.startswith("class_"))
        self.samples = [(os.path.join(root, c, f), k) for k, c in enumerate(classes)
                        for f in sorted(os.listdir(os.path.join(root, c)))]  # fmt: skip
        self.seed = seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image, ImageEnhance

        path, label = self.samples[i]
        rng = random.Random(self.seed * 1_000_003 + i)
        with Image.open(path) as im:
            im = im.convert("RGB")
        w, h = im.size
        area = rng.uniform(0.35, 1.0) * w * h
        aspect = rng.uniform(3 / 4, 4 / 3)
        cw, ch = min(w, int((area * aspect) ** 0.5)), min(h, int((area / aspect) ** 0.5))
        left, top = rng.randint(0, w - cw), rng.randint(0, h - ch)
        im = im.resize((IMAGE_OUT, IMAGE_OUT), Image.BILINEAR, box=(left, top, left + cw, top + ch))
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        im = ImageEnhance.Brightness(im).enhance(rng.uniform(0.8, 1.2))
        x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - IMAGE_MEAN) / IMAGE_STD, label


class JsonLines(Dataset):
    """One JSON object per line, read into memory; a WordPiece tokenizer in pure Python
    (greedy longest match, ``##`` continuations) per sample."""

    def __init__(self, root: str):
        with open(os.path.join(root, "train.jsonl")) as f:
            self.lines = f.readlines()
        with open(os.path.join(root, "vocab.txt")) as f:
            self.vocab = {w: k + 3 for k, w in enumerate(f.read().split())}  # 0 pad, 1 cls, 2 unk
        self.split = re.compile(r"\w+|[^\w\s]")

    def __len__(self) -> int:
        return len(self.lines)

    def wordpiece(self, word: str) -> list[int]:
        ids, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                    start = end
                    break
            else:
                return [2]
        return ids

    def __getitem__(self, i: int) -> dict[str, Any]:
        record = json.loads(self.lines[i])
        tokens = [t for w in self.split.findall(record["text"].lower()) for t in self.wordpiece(w)]
        return {"input_ids": [1, *tokens[: MAX_TOKENS - 1]], "label": record["label"]}


def pad_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The text member's ``collate_fn``: pad to the longest sample of the batch."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
    return {"input_ids": ids, "attention_mask": ids.ne(0),
            "label": torch.tensor([s["label"] for s in samples])}  # fmt: skip


class TsvShards(IterableDataset):
    """Criteo-like TSV shards; each worker reads the shards ``get_worker_info()`` gives it."""

    def __init__(self, root: str, buckets: int = 100_000):
        self.paths = sorted(os.path.join(root, p) for p in os.listdir(root) if p.endswith(".tsv"))
        self.buckets = buckets

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        info = get_worker_info()
        paths = self.paths if info is None else self.paths[info.id :: info.num_workers]
        for path in paths:
            with open(path) as f:
                for line in f:
                    parts = line.rstrip("\n").split("\t")
                    dense = torch.tensor([float(v) if v else 0.0 for v in parts[1:14]])
                    sparse = torch.tensor([int(v, 16) % self.buckets for v in parts[14:]])
                    yield dense.log1p(), sparse, int(parts[0])


class ArrowTokens(Dataset):
    """A Hugging Face ``datasets`` table saved with ``save_to_disk`` (memory-mapped Arrow)."""

    def __init__(self, root: str):
        from datasets import load_from_disk

        self.table = load_from_disk(os.path.join(root, "table"))

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        row = self.table[i]
        ids = torch.zeros(MAX_TOKENS, dtype=torch.long)
        tokens = row["input_ids"][:MAX_TOKENS]
        ids[: len(tokens)] = torch.tensor(tokens)
        return ids, row["label"]


class PackedRecords(Dataset):
    """Fixed-size binary records, read with ``os.pread`` through a handle opened here.

    ``pread`` rather than ``seek`` + ``read``: forked workers share the handle's offset, and
    seek-then-read from several of them returns other workers' records.
    """

    record = np.dtype([("x", np.float32, data.RECORD_FLOATS), ("y", np.int64)])

    def __init__(self, root: str):
        path = os.path.join(root, "records.bin")
        self.f = open(path, "rb")  # noqa: SIM115 -- held for the dataset's life
        self.n = os.path.getsize(path) // self.record.itemsize

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        size = self.record.itemsize
        rec = np.frombuffer(os.pread(self.f.fileno(), size, i * size), dtype=self.record)[0]
        return torch.from_numpy(rec["x"].copy()), int(rec["y"])


class TarShards(IterableDataset):
    """WebDataset-layout tar shards (``KEY.npy``, ``KEY.cls``, ``KEY.json`` side by side),
    read with ``tarfile``; shards split across workers by ``get_worker_info()``."""

    def __init__(self, root: str):
        self.urls = sorted(os.path.join(root, p) for p in os.listdir(root) if p.endswith(".tar"))

    def _samples(self, url: str) -> Iterator[dict[str, Any]]:
        sample: dict[str, Any] = {}
        with tarfile.open(url) as tar:
            for member in tar:
                key, ext = member.name.split(".", 1)
                if sample and sample["__key__"] != key:
                    yield sample
                    sample = {}
                sample["__key__"] = key
                sample[ext] = tar.extractfile(member).read()
        if sample:
            yield sample

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int, int]]:
        info = get_worker_info()
        urls = self.urls if info is None else self.urls[info.id :: info.num_workers]
        for url in urls:
            for s in self._samples(url):
                x = torch.from_numpy(np.load(io.BytesIO(s["npy"]))).float().div_(255.0)
                caption = json.loads(s["json"])["caption"]
                yield x, int(s["cls"]), len(caption)


class ObjectStoreClient:
    """A key-value store client whose every ``get`` waits on the network (a sleep here)."""

    def __init__(self, root: str, latency_s: float):
        self.root = root
        self.latency_s = latency_s

    def get(self, key: str) -> bytes:
        time.sleep(self.latency_s)
        with open(os.path.join(self.root, key), "rb") as f:
            return f.read()


class RemoteRows(Dataset):
    """Rows fetched one ``get`` per sample from an object store."""

    def __init__(self, root: str, latency_s: float = STORE_LATENCY_S):
        with open(os.path.join(root, "manifest.txt")) as f:
            self.keys = f.read().split()
        self.store = ObjectStoreClient(os.path.join(root, "objects"), latency_s)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        key = self.keys[i]
        x = torch.from_numpy(np.frombuffer(self.store.get(key), dtype=np.float32).copy())
        return x, int(key.rsplit("-", 1)[1])


class TinyRows(Dataset):
    """In-memory rows whose features cost ~10 us of small tensor ops each."""

    def __init__(self, root: str):
        self.x = torch.from_numpy(np.load(os.path.join(root, "x.npy")))
        self.y = torch.from_numpy(np.load(os.path.join(root, "y.npy")))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        return torch.cat([x, x.square()]).mul_(0.5), self.y[i]


class BigItems(Dataset):
    """8 MiB arrays, one ``.npy`` file each (the items cycle over the files)."""

    def __init__(self, root: str, items: int):
        self.paths = sorted(os.path.join(root, p) for p in os.listdir(root) if p.endswith(".npy"))
        self.items = items

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.load(self.paths[i % len(self.paths)])), i


class MemmapRows(Dataset):
    """Rows of a ``np.memmap`` opened here; each sample copies its row out."""

    def __init__(self, root: str):
        self.y = np.load(os.path.join(root, "y.npy"))
        self.x = np.memmap(os.path.join(root, "x.f32"), dtype=np.float32, mode="r",
                           shape=(len(self.y), data.MEMMAP_ROW_FLOATS))  # fmt: skip

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.array(self.x[i])), int(self.y[i])


class TensorOps(Dataset):
    """Images loaded with ``torch.load``; ``__getitem__`` normalises, pools and takes a
    spectrum with torch ops."""

    def __init__(self, root: str):
        saved = torch.load(os.path.join(root, "images.pt"))
        self.images, self.labels = saved["images"], saved["labels"]
        self.mean, self.std = self.images.mean(), self.images.std()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = ((self.images[i] - self.mean) / self.std).view(1, 1, data.TENSOR_SIDE, -1)
        x = torch.nn.functional.avg_pool2d(
            torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect"), 3, stride=1
        )
        spectrum = torch.fft.rfft2(x).abs().log1p()
        return torch.cat([x.flatten(), spectrum.flatten()]), self.labels[i]


def make(name: str, root: str, items: int) -> tuple[Dataset, Callable | None]:
    """``(dataset, collate_fn)`` of member ``name`` over its data in ``root`` (None: torch's
    default collate)."""
    if name == "big-items":
        return BigItems(root, items), None
    datasets: dict[str, Callable[[str], Dataset]] = {
        "images": ImageFolder, "jsonl": JsonLines, "tsv-shards": TsvShards,
        "hf-arrow": ArrowTokens, "packed-records": PackedRecords, "webdataset-tar": TarShards,
        "remote-store": RemoteRows, "tiny-rows": TinyRows, "memmap": MemmapRows,
        "tensor-ops": TensorOps, "small-eval": TinyRows,
    }  # fmt: skip
    return datasets[name](root), pad_collate if name == "jsonl" else None
