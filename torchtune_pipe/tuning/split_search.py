"""The yardstick with a cluster: the best static split of workers between host and cluster.

:func:`split_search` is :func:`~.oracle.oracle_search`'s coordinate search over two budgets:
per stage its local workers, and per stage that may run remote (``remotable``) its remote
workers; local workers in total within ``cpus``, remote ones within ``cluster_cpus``. A move
adds or removes ``k`` workers of one kind on one stage, moves ``k`` between two stages within
one budget, or moves ``k`` of one stage's workers across (host to cluster or back), with ``k``
halving down to 1 from a quarter of the larger budget per coordinate. It starts from the
local budget split evenly and, for the remote one, from each of: the cluster split evenly over
the stages that may use it, and the cluster given whole to each one of them in turn (a search
that starts spread over a stage with big items must not be stuck there). Like the oracle,
not for production: thousands of evaluations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from torchtune_pipe.tuning.base import Allocation, MiB
from torchtune_pipe.tuning.baselines import even_split


def split_search(
    evaluate: Callable[[Allocation], float],
    n_stages: int,
    cpus: int,
    cluster_cpus: int,
    max_workers: Sequence[int],
    remotable: Sequence[bool],
    buffer_bytes: int = 64 * MiB,
    all_remote: bool = False,
    extra_starts: Sequence[Allocation] = (),
) -> tuple[Allocation, float]:
    """The static split with the highest ``evaluate`` value (module docstring).

    Args:
        evaluate: throughput of a static allocation (``SimPipeline.evaluate``).
        n_stages: stages in the pipeline.
        cpus: local workers allowed in total.
        cluster_cpus: remote workers allowed in total (one cluster CPU each).
        max_workers: per-stage bound on its workers, local plus remote.
        remotable: per stage, whether it may run remote workers.
        buffer_bytes: buffer bytes per stage.
        all_remote: every ``remotable`` stage runs all its workers remote (the
            "everything remote" yardstick); only the other stages keep local workers.
        extra_starts: more allocations to climb from (e.g. workers in proportion to what each
            stage costs, which a simulator knows); one that does not fit is skipped.

    Returns:
        (best allocation, with ``remote`` explicit, and its value).

    Raises:
        ValueError: on budgets or bounds that admit no allocation, or lengths that differ.
    """
    if len(max_workers) != n_stages or len(remotable) != n_stages:
        raise ValueError(
            f"split_search(): max_workers and remotable need {n_stages} entries, got "
            f"{len(max_workers)} and {len(remotable)}"
        )
    if n_stages < 1 or cpus < n_stages - sum(map(bool, remotable)) or cluster_cpus < 0:
        raise ValueError(
            f"split_search(): need cpus >= the stages that must stay local and cluster_cpus "
            f">= 0, got {cpus=}, {cluster_cpus=}, {n_stages=}"
        )
    far = [i for i in range(n_stages) if remotable[i]]
    hi = [int(h) for h in max_workers]
    buffers = (int(buffer_bytes),) * n_stages
    cache: dict[tuple[int, ...], float] = {}

    def alloc(x: tuple[int, ...]) -> Allocation:
        remote = [0] * n_stages
        for j, i in enumerate(far):
            remote[i] = x[n_stages + j]
        workers = tuple(x[i] + remote[i] for i in range(n_stages))
        return Allocation(workers, buffers, remote=tuple(remote))

    def value(x: tuple[int, ...]) -> float:
        if x not in cache:
            cache[x] = float(evaluate(alloc(x)))
        return cache[x]

    def valid(x: Sequence[int]) -> bool:
        if sum(x[:n_stages]) > cpus or sum(x[n_stages:]) > cluster_cpus or min(x) < 0:
            return False
        if all_remote and any(x[i] for i in far):
            return False
        remote = dict(zip(far, x[n_stages:], strict=True))
        return all(1 <= x[i] + remote.get(i, 0) <= hi[i] for i in range(n_stages))

    local = [min(h, w) for h, w in zip(hi, even_split(cpus, n_stages), strict=True)]
    if all_remote:
        stay = [i for i in range(n_stages) if i not in far]
        local = [0] * n_stages
        for i, w in zip(stay, even_split(cpus, len(stay)) if stay else (), strict=True):
            local[i] = min(hi[i], w)
    room = [hi[i] - local[i] for i in far]  # a start's remote workers fit the stage's bound
    starts = []
    if far and cluster_cpus > 0:
        spread = even_split(cluster_cpus, len(far))
        starts.append(tuple(local) + tuple(min(r, n) for r, n in zip(room, spread, strict=True)))
        for j in range(len(far)):
            whole = tuple(min(room[k], cluster_cpus) if k == j else 0 for k in range(len(far)))
            starts.append(tuple(local) + whole)
    else:
        starts.append(tuple(local) + (0,) * len(far))
    for a in extra_starts:
        remote = a.remote or (0,) * n_stages
        x = tuple(w - r for w, r in zip(a.workers, remote, strict=True))
        starts.append(x + tuple(remote[i] for i in far))
    best: tuple[int, ...] | None = None
    for x in starts:
        if not valid(x):
            continue
        found = _climb(x, value, valid, n_stages, far, max(cpus, cluster_cpus))
        if best is None or value(found) > value(best):
            best = found
    if best is None:
        raise ValueError("split_search(): no start fits the bounds; raise max_workers")
    return alloc(best), value(best)


def _climb(x, value, valid, n: int, far: Sequence[int], budget: int) -> tuple[int, ...]:
    k = max(1, budget // (2 * max(1, len(x))))
    while True:
        improved = True
        while improved:
            improved = False
            best_v = value(x)
            for cand in _moves(x, n, far, k):
                if valid(cand) and value(cand) > best_v:
                    x, best_v, improved = cand, value(cand), True
        if k == 1:
            return x
        k = max(1, k // 2)


def _moves(x: tuple[int, ...], n: int, far: Sequence[int], k: int) -> Iterator[tuple[int, ...]]:
    """Neighbours of ``x``: one coordinate by ``k``, ``k`` moved within a budget (local:
    the first ``n`` coordinates; remote: the rest), or ``k`` of a stage moved across."""
    m = len(x)
    for i in range(m):
        for delta in (k, -k):
            c = list(x)
            c[i] += delta
            yield tuple(c)
    for group in (range(n), range(n, m)):
        for i in group:
            for j in group:
                if i != j:
                    c = list(x)
                    c[i] += k
                    c[j] -= k
                    yield tuple(c)
    for j, i in enumerate(far):
        for delta in (k, -k):
            c = list(x)
            c[i] -= delta
            c[n + j] += delta
            yield tuple(c)
