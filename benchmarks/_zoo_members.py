"""The dataset zoo's members, as the harness (``benchmarks/zoo.py``) sees them: names, sizes,
batch sizes. No torch here: the harness measures its children's memory and must map none of
their libraries (``benchmarks/_peers_data.py`` says why); the datasets themselves are in
``benchmarks/_zoo_datasets.py`` and their files are written by ``benchmarks/_zoo_data.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    """One dataset of the zoo.

    Attributes:
        name: the member's name (``--members``).
        what: what the user's dataset does, in one line.
        batch_size: the loader's ``batch_size``.
        items: samples the generated data holds in a full run (an epoch of about a second at
            torch's best setting on 2 cores; ``small-eval``'s, a validation set, ~10 ms);
            ``quick_items`` with ``--quick``.
        iterable: an ``IterableDataset`` (sharded by ``get_worker_info()``); torchdata.nodes
            has nothing to parallelise it with, so it is not run.
        waits: ``__getitem__`` mostly waits (torchdata.nodes then runs a wide thread pool).
        compare_batches: the first batches of each run compared with torch's.
    """

    name: str
    what: str
    batch_size: int
    items: int
    quick_items: int
    iterable: bool = False
    waits: bool = False
    compare_batches: int = 8


MEMBERS: dict[str, Member] = {
    m.name: m
    for m in (
        Member("images", "JPEG folder, PIL decode + random crop/flip/brightness, normalise",
               batch_size=64, items=1200, quick_items=96),
        Member("jsonl", "JSON lines, json.loads + pure-Python WordPiece, pad in collate_fn",
               batch_size=128, items=8_000, quick_items=512),
        Member("tsv-shards", "IterableDataset over 4 TSV shards split by get_worker_info()",
               batch_size=512, items=48_000, quick_items=2048, iterable=True),
        Member("hf-arrow", "Hugging Face datasets Arrow table (load_from_disk), rows to tensors",
               batch_size=128, items=24_000, quick_items=512),
        Member("packed-records", "fixed-size binary records, os.pread on a handle opened in "
               "__init__", batch_size=256, items=120_000, quick_items=1024),
        Member("webdataset-tar", "IterableDataset over WebDataset-layout tar shards (tarfile)",
               batch_size=64, items=8_000, quick_items=256, iterable=True),
        Member("remote-store", "object-store client: each get waits 3 ms (time.sleep)",
               batch_size=32, items=1_600, quick_items=64, waits=True),
        Member("tiny-rows", "in-memory rows of ~10 us of tensor ops each",
               batch_size=256, items=80_000, quick_items=1024),
        Member("big-items", "8 MiB float32 .npy files, np.load per item",
               batch_size=4, items=64, quick_items=8, compare_batches=3),
        Member("memmap", "np.memmap of 1 KiB rows opened in __init__, rows copied out",
               batch_size=256, items=120_000, quick_items=1024),
        Member("tensor-ops", "torch.load'ed images; normalise, pool, FFT in __getitem__",
               batch_size=64, items=10_000, quick_items=128),
        Member("small-eval", "a validation set of 1,024 tiny-rows rows, read whole each time "
               "(epochs of ~10 ms)", batch_size=64, items=1_024, quick_items=256),
    )
}  # fmt: skip
