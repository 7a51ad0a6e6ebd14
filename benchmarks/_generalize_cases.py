"""The cases of the generalization battery (``benchmarks/generalize.py``): simulated workloads on
machines that rescale, drawn with seeds nothing was trained or tuned on.

Seven families. ``generated``: the simulator's own generator
(:func:`~torchtune_pipe.sim.workloads.generate`, 2-8 stages, half of them with another batch
size), as pre-training draws it. Six that it rarely draws, built by hand:

* ``io_lookups``: a reader, two lookup maps that wait 180-250 us per item on a store with
  ~6 us of CPU, a CPU feature map, batch and prefetch;
* ``memory_tight``: generated pipelines with huge batches and a per-worker cache, under half
  to four fifths of the memory an even split needs;
* ``many_cheap``: a reader, six maps of 1-3 us each (about a hop), batch
  (:func:`~torchtune_pipe.sim.workloads.fusion_like`);
* ``dominant_udf``: eight stages, one UDF of 150-600 us with heavy tails among cheap ones;
* ``model_bound``: generated pipelines whose model takes half to nine tenths of what the
  pipeline could deliver on the largest CPU count of the schedule;
* ``fused_remote``: DLRM-like stages of which some may not fuse, a cluster for the maps'
  remote workers, and hops that make fusion matter.

Every case's seed is at least :data:`BATTERY_SEED`: pre-training draws its workloads below
``2 * pretrain.HELDOUT_SEED`` (training below it, the held-out evaluation and the studies
above it), so no seed of the battery ever shaped a weight file or a rule
(``tests/benchmarks/test_generalize_quick.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from torchtune_pipe.sim.model import Drift, StageModel, Workload
from torchtune_pipe.sim.workloads import (
    HOP_S_PER_ITEM,
    cpu_s_per_output,
    criteo_like,
    fusion_like,
    generate,
    with_batch_size,
    with_frames,
)
from torchtune_pipe.tuning.base import MiB
from torchtune_pipe.tuning.intune.pretrain import CPU_CHOICES, _memory_for

US = 1e-6
# Above every seed pre-training, the held-out evaluation and the studies draw (all < 20_000).
BATTERY_SEED = 30_000
# CPU schedules of the hand-built families (one level per segment): rescaling up, down, both.
SCHEDULES: tuple[tuple[int, ...], ...] = (
    (24, 96, 48),
    (8, 32),
    (128, 64),
    (16, 64, 128),
    (96, 24),
    (32,),
    (64, 16, 48),
    (12, 128),
)
# The trainer host's cores in ``fused_remote``, fed by a cluster of 16-64 CPUs.
HOST_SCHEDULES: tuple[tuple[int, ...], ...] = ((8, 32, 16), (16, 8), (32,), (8, 16, 32), (24, 8))


@dataclass(frozen=True)
class Case:
    """One battery run: a workload on a machine whose CPU count follows ``levels`` (one level
    per segment of the episode), under ``memory_bytes``, with ``cluster_cpus`` for remote
    workers (0: none)."""

    family: str
    name: str
    workload: Workload
    levels: tuple[int, ...]
    memory_bytes: int
    seed: int
    cluster_cpus: float = 0.0

    def schedule(self, segment_steps: int) -> list[tuple[float, float]]:
        """The CPU schedule for segments of ``segment_steps`` one-second intervals."""
        return [(float(k * segment_steps), float(c)) for k, c in enumerate(self.levels)]


def _jitter(rng: random.Random) -> float:
    return rng.uniform(0.9, 1.1)


def _collate(rng: random.Random, row: int, batch: int) -> list[StageModel]:
    """Batch (a collate of ~2 us per row) -> prefetch (a copy at 10 GB/s)."""
    return [
        StageModel(
            "batch", "batch", 2 * US * _jitter(rng), cpu_cv=0.3, ratio=batch,
            bytes_per_item=batch * row,
        ),
        StageModel(
            "prefetch", "prefetch", batch * row / 10e9, cpu_cv=0.2,
            bytes_per_item=batch * row, max_workers=4,
        ),
    ]  # fmt: skip


def _memory(wl: Workload, levels: tuple[int, ...], factor: float) -> int:
    return int(_memory_for(wl, max(levels)) * factor)


def _generated(k: int, seed: int, rng: random.Random) -> Case:
    """As pre-training samples an episode (:func:`~torchtune_pipe.tuning.intune.pretrain.sample_episode`):
    2-8 stages, another batch size half the time, 1-3 CPU levels, roomy or tight memory."""
    wl = generate(2 + k % 7, seed)
    if rng.random() < 0.5:
        wl = with_batch_size(wl, rng.choice((256, 512, 1024, 2048, 4096, 8192)))
    levels = [rng.choice(CPU_CHOICES)]
    for _ in range(rng.choice((0, 1, 1, 2))):
        levels.append(rng.choice([c for c in CPU_CHOICES if c != levels[-1]]))
    lv = tuple(levels)
    return Case("generated", wl.name, wl, lv, _memory(wl, lv, rng.choice((1.0, 1.5, 3.0))), seed)


def io_lookups(seed: int) -> Workload:
    """Reader -> two store lookups (~6 us of CPU, 180-250 us of waiting per item) -> CPU
    features -> batch -> prefetch."""
    rng = random.Random(seed)
    row = rng.choice((256, 512, 1024, 2048, 4096))
    batch = rng.choice((256, 512, 1024, 2048, 4096))
    stages = [
        StageModel(
            "read", "source", rng.uniform(4, 10) * US, cpu_cv=0.5,
            io_s_per_item=rng.uniform(0, 40) * US, bytes_per_item=row,
        ),
    ]  # fmt: skip
    for name in ("lookup_a", "lookup_b"):
        stages.append(
            StageModel(
                name,
                "map",
                6 * US * _jitter(rng),
                cpu_cv=0.5,
                io_s_per_item=rng.uniform(180, 250) * US,
                bytes_per_item=row,
            )  # fmt: skip
        )
    stages.append(
        StageModel("features", "map", rng.uniform(10, 60) * US, cpu_cv=0.8, bytes_per_item=row)
    )
    return Workload(f"io_lookups_s{seed}", tuple(stages + _collate(rng, row, batch)))


def memory_tight(seed: int) -> Workload:
    """A generated pipeline of 5-8 stages with batches of 8-16k rows, one map whose workers
    each hold a 100-400 MiB cache."""
    rng = random.Random(seed)
    wl = with_batch_size(generate(rng.randint(5, 8), seed), rng.choice((8192, 16384)))
    maps = [i for i, s in enumerate(wl.stages) if s.kind == "map"]
    stages = list(wl.stages)
    j = rng.choice(maps)
    stages[j] = dataclasses.replace(stages[j], worker_bytes=int(rng.uniform(100, 400) * MiB))
    return dataclasses.replace(wl, name=f"memory_tight_s{seed}", stages=tuple(stages))


def dominant_udf(seed: int) -> Workload:
    """Source -> shuffle -> four maps, one of 150-600 us with heavy tails (and drift half the
    time), the others 2-10 us -> batch -> prefetch."""
    rng = random.Random(seed)
    row, batch = rng.choice((512, 1024, 2048)), rng.choice((512, 1024, 4096))
    io = rng.random() < 0.5
    stages = [
        StageModel(
            "source", "source", rng.uniform(2, 20) * US, cpu_cv=0.5,
            io_s_per_item=rng.uniform(10, 60) * US if io else 0.0, bytes_per_item=row,
        ),
        StageModel(
            "shuffle", "shuffle", 1 * US * _jitter(rng), cpu_cv=0.2, bytes_per_item=row,
            max_workers=4, resident_bytes=200_000 * row,
        ),
    ]  # fmt: skip
    heavy = rng.randrange(4)
    for k in range(4):
        drift = None
        if k == heavy:
            cost, cv = rng.uniform(150, 600) * US, rng.uniform(1.0, 2.0)
            if rng.random() < 0.5:
                drift = Drift(rng.uniform(120, 900), rng.uniform(0.1, 0.4), rng.uniform(0, 6.28))
        else:
            cost, cv = rng.uniform(2, 10) * US, rng.uniform(0.2, 0.8)
        stages.append(
            StageModel(f"udf{k}", "map", cost, cpu_cv=cv, bytes_per_item=row, drift=drift)
        )
    return Workload(f"dominant_udf_s{seed}", tuple(stages + _collate(rng, row, batch)))


def model_bound(seed: int, peak_cpus: int) -> Workload:
    """A generated pipeline of 3-8 stages whose model takes items at 0.5-0.9 of the rate its
    stages' CPU allows on ``peak_cpus`` CPUs: bound by the model at the top of the schedule."""
    rng = random.Random(seed)
    wl = generate(rng.randint(3, 8), seed)
    step = cpu_s_per_output(wl) / (peak_cpus * rng.uniform(0.5, 0.9))
    return dataclasses.replace(wl, name=f"model_bound_s{seed}", consumer_step_s=step)


def fused_remote(seed: int) -> Workload:
    """The DLRM-like pipeline (:func:`~torchtune_pipe.sim.workloads.criteo_like`) in frames of
    256 rows with the measured hop per item, one or two of its maps unable to fuse."""
    rng = random.Random(seed)
    wl = with_frames(criteo_like(seed), 256)
    maps = [i for i, s in enumerate(wl.stages) if s.kind == "map"]
    apart = set(rng.sample(maps, rng.choice((1, 2))))
    stages = tuple(
        dataclasses.replace(s, fusable=False) if i in apart else s for i, s in enumerate(wl.stages)
    )
    return dataclasses.replace(
        wl, name=f"fused_remote_s{seed}", stages=stages, hop_s_per_item=HOP_S_PER_ITEM
    )


def _hand_built(family: str, k: int, seed: int, rng: random.Random) -> Case:
    levels = SCHEDULES[k % len(SCHEDULES)]
    cluster = 0.0
    if family == "io_lookups":
        wl = io_lookups(seed)
    elif family == "memory_tight":
        wl = memory_tight(seed)
    elif family == "many_cheap":
        wl = fusion_like(seed, cpus_hint=rng.choice((8, 16, 32, 64)))
    elif family == "dominant_udf":
        wl = dominant_udf(seed)
    elif family == "model_bound":
        wl = model_bound(seed, max(levels))
    else:
        wl = fused_remote(seed)
        levels = HOST_SCHEDULES[k % len(HOST_SCHEDULES)]
        cluster = float(rng.choice((16, 32, 64)))
    factor = rng.uniform(0.5, 0.8) if family == "memory_tight" else 1.5
    return Case(family, wl.name, wl, levels, _memory(wl, levels, factor), seed, cluster)


HAND_BUILT = (
    "io_lookups",
    "memory_tight",
    "many_cheap",
    "dominant_udf",
    "model_bound",
    "fused_remote",
)
FAMILIES = ("generated",) + HAND_BUILT


def battery(generated: int = 300, per_family: int = 12) -> list[Case]:
    """The battery's cases: ``generated`` drawn by the generator and ``per_family`` of each
    hand-built family, every seed from :data:`BATTERY_SEED` up (10_000 seeds per family)."""
    cases = []
    for k in range(generated):
        seed = BATTERY_SEED + k
        cases.append(_generated(k, seed, random.Random(seed)))
    for f, family in enumerate(HAND_BUILT, start=1):
        for k in range(per_family):
            seed = BATTERY_SEED + 10_000 * f + k
            cases.append(_hand_built(family, k, seed, random.Random(seed)))
    return cases


def drifts(case: Case) -> bool:
    """Whether any stage's costs drift (the oracle then moves within a segment)."""
    return any(s.drift is not None for s in case.workload.stages)
