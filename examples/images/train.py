"""Images: decode + augment as pipeline stages, tuned while a small CNN trains.

The images are made on the fly (no download): random shapes drawn into RGB arrays and
encoded as PNG bytes, held in memory as a real image folder would hold files. The pipeline
reads the encoded bytes, decodes them (Pillow), augments them (random crop and flip, in
torch), and batches them with torch's ``default_collate``; ``--tuner`` moves workers and
buffers between the decode and augment stages while the model trains.

Random numbers in a stage: each sample's augmentation draws from a generator seeded by the
run's seed and the sample's index, not from a worker's global generator, so the batches are
the same for the same seed whatever the worker counts and whichever worker runs the sample
(README, "Same batches, and random numbers in ``__getitem__``").

Usage::

    python -m examples.images.train --images 2000 --epochs 2 --tuner intune

Needs Pillow (``pip install pillow``; matplotlib installs it too).
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from torchtune_pipe import MapDatasetSource, Pipeline

SIZE, CROP, CLASSES = 40, 32, 4


def make_images(n: int, seed: int = 0) -> list[tuple[bytes, int]]:
    """``n`` PNG-encoded RGB images of one of four shapes, with the shape as the label."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        label = int(rng.integers(CLASSES))
        im = Image.fromarray(rng.integers(0, 60, (SIZE, SIZE, 3), dtype=np.uint8))
        draw = ImageDraw.Draw(im)
        x, y = (int(v) for v in rng.integers(4, SIZE // 2, 2))
        box = (x, y, x + SIZE // 2 - 2, y + SIZE // 2 - 2)
        color = tuple(int(c) for c in rng.integers(120, 256, 3))
        [draw.rectangle, draw.ellipse, draw.line, draw.point][label](box, fill=color)
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        out.append((buf.getvalue(), label))
    return out


class EncodedImages(torch.utils.data.Dataset):
    """A map-style dataset of ``(png_bytes, label)`` (an image folder, in memory)."""

    def __init__(self, items: list[tuple[bytes, int]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[int, bytes, int]:
        data, label = self.items[i]
        return i, data, label


def decode(item: tuple[int, bytes, int]) -> tuple[int, torch.Tensor, int]:
    """PNG bytes -> float tensor ``[3, SIZE, SIZE]`` in 0..1."""
    from PIL import Image

    i, data, label = item
    with Image.open(io.BytesIO(data)) as im:
        array = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
    return i, torch.from_numpy(array).permute(2, 0, 1).contiguous(), label


class Augment:
    """Random ``CROP`` crop and horizontal flip, drawn from ``(seed, index)``."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def __call__(self, item: tuple[int, torch.Tensor, int]) -> tuple[torch.Tensor, int]:
        i, image, label = item
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        top, left = (int(v) for v in torch.randint(0, SIZE - CROP + 1, (2,), generator=g))
        image = image[:, top : top + CROP, left : left + CROP]
        if torch.rand((), generator=g) < 0.5:
            image = image.flip(2)
        return image, label


def build_pipeline(images: list[tuple[bytes, int]], batch_size: int, seed: int) -> Pipeline:
    """read -> decode -> augment -> batch (``default_collate``: a ``[B, 3, CROP, CROP]``
    tensor and a ``[B]`` label tensor)."""
    source = MapDatasetSource(
        EncodedImages(images), shuffle=True, generator=torch.Generator().manual_seed(seed),
        entries_per_unit=16,
    )  # fmt: skip
    return (
        Pipeline.from_source(source, name="read")
        .map(decode, name="decode", workers=1)
        .map(Augment(seed), name="augment", workers=1)
        .batch(batch_size)
    )


def model() -> nn.Module:
    """A small CNN for ``CROP`` x ``CROP`` RGB images."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, CLASSES),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Train for ``--epochs`` and print the accuracy and the tuner's last allocation."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--tuner", default="intune")
    p.add_argument("--interval-s", type=float, default=1.0)
    p.add_argument("--tuning-log", default=None, help="JSON lines of the tuner's decisions")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    pipe = build_pipeline(make_images(args.images, args.seed), args.batch_size, args.seed)
    t0, seen, correct = time.perf_counter(), 0, 0
    with pipe.loader(
        tuner=args.tuner, tuning_interval_s=args.interval_s, tuning_log=args.tuning_log
    ) as loader:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            seen = correct = 0
            for images, labels in loader:
                logits = net(images)
                loss = nn.functional.cross_entropy(logits, labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen += len(labels)
                correct += int((logits.argmax(1) == labels).sum())
            print(f"epoch {epoch}: {seen} images, train accuracy {correct / max(seen, 1):.2f}")
        obs = loader.observe()
    elapsed = time.perf_counter() - t0
    workers = {s.name: s.workers for s in obs.stages} if obs is not None else {}
    print(f"{args.epochs * args.images / elapsed:,.0f} images/s; workers {workers}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
