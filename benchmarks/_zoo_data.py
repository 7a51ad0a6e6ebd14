"""The files the dataset zoo (``benchmarks/zoo.py``) reads, generated once per size.

``python -m benchmarks._zoo_data ROOT NAME=ITEMS ...`` writes each member's data to
``ROOT/NAME-ITEMS/`` (skipped when a finished copy is there) and prints ``{NAME: folder}`` as
its last line. It runs in a child process, so the harness maps none of numpy, PIL or
``datasets`` (see ``benchmarks/_peers_data.py``). Everything is drawn from fixed seeds.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import sys
import tarfile
from collections.abc import Callable

import numpy as np

DONE = ".complete"
LETTERS = "etaoinshrdlucmfwypvbgkqjxz"
IMAGE_CLASSES = 10
IMAGE_SIZE = (320, 240)  # width, height: a small photo
SHARDS = 4
STORE_ROW_FLOATS = 128
BIG_ITEM_FLOATS = 2 << 20  # 8 MiB of float32
BIG_FILES = 24  # the items cycle over these files (page cache, not disk, is read)
MEMMAP_ROW_FLOATS = 256  # 1 KiB rows
TENSOR_SIDE = 32
RECORD_FLOATS = 64  # a packed record: 64 float32 features, then an int64 label


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choices(LETTERS, k=rng.randint(2, 9))) for _ in range(n)]


def _images(folder: str, items: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    w, h = IMAGE_SIZE
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    yy, xx = yy / h, xx / w
    for i in range(items):
        label = i % IMAGE_CLASSES
        a, b, c = rng.uniform(0, 255, 3)
        base = np.stack([a * xx, b * yy, c * (1 - xx * yy)], axis=-1)
        pixels = np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype(np.uint8)
        os.makedirs(os.path.join(folder, f"class_{label}"), exist_ok=True)
        Image.fromarray(pixels).save(os.path.join(folder, f"class_{label}", f"{i:06d}.jpg"),
                                     quality=90)  # fmt: skip


def _jsonl(folder: str, items: int) -> None:
    rng = random.Random(0)
    words = sorted(set(_words(rng, 6000)))
    # A WordPiece vocabulary: every other word whole, the rest spelled from pieces.
    pieces = [*LETTERS, *(a + b for a in LETTERS for b in LETTERS)]
    vocab = [*words[::2], *pieces, *("##" + p for p in pieces)]
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        for i in range(items):
            picked = rng.choices(words, k=rng.randint(16, 160))
            text = " ".join(w.capitalize() if rng.random() < 0.1 else w for w in picked)
            f.write(json.dumps({"id": i, "text": text + ".", "label": rng.randint(0, 4)}) + "\n")


def _tsv_shards(folder: str, items: int) -> None:
    rng = random.Random(0)
    for s in range(SHARDS):
        with open(os.path.join(folder, f"part-{s:05d}.tsv"), "w") as f:
            for _ in range(items // SHARDS):
                dense = [str(rng.randint(0, 5000)) if rng.random() > 0.1 else "" for _ in range(13)]
                cats = [f"{rng.getrandbits(32):08x}" for _ in range(26)]
                f.write("\t".join([str(int(rng.random() < 0.03)), *dense, *cats]) + "\n")


def _hf_arrow(folder: str, items: int) -> None:
    from datasets import Dataset

    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 128, items)
    columns = {
        "input_ids": [rng.integers(1, 30_000, n).tolist() for n in lengths],
        "label": rng.integers(0, 2, items).tolist(),
    }
    Dataset.from_dict(columns).save_to_disk(os.path.join(folder, "table"))


def _packed_records(folder: str, items: int) -> None:
    rng = np.random.default_rng(0)
    record = np.dtype([("x", np.float32, RECORD_FLOATS), ("y", np.int64)])
    rows = np.zeros(items, dtype=record)
    rows["x"] = rng.standard_normal((items, RECORD_FLOATS), dtype=np.float32)
    rows["y"] = np.arange(items)
    rows.tofile(os.path.join(folder, "records.bin"))


def _webdataset_tar(folder: str, items: int) -> None:
    rng = np.random.default_rng(0)
    per_shard = items // SHARDS
    for s in range(SHARDS):
        with tarfile.open(os.path.join(folder, f"shard-{s:06d}.tar"), "w") as tar:
            for k in range(per_shard):
                key = f"{s * per_shard + k:08d}"
                buf = io.BytesIO()
                np.save(buf, rng.integers(0, 256, (3, 32, 32), dtype=np.uint8))
                meta = {"key": key, "caption": " ".join(_words(random.Random(key), 6))}
                files = {"npy": buf.getvalue(), "cls": str(int(key) % 10).encode(),
                         "json": json.dumps(meta).encode()}  # fmt: skip
                for ext, data in files.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def _remote_store(folder: str, items: int) -> None:
    rng = np.random.default_rng(0)
    objects = os.path.join(folder, "objects")
    os.makedirs(objects)
    keys = []
    for i in range(items):
        key = f"obj-{i:07d}-{i % 7}"
        rng.standard_normal(STORE_ROW_FLOATS, dtype=np.float32).tofile(os.path.join(objects, key))
        keys.append(key)
    with open(os.path.join(folder, "manifest.txt"), "w") as f:
        f.write("\n".join(keys) + "\n")


def _tiny_rows(folder: str, items: int) -> None:
    rng = np.random.default_rng(0)
    np.save(os.path.join(folder, "x.npy"), rng.standard_normal((items, 16), dtype=np.float32))
    np.save(os.path.join(folder, "y.npy"), rng.integers(0, 2, items))


def _big_items(folder: str, items: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(min(items, BIG_FILES)):
        np.save(os.path.join(folder, f"item-{i:04d}.npy"),
                rng.standard_normal(BIG_ITEM_FLOATS, dtype=np.float32))  # fmt: skip


def _memmap(folder: str, items: int) -> None:
    rng = np.random.default_rng(0)
    x = np.memmap(os.path.join(folder, "x.f32"), dtype=np.float32, mode="w+",
                  shape=(items, MEMMAP_ROW_FLOATS))  # fmt: skip
    for lo in range(0, items, 8192):
        hi = min(items, lo + 8192)
        x[lo:hi] = rng.standard_normal((hi - lo, MEMMAP_ROW_FLOATS), dtype=np.float32)
    x.flush()
    del x
    np.save(os.path.join(folder, "y.npy"), rng.integers(0, 10, items))


def _tensor_ops(folder: str, items: int) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    torch.save({"images": torch.rand(items, TENSOR_SIDE, TENSOR_SIDE, generator=g),
                "labels": torch.randint(0, 10, (items,), generator=g)},
               os.path.join(folder, "images.pt"))  # fmt: skip


WRITERS: dict[str, Callable[[str, int], None]] = {
    "images": _images,
    "jsonl": _jsonl,
    "tsv-shards": _tsv_shards,
    "hf-arrow": _hf_arrow,
    "packed-records": _packed_records,
    "webdataset-tar": _webdataset_tar,
    "remote-store": _remote_store,
    "tiny-rows": _tiny_rows,
    "big-items": _big_items,
    "memmap": _memmap,
    "tensor-ops": _tensor_ops,
    "small-eval": _tiny_rows,
}


def ensure(root: str, name: str, items: int) -> str:
    """The folder holding member ``name``'s data of ``items`` samples, written if missing."""
    folder = os.path.join(root, f"{name}-{items}")
    if os.path.exists(os.path.join(folder, DONE)):
        return folder
    shutil.rmtree(folder, ignore_errors=True)  # a half-written copy
    os.makedirs(folder)
    WRITERS[name](folder, items)
    open(os.path.join(folder, DONE), "w").close()
    return folder


def main(argv: list[str]) -> int:
    """Entry point: ``python -m benchmarks._zoo_data ROOT NAME=ITEMS ...``."""
    root, wanted = argv[0], [a.split("=") for a in argv[1:]]
    folders = {name: ensure(root, name, int(items)) for name, items in wanted}
    print(json.dumps(folders))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
