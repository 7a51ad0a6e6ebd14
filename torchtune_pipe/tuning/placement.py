"""Where a planned stage's workers run: the planner's split between host and cluster.

The planner (:mod:`~.planner`) balances stages on the host's cores. With a cluster
(``Observation.cluster_cpus``), a stage that may run remote (``StageStats.remotable``) can
also take workers there. Per delivered item, stage ``i`` costs on the host ``g_i`` of CPU and
``u_i`` of a local worker's time when made locally, and ``h_i`` of host CPU (its hop), ``v_i``
of a remote worker's time (its CPU on the cluster plus the network's wait) and ``b_i`` bytes on
the link when made remotely (:func:`~.cluster.remote_cost`). For a target rate ``T``, a share
``f_i`` of its items goes remote: the workers the planner's rate model (:mod:`~.capacity`)
gives ``T * f_i`` items/s at ``v_i`` (one cluster CPU each) and ``T * (1 - f_i)`` at ``u_i``
locally (:func:`~.capacity.workers_for`).

Three rules decide what a split costs, each from ``benchmarks/cluster_sim.py`` (BENCHMARKS.md,
"Two budgets"):

* The kinds split a stage's items by their capacities (a free worker takes the next item; the
  simulator's blend does the same), not by the planned share: the host's CPU, the charged
  cores and the link are counted at the share the rounded workers serve
  (:func:`served_share`). A stage the cluster can hold wholly moves wholly: one local worker
  kept for a sliver of its items takes a core's worth of them from the host's own stages (the
  planner kept 1 of 8 UDF workers on the host on ``netflix_like``, 0.91-0.92 of the best
  split, and 1 of 12 parse and sparse-hash workers on the DLRM-like pipeline).
* Workers that hold no host core, remote ones and local ones that wait on I/O
  (:func:`~.base.waits_on_io`, :func:`local_headroom`), are planned with ``REMOTE_HEADROOM``
  (1.05), the rest with ``headroom`` (1.2). Remote CPUs are paid, and a waiting worker is
  bounded by the local worker cap (a count) rather than by CPU: with 1.2 on both, the
  DLRM-like pipeline paid 29-32 CPUs where the best split needs 27.5, and its I/O-bound read
  took the slots its cheap map needed to stay local (that map then ran 2+2 and its remote half
  filled the link).
* The charged cores may pass the host's by ``SPARE_CORES``, as the guard lets them
  (:func:`~.safety.oversubscribe_factor`): without it a 16-CPU cluster's split left a
  bottleneck stage a local worker short (0.92-0.96 of the best split).

:func:`place` finds the highest ``T`` (bisection) for which some split fits every budget: the
host's cores (CPU and the charged floors, as the plan charges them), the cluster's CPUs, the
link's bytes per second, the local worker cap and memory. At each ``T`` it moves as little as
needed, in order of what moving frees per unit of the scarcer remote resource,
``(g_i - h_i) / max(v_i / C, b_i / bandwidth)``: a stage stays local when moving it costs the
host more than it frees (``g_i <= (1 + MOVE_MIN_GAIN) * h_i``: cheap work on big items), and
the stages that free the most host CPU per cluster CPU move first. Moving only what the
target needs is what keeps cluster CPUs for when they raise throughput: a pipeline the host
alone can feed stays local.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torchtune_pipe.tuning.base import Observation, waits_on_io
from torchtune_pipe.tuning.capacity import (
    Station,
    remote_headroom,
    served_share,
    station_capacity,
    workers_for,
)
from torchtune_pipe.tuning.cluster import network_of, remote_cost
from torchtune_pipe.tuning.safety import MAX_OVERSUBSCRIBE, REMOTE_MIN_CHARGE, SPARE_CORES

# A stage moves only where its host CPU per item falls by more than this share.
MOVE_MIN_GAIN = 0.1
_BISECT_STEPS = 40
_SHARE_STEPS = 24


def movable(s: Station) -> bool:
    """Whether moving ``s``'s items to the cluster frees host CPU: it may run remote, has work,
    and its host CPU per item is more than ``1 + MOVE_MIN_GAIN`` times its hop's."""
    return s.v > 0 and not s.idle and s.g > (1.0 + MOVE_MIN_GAIN) * s.h


@dataclass(frozen=True)
class Placed:
    """A split: the rate, local and remote workers per station (in station order)."""

    rate: float
    local: tuple[int, ...]
    remote: tuple[int, ...]


def remote_terms(obs: Observation, i: int, r: float) -> tuple[float, float, float]:
    """``(h, v, b)`` of stage ``i`` per delivered item (``r`` of its items per delivered
    item): host CPU, remote worker seconds and link bytes when a remote worker makes it."""
    st = obs.stages[i]
    cost = remote_cost(obs, i)
    cpu = max(0.0, st.cpu_s_per_item)
    return cost.hop_cpu_s * r, (cpu + cost.net_s + cost.hop_cpu_s) * r, cost.net_bytes * r


def local_headroom(g: float, u: float, headroom: float) -> float:
    """The headroom the local workers of a station of ``g`` CPU and ``u`` worker seconds per
    item are planned with: :func:`~.capacity.remote_headroom` where they wait on I/O (they hold
    no core either; the local worker cap, a count, is what bounds them), else ``headroom``."""
    return remote_headroom(headroom) if waits_on_io(g, u) else headroom


def local_wall(obs: Observation, u: Sequence[float], r: Sequence[float]) -> list[float]:
    """Worker seconds per delivered item a local worker of each stage would take: a stage
    with remote workers measured its remote items' network waits and hops in its busy time
    (``u`` is then ``A + f (net + h) r``, with ``A`` the local time and ``f`` the remote share),
    so they come off."""
    out = list(u)
    for i, st in enumerate(obs.stages):
        if st.remote_workers > 0 and st.items_per_s > 0:
            f = min(1.0, st.remote_items_per_s / st.items_per_s)
            cost = remote_cost(obs, i)
            floor = max(1e-12, st.cpu_s_per_item * r[i])
            out[i] = max(floor, u[i] - f * (cost.net_s + cost.hop_cpu_s) * r[i])
    return out


class _Budget:
    """The budgets one split must fit (module docstring)."""

    def __init__(self, obs, stations, per_worker_bytes, memory_left, allowance):
        self.obs, self.st = obs, stations
        self.per_worker_bytes, self.memory_left = per_worker_bytes, memory_left
        self.cluster = math.floor(obs.cluster_cpus + 1e-9)
        self.bandwidth = network_of(obs)[1]
        # The guard lets charges pass the cores by SPARE_CORES once anything was measured
        # (safety.oversubscribe_factor), and a split is planned from a measurement.
        self.cpus = max(obs.cpus + SPARE_CORES, allowance)

    def workers(self, t: float, f: Sequence[float]) -> tuple[list[int], list[int]]:
        local, remote = [], []
        for s, fi in zip(self.st, f, strict=True):
            if s.idle:
                local.append(s.lo)
                remote.append(0)
                continue
            nr = workers_for(t * fi, s.v, remote_headroom(s.headroom)) if fi > 0 else 0
            nl = workers_for(t * (1.0 - fi), s.u, s.headroom) if fi < 1 else 0
            nl = min(s.hi, max(max(0, s.lo - nr), nl))
            local.append(nl)
            remote.append(min(nr, s.hi - nl))
        return local, remote

    def fits(self, t: float, f: Sequence[float]) -> bool:
        local, remote = self.workers(t, f)
        st = self.st
        # Items split between a station's kinds by their capacities, not by the planned
        # shares: a local worker rounded up to one takes its whole capacity's share of items
        # (and of the host's CPU) however small the share it was planned for.
        f = [
            served_share(s, n, m) if n > 0 < m else fi
            for s, fi, n, m in zip(st, f, local, remote, strict=True)
        ]
        host = t * sum((1 - fi) * s.g + fi * s.h for s, fi in zip(st, f, strict=True))
        charged = sum(
            n * max(s.floor, min(1.0, t * (1 - fi) * s.g / n))
            for s, fi, n in zip(st, f, local, strict=True)
            if n > 0
        )
        charged += sum(
            n * max(REMOTE_MIN_CHARGE, t * fi * s.h / n)
            for s, fi, n in zip(st, f, remote, strict=True)
            if n > 0
        )
        wire = t * sum(fi * s.b for s, fi in zip(st, f, strict=True))
        lo_sum = sum(s.lo for s in st)
        return (
            host <= self.obs.cpus
            and charged <= self.cpus + 1e-9
            and sum(local) <= max(lo_sum, MAX_OVERSUBSCRIBE * self.obs.cpus)
            and sum(remote) <= self.cluster
            and wire <= self.bandwidth
            and sum(local) * self.per_worker_bytes <= self.memory_left
            and all(
                s.idle or station_capacity(s, n, m) >= t * (1 - 1e-9)
                for s, n, m in zip(st, local, remote, strict=True)
            )
        )

    def shares(self, t: float) -> list[float] | None:
        """The least remote shares that make rate ``t`` fit, or None."""
        f = [0.0] * len(self.st)
        if self.fits(t, f):
            return f
        order = sorted(
            (k for k, s in enumerate(self.st) if movable(s)),
            key=lambda k: (
                -(self.st[k].g - self.st[k].h)
                / max(self.st[k].v / max(1, self.cluster), self.st[k].b / self.bandwidth, 1e-15)
            ),
        )
        for k in order:
            most = self._most(t, f, k)
            f[k] = most
            if self.fits(t, f):  # the least share of this one that fits
                lo, hi = 0.0, most
                for _ in range(_SHARE_STEPS):
                    mid = (lo + hi) / 2
                    f[k] = mid
                    lo, hi = (lo, mid) if self.fits(t, f) else (mid, hi)
                f[k] = hi
                return f
        return None

    def _most(self, t: float, f: list[float], k: int) -> float:
        """The largest share of station ``k`` the cluster and the link leave room for (1:
        all of it, no local worker left)."""
        f[k] = 1.0
        _, remote = self.workers(t, f)
        if (
            sum(remote) <= self.cluster
            and t * sum(fi * s.b for s, fi in zip(self.st, f, strict=True)) <= self.bandwidth
        ):
            return 1.0
        lo, hi = 0.0, 1.0
        for _ in range(_SHARE_STEPS):
            mid = (lo + hi) / 2
            f[k] = mid
            _, remote = self.workers(t, f)
            wire = t * sum(fi * s.b for s, fi in zip(self.st, f, strict=True))
            ok = sum(remote) <= self.cluster and wire <= self.bandwidth
            lo, hi = (mid, hi) if ok else (lo, mid)
        return lo


def place(
    obs: Observation,
    stations: Sequence[Station],
    top: float,
    *,
    per_worker_bytes: float,
    memory_left: float,
    allowance: float = 0.0,
) -> Placed | None:
    """The highest rate up to ``top`` some split of ``stations`` fits the budgets at, and that
    split's workers (module docstring); None when no rate does or nothing can move."""
    if obs.cluster_cpus < 1 or not any(movable(s) for s in stations):
        return None
    budget = _Budget(obs, stations, per_worker_bytes, memory_left, allowance)
    low, high = 0.0, top
    if budget.shares(high) is not None:
        low = high
    else:
        for _ in range(_BISECT_STEPS):
            mid = (low + high) / 2
            low, high = (mid, high) if budget.shares(mid) is not None else (low, mid)
    f = budget.shares(low) if low > 0 else None
    if f is None:
        return None
    local, remote = budget.workers(low, f)
    return Placed(low, tuple(local), tuple(remote))
