"""Plumber (Kuchnik et al., MLSys'22) as a :class:`~.base.Tuner`: trace once, solve an LP, done.

From one profiling interval under the starting allocation, each stage's rate per core is
``r_i`` = root items per second that one core could drive through stage ``i``
(``1 / (cpu_s_per_item_i x items_i / items_root)``). The LP

    maximise t   s.t.   t <= r_i * theta_i,   sum_i theta_i <= cores,   0 <= theta_i <= cap_i

(the linearised max-min of ``r_i * theta_i``) is solved with scipy's HiGHS; each stage gets
``max(1, ceil(theta_i))`` workers (Plumber: "overallocation is fine"; the safety clamp trims
the total). The last stage's buffer holds ``ceil(max(N* - N, 0))`` elements by Little's law,
``N* = min_latency x t`` in flight and ``N`` the observed concurrency. A stage that waits on
I/O also gets the workers its measured wall-clock rate per worker needs to reach ``t`` (in
place of Plumber's disk-bandwidth model). Plumber rewrites parallelism, caching and prefetch,
never fusion: a pipeline that runs fused stages keeps them, and its LP treats each fused group
as one node (the host's workers run all of it). Like Plumber, the plan is
fixed afterwards; ``PlumberTuner(adaptive=True)`` (``plumber-adaptive``) re-solves, with the
rates of the latest interval, whenever the CPU count changes.

With a cluster (``Observation.cluster_cpus``), the LP also gives each stage that may run remote
(``StageStats.remotable``) ``phi_i`` cluster CPUs (remote workers), each driving ``rho_i`` root
items/s (one over its CPU, network wait and hop per root item, :func:`~.cluster.remote_cost`)
and costing the host ``hop_i`` CPU seconds per item it makes:

    t <= r_i theta_i + rho_i phi_i,   sum theta + sum hop_i rho_i phi_i <= cores,
    sum phi <= cluster CPUs,   sum bytes_i rho_i phi_i <= bandwidth,

with a small cost on each cluster CPU, so that among the plans of the highest ``t`` the LP
takes the one that moves least: a stage stays local when moving it frees no core.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from torchtune_pipe.tuning.base import Allocation, MiB, Observation, fusion_host, is_io_bound
from torchtune_pipe.tuning.cluster import network_of, remote_cost

log = logging.getLogger(__name__)

# theta within this of an integer is that integer (HiGHS returns 2.0000000001 for 2).
_CEIL_TOL = 1e-6
# The LP's cost of one cluster CPU, per item/s of its objective: ties go to the host.
_CLUSTER_COST = 1e-6


@dataclass(frozen=True)
class PlumberPlan:
    """The result of one Plumber solve.

    Attributes:
        rates: root items/s per core for each stage (inf for a stage that costs no CPU).
        theta: cores per stage from the LP.
        throughput: the LP's predicted root items/s.
        workers: ``max(1, ceil(theta_i))`` per stage.
        prefetch_items: root elements the last buffer should hold (Little's law).
        remote: of ``workers``, those on the cluster (empty: no cluster; module docstring).
    """

    rates: tuple[float, ...]
    theta: tuple[float, ...]
    throughput: float
    workers: tuple[int, ...]
    prefetch_items: int
    remote: tuple[int, ...] = ()


def solve_lp(
    rates: Sequence[float], cores: float, caps: Sequence[float] | None = None
) -> tuple[tuple[float, ...], float]:
    """Maximise ``min_i rates[i] * theta[i]`` subject to ``sum(theta) <= cores``.

    Args:
        rates: items/s per core per stage; ``inf`` (no CPU cost) stages get theta 0.
        cores: total cores.
        caps: per-stage upper bound on theta (1 for a sequential stage); default ``cores``.

    Returns:
        (theta per stage, optimal throughput).

    Raises:
        ValueError: on a non-positive rate or core count, or when HiGHS fails.
    """
    from scipy.optimize import linprog  # scipy loads only when Plumber solves

    n = len(rates)
    if cores <= 0:
        raise ValueError(f"solve_lp(): cores must be positive, got {cores}")
    if any(not r > 0 for r in rates):
        raise ValueError(f"solve_lp(): rates must be positive, got {tuple(rates)}")
    caps = tuple(caps) if caps is not None else (cores,) * n
    live = [i for i in range(n) if math.isfinite(rates[i])]
    theta = [0.0] * n
    if not live:
        return tuple(theta), math.inf
    m = len(live)
    # Variables: theta_live..., t. Minimise -t.
    c = np.zeros(m + 1)
    c[-1] = -1.0
    a_ub = np.zeros((m + 1, m + 1))
    b_ub = np.zeros(m + 1)
    for row, i in enumerate(live):  # t - r_i theta_i <= 0
        a_ub[row, row] = -rates[i]
        a_ub[row, -1] = 1.0
    a_ub[m, :m] = 1.0  # sum theta <= cores
    b_ub[m] = cores
    bounds = [(0.0, float(caps[i])) for i in live] + [(0.0, None)]
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if res.status != 0:
        raise ValueError(f"solve_lp(): HiGHS failed: {res.message}")
    for row, i in enumerate(live):
        theta[i] = float(res.x[row])
    return tuple(theta), float(res.x[-1])


def workers_from_theta(theta: Sequence[float]) -> tuple[int, ...]:
    """``max(1, ceil(theta_i))`` with a tolerance for solver round-off."""
    return tuple(max(1, math.ceil(t - _CEIL_TOL)) for t in theta)


def stage_rates(obs: Observation) -> tuple[float, ...] | None:
    """Root items/s per core for each stage, from one interval (None if unmeasured).

    A fused group is one node, as tf.data's fused map is one op: its host's rate covers the
    CPU of every stage in it, and a fused stage costs nothing of its own (rate inf, theta 0).
    """
    root = obs.stages[-1].items_per_s
    if root <= 0 or any(s.items_per_s <= 0 for s in obs.stages):
        return None
    fused = [s.fused for s in obs.stages]
    per_root = [0.0] * len(obs.stages)
    for i, s in enumerate(obs.stages):
        workers = obs.stages[fusion_host(fused, i)].workers
        cpu_s = s.cpu_s_per_item if s.cpu_s_per_item > 0 else workers * s.busy / s.items_per_s
        # CPU seconds in this stage per root item, booked to the node that runs it.
        per_root[fusion_host(fused, i)] += cpu_s * s.items_per_s / root
    return tuple(1.0 / c if c > 0 else math.inf for c in per_root)


def plan(obs: Observation, cores: float | None = None) -> PlumberPlan | None:
    """Plumber's parallelism and prefetch plan from one profiled interval (None if unmeasured).

    Stages whose ``max_workers`` is 1 are sequential (theta <= 1).
    """
    rates = stage_rates(obs)
    if rates is None:
        return None
    cores = obs.cpus if cores is None else cores
    caps = [min(float(s.max_workers), cores) for s in obs.stages]
    theta, t = solve_lp(rates, cores, caps)
    split = _split_lp(obs, rates, cores, caps) if obs.cluster_cpus >= 1 else None
    phi: tuple[float, ...] = ()
    if split is not None and split[2] > t * (1 + 1e-6):
        theta, phi, t = split
    # Little's law: N* items must be in flight to sustain t; N are in flight already.
    min_latency = sum(1.0 / r for r in rates if math.isfinite(r))
    in_flight_needed = min_latency * t if math.isfinite(t) else 0.0
    concurrency = sum(s.workers * s.busy for s in obs.stages)
    prefetch = math.ceil(max(in_flight_needed - concurrency, 0.0) - _CEIL_TOL)
    workers = list(workers_from_theta(theta))
    root = obs.stages[-1].items_per_s
    for i, s in enumerate(obs.stages):
        # Plumber's disk rule: a stage that waits on I/O needs the parallelism its measured
        # per-worker (wall-clock) rate calls for, not just its CPU share.
        active = 1.0 - s.blocked_in - s.blocked_out
        if is_io_bound(s) and active > 0 and math.isfinite(t) and not s.fused:
            wall_s_per_root = s.workers * active / root  # worker-seconds per root item
            workers[i] = max(workers[i], math.ceil(t * wall_s_per_root - _CEIL_TOL))
    remote: tuple[int, ...] = ()
    if phi:
        remote = tuple(math.ceil(p - _CEIL_TOL) for p in phi)
        workers = [
            max(1, math.ceil(th - _CEIL_TOL) + m) if m else w
            for w, th, m in zip(workers, theta, remote, strict=True)
        ]
    return PlumberPlan(rates, theta, t, tuple(workers), max(0, prefetch), remote)


def _split_lp(
    obs: Observation, rates: Sequence[float], cores: float, caps: Sequence[float]
) -> tuple[tuple[float, ...], tuple[float, ...], float] | None:
    """Plumber's LP with a cluster (module docstring): ``(theta, phi, t)``, or None when no
    stage may run remote or HiGHS fails."""
    from scipy.optimize import linprog

    n = len(rates)
    root = obs.stages[-1].items_per_s
    movable = [i for i, s in enumerate(obs.stages) if s.remotable and math.isfinite(rates[i])]
    if not movable or root <= 0:
        return None
    rho, hop, wire = {}, {}, {}
    for i in movable:
        s, cost = obs.stages[i], remote_cost(obs, i)
        per_root = s.items_per_s / root
        rho[i] = 1.0 / max(1e-12, (max(0.0, s.cpu_s_per_item) + cost.net_s) * per_root)
        hop[i], wire[i] = cost.hop_cpu_s * per_root, cost.net_bytes * per_root
    live = [i for i in range(n) if math.isfinite(rates[i])]
    k = len(movable)
    # Variables: theta (live stages), phi (movable stages), t.
    m = len(live) + k
    c = np.zeros(m + 1)
    c[-1] = -1.0
    c[len(live) : m] = _CLUSTER_COST * max(rates[i] for i in live)
    rows, b_ub = [], []
    for row, i in enumerate(live):  # t - r_i theta_i - rho_i phi_i <= 0
        a = np.zeros(m + 1)
        a[row], a[-1] = -rates[i], 1.0
        if i in rho:
            a[len(live) + movable.index(i)] = -rho[i]
        rows.append(a)
        b_ub.append(0.0)
    host, cluster, link = np.zeros(m + 1), np.zeros(m + 1), np.zeros(m + 1)
    host[: len(live)] = 1.0
    for j, i in enumerate(movable):
        host[len(live) + j] = hop[i] * rho[i]
        cluster[len(live) + j] = 1.0
        link[len(live) + j] = wire[i] * rho[i]
    rows += [host, cluster, link]
    b_ub += [cores, math.floor(obs.cluster_cpus + 1e-9), network_of(obs)[1]]
    bounds = [(0.0, float(caps[i])) for i in live]
    bounds += [(0.0, float(obs.stages[i].max_workers)) for i in movable] + [(0.0, None)]
    res = linprog(c, A_ub=np.array(rows), b_ub=np.array(b_ub), bounds=bounds, method="highs")
    if res.status != 0:
        log.debug("plumber: the cluster LP failed: %s", res.message)
        return None
    theta, phi = [0.0] * n, [0.0] * n
    for row, i in enumerate(live):
        theta[i] = float(res.x[row])
    for j, i in enumerate(movable):
        phi[i] = float(res.x[len(live) + j])
    return tuple(theta), tuple(phi), float(res.x[-1])


class PlumberTuner:
    """Profile one interval, solve once, then hold the plan (Plumber is an offline tuner).

    Args:
        element_bytes: bytes of one root element, to size the prefetch buffer.
        adaptive: re-solve when the CPU count changes (``plumber-adaptive``).

    Example:
        >>> tuner = PlumberTuner(element_bytes=512 * 1024)
    """

    def __init__(self, element_bytes: int = 1 * MiB, adaptive: bool = False) -> None:
        self.element_bytes = int(element_bytes)
        self.adaptive = adaptive
        self.name = "plumber-adaptive" if adaptive else "plumber"
        self.plan: PlumberPlan | None = None
        self.solves = 0

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        """Profile under the pipeline's current allocation (or ``start``)."""
        self.plan = None
        self.solves = 0
        self._profile = start if start is not None else obs.allocation()
        self._cpus = obs.cpus
        return self._profile

    def step(self, obs: Observation) -> Allocation:
        """Solve from the first measured interval; afterwards hold the plan."""
        cpus_changed = obs.cpus != self._cpus
        if self.plan is None or (self.adaptive and cpus_changed):
            new = plan(obs)
            if new is not None:
                self.plan, self._cpus = new, obs.cpus
                self.solves += 1
                log.debug("plumber: theta=%s workers=%s", new.theta, new.workers)
        if self.plan is None:
            return self._profile
        buffers = list(self._profile.buffer_bytes)
        buffers[-1] = max(1, self.plan.prefetch_items) * self.element_bytes
        return Allocation(self.plan.workers, tuple(buffers), remote=self.plan.remote)
