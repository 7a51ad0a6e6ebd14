"""The yardstick: the best static allocation, by exhaustive or coordinate search.

:func:`oracle_search` is the one search, with any ``evaluate(allocation) -> throughput``
function: the simulator's steady-state ``evaluate`` (:func:`best_static`, the held-out
evaluation and pre-training's reference) or a live measurement (``benchmarks/tuners_real.py``).
It searches exhaustively when the number of allocations is small, otherwise by coordinate
search (move ``k`` workers between two stages, or add/remove ``k``, with ``k`` halving down to
1). :class:`OracleTuner` does the same on a live pipeline through the tuning loop, trying a
list of candidate static allocations for a few intervals each and settling on the best.
None is meant for production: all cost many evaluations.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator, Sequence

from torchtune_pipe.tuning.base import Allocation, MiB, Observation
from torchtune_pipe.tuning.baselines import even_split
from torchtune_pipe.tuning.safety import MAX_OVERSUBSCRIBE
from torchtune_pipe.tuning.split_search import split_search

log = logging.getLogger(__name__)


def _bounds(n: int, max_workers: int | Sequence[int]) -> tuple[int, ...]:
    hi = (max_workers,) * n if isinstance(max_workers, int) else tuple(max_workers)
    if len(hi) != n or min(hi) < 1:
        raise ValueError(f"max_workers must be {n} positive ints (or one), got {max_workers}")
    return tuple(int(h) for h in hi)


def count_allocations(hi: Sequence[int], total: int) -> int:
    """Number of worker tuples with ``1 <= w_i <= hi[i]`` and ``sum(w) <= total``."""
    ways = [1] + [0] * total  # ways[s]: tuples so far summing to s
    for h in hi:
        new = [0] * (total + 1)
        for s, c in enumerate(ways):
            if c:
                for w in range(1, min(h, total - s) + 1):
                    new[s + w] += c
        ways = new
    return sum(ways)


def iter_allocations(hi: Sequence[int], total: int) -> Iterator[tuple[int, ...]]:
    """Every worker tuple with ``1 <= w_i <= hi[i]`` and ``sum(w) <= total``."""
    n = len(hi)

    def rec(i: int, left: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if i == n:
            yield prefix
            return
        reserve = n - i - 1  # one worker for each later stage
        for w in range(1, min(hi[i], left - reserve) + 1):
            yield from rec(i + 1, left - w, prefix + (w,))

    yield from rec(0, total, ())


def oracle_search(
    evaluate: Callable[[Allocation], float],
    n_stages: int,
    cpus: int,
    max_workers: int | Sequence[int],
    buffer_bytes: int = 64 * MiB,
    buffer_choices: Sequence[int] | None = None,
    exhaustive_limit: int = 20_000,
    fused: Sequence[bool] = (),
) -> tuple[Allocation, float]:
    """Find the static allocation with the highest ``evaluate`` value.

    Args:
        evaluate: throughput of a static allocation (e.g. ``SimPipeline.evaluate``).
        n_stages: stages in the pipeline.
        cpus: total workers allowed (``sum(workers) <= cpus``).
        max_workers: per-stage upper bound (one int for all stages).
        buffer_bytes: buffer bytes per stage when ``buffer_choices`` is None.
        buffer_choices: per-stage buffer sizes to try (the same for every stage).
        exhaustive_limit: search exhaustively when at most this many worker tuples exist.
        fused: run these stages fused (``Allocation.fused``): only the other stages' workers
            are searched and counted (a fused stage's entry stays 1, its target when split).

    Returns:
        (best allocation, its value).

    Example:
        >>> alloc, value = oracle_search(sim.evaluate, 4, cpus=16, max_workers=16)
    """
    if any(fused):
        return _fused_search(
            evaluate, n_stages, cpus, max_workers, buffer_bytes, buffer_choices,
            exhaustive_limit, tuple(bool(f) for f in fused),
        )  # fmt: skip
    if n_stages < 1 or cpus < n_stages:
        raise ValueError(f"oracle_search(): need cpus >= n_stages >= 1, got {cpus=}, {n_stages=}")
    hi = _bounds(n_stages, max_workers)
    cache: dict[Allocation, float] = {}

    def value(alloc: Allocation) -> float:
        if alloc not in cache:
            cache[alloc] = float(evaluate(alloc))
        return cache[alloc]

    best: tuple[Allocation, float] | None = None
    exhaustive = count_allocations(hi, cpus) <= exhaustive_limit
    for b in buffer_choices or (buffer_bytes,):
        buffers = (int(b),) * n_stages
        if exhaustive:
            found = max((Allocation(w, buffers) for w in iter_allocations(hi, cpus)), key=value)
        else:
            found = _coordinate_search(value, hi, cpus, buffers)
        if best is None or value(found) > best[1]:
            best = (found, value(found))
    log.debug("oracle_search: %d evaluations, best %s", len(cache), best)
    return best


def _fused_search(
    evaluate, n_stages, cpus, max_workers, buffer_bytes, buffer_choices, exhaustive_limit, fused
) -> tuple[Allocation, float]:
    """:func:`oracle_search` over the stages that run their own workers under ``fused``."""
    if len(fused) != n_stages:
        raise ValueError(f"oracle_search(): fused has {len(fused)} stages, not {n_stages}")
    own = [i for i in range(n_stages) if not fused[i]]
    hi = _bounds(n_stages, max_workers)

    def full(a: Allocation) -> Allocation:
        workers = [1] * n_stages
        for k, i in enumerate(own):
            workers[i] = a.workers[k]
        return Allocation(tuple(workers), (a.buffer_bytes[0],) * n_stages, fused=fused)

    found, value = oracle_search(
        lambda a: evaluate(full(a)), len(own), cpus, [hi[i] for i in own], buffer_bytes,
        buffer_choices, exhaustive_limit,
    )  # fmt: skip
    return full(found), value


def fusion_shapes(fusable: Sequence[bool]) -> list[tuple[bool, ...]]:
    """The fusion shapes a search tries: every stage split, and every stage in ``fusable``
    (a shape that may run, e.g. ``SimPipeline.widest_fusion``) fused, then each of those
    split alone (a stage that pays more split than fused)."""
    n = len(fusable)
    shapes = [(False,) * n]
    if any(fusable):
        widest = tuple(bool(f) for f in fusable)
        shapes.append(widest)
        for j in range(n):
            if widest[j]:
                shapes.append(tuple(f and i != j for i, f in enumerate(widest)))
    return shapes


def best_static(
    evaluate: Callable[[Allocation], float],
    n_stages: int,
    cpus: float,
    max_workers: int | Sequence[int],
    factors: Sequence[float] = (1, 2, MAX_OVERSUBSCRIBE),
    fusion: Sequence[Sequence[bool]] = ((),),
    cluster_cpus: float = 0.0,
    remotable: Sequence[bool] = (),
    split_starts: Sequence[Allocation] = (),
    threadable: Sequence[bool] = (),
) -> tuple[Allocation, float]:
    """The best static allocation on ``cpus`` CPUs among worker totals up to each of
    ``cpus * factors``.

    The hard limits let tuners run more workers than cores (up to ``MAX_OVERSUBSCRIBE`` per
    core when stages wait on I/O or on their neighbours), so the yardstick searches those
    totals too: one tuners could beat would measure nothing. One search per total: a search
    started far past the memory limit sees only zeros around it and cannot climb. With
    ``fusion`` (shapes, e.g. :func:`fusion_shapes`), one search per shape and total, counting
    only the workers that run. With ``cluster_cpus`` (at least 1) and ``remotable`` stages,
    also the best split of workers between host and cluster
    (:func:`~.split_search.split_search`, every stage split, local totals as above, from
    its own starts and ``split_starts``). With ``threadable`` stages (``StageStats.threadable``),
    each of them on threads or on processes (all its local workers one kind,
    ``Allocation.threads``): one search per assignment, ``2**k`` for ``k`` threadable stages;
    on a tie the assignment with more thread workers (they hold less memory).

    Returns:
        (best allocation, its value).

    Raises:
        ValueError: on a negative ``cluster_cpus``, or ``remotable`` or ``threadable`` without
            one entry per stage.
    """
    if threadable:
        if len(threadable) != n_stages:
            raise ValueError(
                f"best_static(): threadable needs {n_stages} entries, got {len(threadable)}"
            )
        if any(threadable):
            return _kind_search(
                lambda ev: best_static(
                    ev, n_stages, cpus, max_workers, factors, fusion, cluster_cpus, remotable,
                    split_starts,
                ),
                evaluate,
                threadable,
            )  # fmt: skip
    if cluster_cpus < 0:
        raise ValueError(f"best_static(): cluster_cpus must be >= 0, got {cluster_cpus}")
    if remotable and len(remotable) != n_stages:
        raise ValueError(f"best_static(): remotable needs {n_stages} entries, got {len(remotable)}")
    found = [
        oracle_search(
            evaluate,
            n_stages,
            max(n_stages - sum(map(bool, shape)), int(cpus * f)),
            max_workers,
            fused=shape,
        )
        for shape in fusion
        for f in factors
    ]
    if cluster_cpus >= 1 and any(remotable):
        hi = _bounds(n_stages, max_workers)
        must = n_stages - sum(map(bool, remotable))
        found += [
            split_search(
                evaluate,
                n_stages,
                max(must, int(cpus * f)),
                int(cluster_cpus),
                hi,
                remotable,
                extra_starts=split_starts,
            )  # fmt: skip
            for f in factors
        ]
    return max(found, key=lambda item: item[1])


def _kind_search(
    search: Callable[[Callable[[Allocation], float]], tuple[Allocation, float]],
    evaluate: Callable[[Allocation], float],
    threadable: Sequence[bool],
) -> tuple[Allocation, float]:
    """``search`` once per assignment of threads or processes to the ``threadable`` stages,
    threads first (so that on a tie they stay); the best, with its ``threads``."""
    stages = [i for i, t in enumerate(threadable) if t]
    found = []
    for kinds in itertools.product((True, False), repeat=len(stages)):
        on = dict(zip(stages, kinds, strict=True))

        def with_kind(a: Allocation, on: dict[int, bool] = on) -> Allocation:
            # A thread count past a stage's local workers reads as all of them.
            return a.replace(threads=tuple(w if on.get(i) else 0 for i, w in enumerate(a.workers)))

        best, value = search(lambda a, k=with_kind: evaluate(k(a)))
        found.append((with_kind(best), value))
    return max(found, key=lambda item: item[1])


def _coordinate_search(
    value: Callable[[Allocation], float], hi: Sequence[int], cpus: int, buffers: tuple[int, ...]
) -> Allocation:
    n = len(hi)
    workers = [min(h, w) for h, w in zip(hi, even_split(cpus, n), strict=True)]
    current = Allocation(tuple(workers), buffers)
    k = max(1, cpus // (2 * n))
    while True:
        improved = True
        while improved:
            improved = False
            best, best_v = current, value(current)
            for cand in _neighbours(current.workers, hi, cpus, k):
                v = value(Allocation(cand, buffers))
                if v > best_v:
                    best, best_v, improved = Allocation(cand, buffers), v, True
            current = best
        if k == 1:
            return current
        k = max(1, k // 2)


def _neighbours(
    w: Sequence[int], hi: Sequence[int], cpus: int, k: int
) -> Iterator[tuple[int, ...]]:
    n = len(w)
    for i in range(n):
        for delta in (k, -k):
            c = list(w)
            c[i] += delta
            if 1 <= c[i] <= hi[i] and sum(c) <= cpus:
                yield tuple(c)
        for j in range(n):
            if i != j and w[j] - k >= 1 and w[i] + k <= hi[i]:
                c = list(w)
                c[i] += k
                c[j] -= k
                yield tuple(c)


def candidate_workers(
    n: int, cpus: int, max_workers: int | Sequence[int], max_candidates: int = 48
) -> list[tuple[int, ...]]:
    """Worker tuples that use all ``cpus``: every one if few enough, else a coarser grid.

    The grid moves workers in blocks of ``k`` (the smallest ``k`` that keeps the count within
    ``max_candidates``); leftover workers go to the first stage.
    """
    hi = _bounds(n, max_workers)
    cpus = max(n, int(cpus))
    k = 1
    # Coarser blocks while there are too many, as long as every stage still gets one block.
    while math.comb(cpus // k - 1, n - 1) > max_candidates and cpus // (k + 1) >= n:
        k += 1
    units = cpus // k
    out: list[tuple[int, ...]] = []
    for u in iter_allocations((units,) * n, units):
        if sum(u) != units:
            continue
        w = [x * k for x in u]
        w[0] += cpus - units * k
        w = tuple(min(h, x) for h, x in zip(hi, w, strict=True))
        if w not in out:
            out.append(w)
    return out


class OracleTuner:
    """Try candidate static allocations on a live pipeline, then keep the best one.

    Each candidate runs for ``trial_steps`` intervals; the first ``warmup_steps`` of them are
    not scored (they mix in the previous allocation). The score is the mean ``obs.throughput``;
    an interval that hit the memory limit scores the candidate as unusable.

    Args:
        candidates: worker tuples to try; default :func:`candidate_workers` at reset.
        trial_steps: intervals per candidate.
        warmup_steps: leading intervals of each trial not scored.
        buffer_bytes: buffer bytes per stage for every candidate.
        max_candidates: size of the default candidate list.
    """

    name = "oracle"

    def __init__(
        self,
        candidates: Sequence[Sequence[int]] | None = None,
        trial_steps: int = 3,
        warmup_steps: int = 1,
        buffer_bytes: int = 64 * MiB,
        max_candidates: int = 48,
    ) -> None:
        if trial_steps <= warmup_steps or warmup_steps < 0:
            raise ValueError(
                f"OracleTuner: need trial_steps > warmup_steps >= 0, got {trial_steps=}, "
                f"{warmup_steps=}"
            )
        self._given = [tuple(int(x) for x in c) for c in candidates] if candidates else None
        self.trial_steps = trial_steps
        self.warmup_steps = warmup_steps
        self.buffer_bytes = int(buffer_bytes)
        self.max_candidates = max_candidates
        self.scores: list[float] = []
        self.best: Allocation | None = None

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        """Build the candidate list and start the first trial (after ``start``, when given:
        the first interval of a trial is warm-up, not scored)."""
        n = len(obs.stages)
        hi = [s.max_workers for s in obs.stages]
        workers = self._given or candidate_workers(n, int(obs.cpus), hi, self.max_candidates)
        if any(len(w) != n for w in workers):
            raise ValueError(f"OracleTuner: every candidate needs {n} entries, got {workers}")
        self.candidates = [Allocation(w, (self.buffer_bytes,) * n) for w in workers]
        self.scores, self.best = [], None
        self._trial, self._samples = 0, []
        return start if start is not None else self.candidates[0]

    @property
    def searching(self) -> bool:
        """True while candidates are still being tried."""
        return self.best is None

    def step(self, obs: Observation) -> Allocation:
        """Score the running candidate; move to the next one or settle on the best."""
        if self.best is not None:
            return self.best
        self._trial += 1
        if self._trial > self.warmup_steps:
            self._samples.append(-math.inf if obs.oom else obs.throughput)
        if self._trial < self.trial_steps:
            return self.candidates[len(self.scores)]
        self.scores.append(sum(self._samples) / len(self._samples))
        self._trial, self._samples = 0, []
        if len(self.scores) < len(self.candidates):
            return self.candidates[len(self.scores)]
        i = max(range(len(self.scores)), key=self.scores.__getitem__)
        self.best = self.candidates[i]
        log.info("oracle: settled on %s (%.1f items/s)", self.best.workers, self.scores[i])
        return self.best
