"""Workloads for the simulator: two DLRM-like presets and a generator of random pipelines.

Costs are per input item on a ~2.5 GHz server core and are chosen so that, as on the
DLRM trainers InTune targets, the data pipeline (not the model) limits training from 8 up to
~128 CPUs. Each builder takes a seed that jitters the costs by +-10%, so a tuner cannot learn
one exact pipeline.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

from torchtune_pipe.sim.model import Drift, StageModel, Workload
from torchtune_pipe.tuning.base import MiB

__all__ = [
    "netflix_like",
    "criteo_like",
    "fusion_like",
    "generate",
    "with_batch_size",
    "with_frames",
    "images_like",
    "images_threads_like",
    "text_like",
    "cpu_s_per_output",
    "PRESETS",
    "THREAD_PRESETS",
]

US = 1e-6


def _jitter(rng: random.Random) -> float:
    return rng.uniform(0.9, 1.1)


def netflix_like(seed: int = 0) -> Workload:
    """Load -> shuffle -> UDF -> batch -> prefetch; the UDF takes ~42% of the pipeline's CPU.

    Rows of ~2 KB are read from remote storage in 8 MiB chunks, shuffled in a 100k-row buffer,
    transformed by a heavy-tailed Python UDF whose cost drifts slowly, collated into batches of
    1024 and prefetched (pinned) for the trainer.
    """
    rng = random.Random(seed)
    row = 2048
    batch = 1024
    load_cpu, shuffle_cpu, collate_cpu, pin_cpu = 40 * US, 2 * US, 8 * US, 200 * US
    # UDF share: u / (u + rest) = 0.42 of the CPU time per batch.
    rest = load_cpu + shuffle_cpu + collate_cpu + pin_cpu / batch
    udf_cpu = 0.42 / 0.58 * rest
    stages = (
        StageModel(
            "load", "source", load_cpu * _jitter(rng), cpu_cv=0.5,
            io_s_per_item=15 * US * _jitter(rng), bytes_per_item=row,
        ),
        StageModel(
            "shuffle", "shuffle", shuffle_cpu * _jitter(rng), cpu_cv=0.2,
            bytes_per_item=row, max_workers=4, resident_bytes=100_000 * row,
        ),
        StageModel(
            "udf", "map", udf_cpu * _jitter(rng), cpu_cv=1.5, bytes_per_item=row,
            drift=Drift(period_s=600.0, amplitude=0.3, phase=rng.uniform(0, 2 * math.pi)),
        ),
        StageModel(
            "batch", "batch", collate_cpu * _jitter(rng), cpu_cv=0.3, ratio=batch,
            bytes_per_item=batch * row,
        ),
        StageModel(
            "prefetch", "prefetch", pin_cpu * _jitter(rng), cpu_cv=0.2,
            bytes_per_item=batch * row, max_workers=4,
        ),
    )  # fmt: skip
    return Workload("netflix_like", stages, consumer_step_s=0.5e-3)


def criteo_like(seed: int = 0) -> Workload:
    """Remote read -> parse -> shuffle -> dense transform -> sparse hashing -> batch -> prefetch.

    The read stage waits on object-store latency (1 MiB objects, ~30 ms each) much more than it
    computes, so it scales past the core count; sparse feature hashing is the heavy UDF.
    """
    rng = random.Random(seed)
    raw, row, batch = 160, 300, 4096
    stages = (
        StageModel(
            "read", "source", 2 * US * _jitter(rng), cpu_cv=1.0,
            io_s_per_item=40 * US * _jitter(rng), bytes_per_item=raw,
        ),
        StageModel("parse", "map", 10 * US * _jitter(rng), cpu_cv=0.3, bytes_per_item=row),
        StageModel(
            "shuffle", "shuffle", 1 * US * _jitter(rng), cpu_cv=0.2, bytes_per_item=row,
            max_workers=4, resident_bytes=1_000_000 * row,
        ),
        StageModel("dense", "map", 4 * US * _jitter(rng), cpu_cv=0.2, bytes_per_item=row),
        StageModel(
            "sparse_hash", "map", 14 * US * _jitter(rng), cpu_cv=0.8, bytes_per_item=row,
            drift=Drift(period_s=900.0, amplitude=0.25, phase=rng.uniform(0, 2 * math.pi)),
        ),
        StageModel(
            "batch", "batch", 2 * US * _jitter(rng), cpu_cv=0.3, ratio=batch,
            bytes_per_item=batch * row,
        ),
        StageModel(
            "prefetch", "prefetch", 150 * US * _jitter(rng), cpu_cv=0.2,
            bytes_per_item=batch * row, max_workers=4,
        ),
    )  # fmt: skip
    return Workload("criteo_like", stages, consumer_step_s=1e-3)


# What an item costs to cross a channel between two stages besides the DRAM copy: BENCHMARKS.md
# measures ~2.5 us per row for the hops of the UDF-heavy peers scenario (per process).
HOP_S_PER_ITEM = 2.5 * US


def fusion_like(seed: int = 0, cpus_hint: int = 8) -> Workload:
    """Read -> six cheap maps (1-3 us of CPU per row each) -> batch: where fusion matters
    (issue 14's ``fusion`` scenario; eight stages, the longest the InTune agent has weights
    for).

    Each map costs about what a hop between two stages costs (``HOP_S_PER_ITEM``), so six
    separate stages spend half their CPU moving rows, and on a few cores each keeps a worker
    that mostly waits. The maps are stateless and run where the source runs: every one may be
    fused (at most ``MAX_FUSED`` after one host, the live rule). The model asks for rows about
    as fast as ``cpus_hint`` cores could make them unfused, so the pipeline limits training.
    """
    rng = random.Random(seed)
    row, batch = 512, 256
    stages = [
        StageModel(
            "read", "source", 4 * US * _jitter(rng), cpu_cv=0.3, bytes_per_item=row,
        ),
    ]  # fmt: skip
    for k in range(6):
        stages.append(
            StageModel(
                f"map{k}",
                "map",
                rng.uniform(1, 3) * US,
                cpu_cv=rng.uniform(0.2, 0.6),
                bytes_per_item=row,
            )  # fmt: skip
        )
    stages.append(
        StageModel(
            "batch",
            "batch",
            1 * US * _jitter(rng),
            cpu_cv=0.3,
            ratio=batch,
            bytes_per_item=batch * row,
        )  # fmt: skip
    )
    wl = Workload(f"fusion_like_s{seed}", tuple(stages), hop_s_per_item=HOP_S_PER_ITEM)
    per_row = cpu_s_per_output(wl) / batch + HOP_S_PER_ITEM * (len(stages) - 1)
    return dataclasses.replace(wl, consumer_step_s=batch * per_row / (2 * cpus_hint))


def generate(n_stages: int, seed: int = 0, batch_size: int | None = None) -> Workload:
    """A random DLRM-like pipeline of ``n_stages`` stages (2..8).

    Always a source (I/O-bound half the time) and a batch stage; a prefetch stage from 4
    stages, a shuffle from 5; the rest are map UDFs with lognormal costs, heavy tails (cv up to
    2), an occasional remote lookup (I/O) and occasional cost drift.

    Raises:
        ValueError: when ``n_stages`` is outside 2..8 or ``batch_size`` < 1.
    """
    if not 2 <= n_stages <= 8:
        raise ValueError(f"generate(): n_stages must be in 2..8, got {n_stages}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"generate(): batch_size must be >= 1, got {batch_size}")
    rng = random.Random(seed)
    row = int(rng.choice((256, 512, 1024, 2048, 4096)) * rng.uniform(0.8, 1.2))
    batch = batch_size or rng.choice((256, 512, 1024, 2048, 4096))
    has_prefetch, has_shuffle = n_stages >= 4, n_stages >= 5
    n_maps = n_stages - 2 - has_prefetch - has_shuffle
    if rng.random() < 0.5:  # remote storage: mostly waiting
        src = StageModel(
            "source", "source", rng.uniform(1, 5) * US, cpu_cv=rng.uniform(0.3, 1.0),
            io_s_per_item=rng.uniform(10, 60) * US, bytes_per_item=row,
        )  # fmt: skip
    else:
        src = StageModel(
            "source", "source", rng.uniform(5, 40) * US, cpu_cv=rng.uniform(0.2, 0.8),
            io_s_per_item=rng.uniform(0, 5) * US, bytes_per_item=row,
        )  # fmt: skip
    stages = [src]
    if has_shuffle:
        stages.append(
            StageModel(
                "shuffle",
                "shuffle",
                rng.uniform(0.5, 3) * US,
                cpu_cv=0.2,
                bytes_per_item=row,
                max_workers=4,
                resident_bytes=rng.choice((1, 2, 5)) * 10**5 * row,
            )  # fmt: skip
        )
    for k in range(n_maps):
        drift = None
        if rng.random() < 0.3:
            drift = Drift(rng.uniform(120, 1200), rng.uniform(0.1, 0.5), rng.uniform(0, 6.28))
        stages.append(
            StageModel(
                f"udf{k}",
                "map",
                math.exp(rng.gauss(math.log(10), 0.8)) * US,
                cpu_cv=rng.uniform(0.2, 2.0),
                io_s_per_item=rng.uniform(10, 80) * US if rng.random() < 0.25 else 0.0,
                bytes_per_item=row,
                drift=drift,
            )  # fmt: skip
        )
    stages.append(
        StageModel(
            "batch",
            "batch",
            rng.uniform(1, 8) * US,
            cpu_cv=0.3,
            ratio=batch,
            bytes_per_item=batch * row,
        )  # fmt: skip
    )
    if has_prefetch:
        stages.append(
            StageModel(
                "prefetch",
                "prefetch",
                batch * row / 10e9,
                cpu_cv=0.2,
                bytes_per_item=batch * row,
                max_workers=4,
            )  # fmt: skip
        )
    wl = Workload(f"generated{n_stages}_s{seed}", tuple(stages))
    # The model is 1.5-4x faster than the pipeline could be on 64 CPUs, or not modelled at all.
    step = 0.0 if rng.random() < 0.3 else cpu_s_per_output(wl) / (64 * rng.uniform(1.5, 4))
    return dataclasses.replace(wl, consumer_step_s=step)


def with_batch_size(workload: Workload, batch_size: int) -> Workload:
    """The same workload with another batch size.

    Batch-sized outputs (the batch stage and any stage after it) grow with the batch, the
    per-batch costs after batching scale with it, and so does the model's step time.

    Raises:
        ValueError: when the workload has no ``"batch"`` stage or ``batch_size`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"with_batch_size(): batch_size must be >= 1, got {batch_size}")
    idx = [i for i, s in enumerate(workload.stages) if s.kind == "batch"]
    if not idx:
        raise ValueError(f"with_batch_size(): workload {workload.name!r} has no batch stage")
    b = idx[0]
    scale = batch_size / workload.stages[b].ratio
    stages = list(workload.stages)
    stages[b] = dataclasses.replace(
        stages[b], ratio=batch_size, bytes_per_item=int(stages[b].bytes_per_item * scale)
    )
    for i in range(b + 1, len(stages)):
        s = stages[i]
        stages[i] = dataclasses.replace(
            s, cpu_s_per_item=s.cpu_s_per_item * scale, bytes_per_item=int(s.bytes_per_item * scale)
        )
    return dataclasses.replace(
        workload,
        name=f"{workload.name}_b{batch_size}",
        stages=tuple(stages),
        consumer_step_s=workload.consumer_step_s * scale,
    )


def with_frames(workload: Workload, items_per_call: int) -> Workload:
    """The same workload with every map stage's remote calls carrying ``items_per_call``
    items (a frame; ``StageModel.items_per_call``): what a remote stage sends per call when its
    source frames that many items, or when it runs after a batch.

    Raises:
        ValueError: when ``items_per_call`` is not an int >= 1.
    """
    if not isinstance(items_per_call, int) or items_per_call < 1:
        raise ValueError(
            f"with_frames(): items_per_call must be an int >= 1, got {items_per_call!r}"
        )
    stages = tuple(
        dataclasses.replace(s, items_per_call=items_per_call) if s.kind == "map" else s
        for s in workload.stages
    )
    name = f"{workload.name}_f{items_per_call}"
    return dataclasses.replace(workload, name=name, stages=stages)


def images_like(seed: int = 0) -> Workload:
    """Read -> decode -> augment -> batch -> prefetch: images, whose items grow on the way.

    JPEG files of ~40 KB are read from remote storage, decoded (3 ms of CPU) into ~150 KB
    arrays, augmented (0.6 ms of CPU per image: a crop and a flip, memory-bound), collated into
    batches of 64 and pinned. With a cluster, decoding is worth moving (3 ms freed for 190 KB
    on the wire); augmenting much less (0.6 ms for 300 KB), and the link runs out first.
    """
    rng = random.Random(seed)
    jpeg, image, batch = 40_000, 150_000, 64
    stages = (
        StageModel(
            "read", "source", 30 * US * _jitter(rng), cpu_cv=0.5,
            io_s_per_item=2e-3 * _jitter(rng), bytes_per_item=jpeg, max_workers=256,
        ),
        StageModel(
            "decode", "map", 3e-3 * _jitter(rng), cpu_cv=0.4, bytes_per_item=image,
            items_per_call=16,
        ),
        StageModel(
            "augment", "map", 0.6e-3 * _jitter(rng), cpu_cv=0.3, bytes_per_item=image,
            items_per_call=16,
        ),
        StageModel(
            "batch", "batch", 20 * US * _jitter(rng), ratio=batch, bytes_per_item=batch * image,
        ),
        StageModel(
            "prefetch", "prefetch", 2e-3 * _jitter(rng), bytes_per_item=batch * image,
            max_workers=4,
        ),
    )  # fmt: skip
    return Workload("images_like", stages, consumer_step_s=20e-3)


def images_threads_like(seed: int = 0) -> Workload:
    """:func:`images_like` (the same costs) with decode and augment threadable: a decode in C
    and a memory-bound augment release the interpreter lock for most of their time
    (``gil_share`` 0.15 and 0.3), so their workers run as fast as threads as they do as
    processes and hold no process of their own. The consumer holds the lock 0.3 ms per batch
    (taking it from the executor, the training loop's Python).
    """
    wl = images_like(seed)
    share = {"decode": 0.15, "augment": 0.3}
    stages = tuple(
        dataclasses.replace(s, threadable=True, gil_share=share[s.name]) if s.name in share else s
        for s in wl.stages
    )
    return dataclasses.replace(
        wl, name="images_threads_like", stages=stages, consumer_gil_s_per_item=0.3e-3
    )


def text_like(seed: int = 0) -> Workload:
    """Read lines -> tokenize -> batch: a tokenizer in pure Python, threadable but holding the
    interpreter lock all its time (``gil_share`` 1).

    Lines of ~1 KB are read from local files (cheap, some waiting), tokenized (120 us of CPU
    each, a 64 MiB vocabulary in every worker) into ~2 KB of token ids, padded and collated
    into batches of 32 (numpy: ``gil_share`` 0.3). As threads the tokenizer's workers share one
    lock with each other and the consumer (0.3 ms of it per batch, of a 0.5 ms step): past one
    worker they add nothing, as processes each adds a core's worth up to ~8 cores.
    """
    rng = random.Random(seed)
    line, ids, batch = 1024, 2048, 32
    stages = (
        StageModel(
            "read", "source", 3 * US * _jitter(rng), cpu_cv=0.3,
            io_s_per_item=2 * US * _jitter(rng), bytes_per_item=line,
        ),
        StageModel(
            "tokenize", "map", 120 * US * _jitter(rng), cpu_cv=0.6, bytes_per_item=ids,
            worker_bytes=64 * MiB, gil_share=1.0, threadable=True,
        ),
        StageModel(
            "batch", "batch", 3 * US * _jitter(rng), cpu_cv=0.2, ratio=batch,
            bytes_per_item=batch * ids, gil_share=0.3,
        ),
    )  # fmt: skip
    return Workload("text_like", stages, consumer_step_s=0.5e-3, consumer_gil_s_per_item=0.3e-3)


def cpu_s_per_output(workload: Workload) -> float:
    """CPU seconds all stages spend per item leaving the pipeline (no drift, no copies)."""
    total, per_out = 0.0, 1.0
    for s in reversed(workload.stages):
        per_out *= s.ratio  # this stage's input items per pipeline item
        total += s.cpu_s_per_item * per_out
    return total


PRESETS: dict[str, Callable[[int], Workload]] = {
    "netflix_like": netflix_like,
    "criteo_like": criteo_like,
}

# Workloads whose stages may run thread workers (StageModel.threadable): not among PRESETS,
# whose studies keep their numbers.
THREAD_PRESETS: dict[str, Callable[[int], Workload]] = {
    "images_threads_like": images_threads_like,
    "text_like": text_like,
}

# Memory a preset is comfortable with on a 32-128 CPU trainer (its workers at 150 MiB each,
# resident shuffle buffers, and a few hundred MiB of buffers).
DEFAULT_MEMORY_BYTES = 48 * 1024 * MiB
