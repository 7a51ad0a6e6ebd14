"""The simulator's closed-form steady state: processor sharing over a line of M/M/1/N buffers.

:class:`Solver` solves one interval of a workload (see the model's steps 1-5 and 7 in
:mod:`torchtune_pipe.sim.model`): stage (or fused group) capacities under processor sharing
and oversubscription, the buffers' efficiencies and fills, and the memory the pipeline holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torchtune_pipe.sim.fused import FusionRule
from torchtune_pipe.sim.workload import Coefficients, SteadyState, Workload
from torchtune_pipe.tuning.base import fusion_host

_CONSUMER_CV2 = 0.01  # a training step's time varies little (cv ~0.1)
_MIN_CV2 = 0.01


def overlapped(c: Sequence[float], d: Sequence[float], k: Sequence[int]) -> list[float]:
    """Waits per item once ``k`` calls are in flight per worker: they overlap on one core, so
    a worker spends ``max(c, (c + d) / k)`` seconds of wall time per item, ``c`` of it CPU."""
    return [
        max(0.0, (ci + di) / ki - ci) if ki > 1 else di for ci, di, ki in zip(c, d, k, strict=True)
    ]


def _mm1n(rho: float, n: float) -> tuple[float, float, float, float]:
    """M/M/1/N queue at load ``rho``: (efficiency, mean fill, P(empty), P(full))."""
    q = rho if rho <= 1.0 else 1.0 / rho
    if q > 1.0 - 1e-9:
        eff, fill, p_lo, p_hi = n / (n + 1), 0.5, 1 / (n + 1), 1 / (n + 1)
    else:
        qn = q**n if q > 0 else 0.0
        denom = 1.0 - qn * q
        eff = (1.0 - qn) / denom
        p_lo = (1.0 - q) / denom  # state 0 at load q < 1
        p_hi = qn * p_lo
        fill = min(1.0, (q / (1.0 - q) - (n + 1) * qn * q / denom) / n)
    if rho > 1.0:  # producer faster: mirror image, the buffer sits near full
        return eff, 1.0 - fill, p_hi, p_lo
    return eff, fill, p_lo, p_hi


class Solver:
    """Steady-state solver of a workload's line (see the module docstring).

    Args:
        workload: what is simulated.
        coef: its coefficients (:meth:`Coefficients.of`).
        rule: its fusion rule: which stages a fused group holds.
    """

    def __init__(self, workload: Workload, coef: Coefficients, rule: FusionRule) -> None:
        self.workload = workload
        self.coef = coef
        self.rule = rule

    def solve(
        self,
        w: Sequence[float],
        buffers: Sequence[int],
        c: Sequence[float],
        d: Sequence[float],
        cpus: float,
        fused: Sequence[bool],
        link: float = math.inf,
        held: Sequence[float] | None = None,
        threads: Sequence[float] = (),
        xc: float | None = None,
    ) -> SteadyState:
        """The steady state of ``w`` workers per stage (``held``: the processes among them
        that hold memory on the host, default all; ``threads``: the thread workers, which hold
        only what the stage keeps per worker) at costs ``c``/``d``, throughput at most
        ``link``, the consumer taking ``xc`` items per second (default the workload's)."""
        co, last_of = self.coef, self.rule.last
        xc = co.xc if xc is None else xc
        n = len(co.R)
        holds = w if held is None else held
        # The line's stations: each group (a host and the stages fused into it) is one, with
        # the host's workers and its members' costs per pipeline item; a stage on its own
        # keeps its per-input-item costs and R, so an unfused line is solved as it always was.
        hosts = [i for i in range(n) if not fused[i]]
        lasts = [last_of(i, fused) for i in hosts]
        R, cn, dn, cv2 = [], [], [], []
        for h, last in zip(hosts, lasts, strict=True):
            if h == last:
                R.append(co.R[h])
                cn.append(c[h])
                dn.append(d[h])
                cv2.append(co.cv2[h])
                continue
            group = range(h, last + 1)
            t = [co.R[i] * (c[i] + d[i]) for i in group]
            R.append(1.0)
            cn.append(sum(co.R[i] * c[i] for i in group))
            dn.append(sum(co.R[i] * d[i] for i in group))
            # Independent per-item times add: the group's squared cv weighs its members'.
            cv2.append(
                sum(ti * ti * co.cv2[i] for ti, i in zip(t, group, strict=True)) / sum(t) ** 2
            )
        m = len(hosts)
        wn = [w[h] for h in hosts]
        cost = sum(R[k] * cn[k] for k in range(m))
        x1 = min(xc, link, min(wn[k] / (R[k] * (cn[k] + dn[k])) for k in range(m)))
        x, phi = _share(wn, R, cn, dn, cpus, cost, x1)
        if x * cost / phi > cpus:  # more runnable workers than cores: switching overhead
            runnable = min(x * cost / phi, sum(wn[k] * cn[k] / (cn[k] + dn[k]) for k in range(m)))
            usable = cpus / (1.0 + self.workload.switch_overhead * max(0.0, runnable / cpus - 1))
            x, phi = _share(wn, R, cn, dn, usable, cost, x1)
        caps = [wn[k] / (R[k] * (cn[k] / phi + dn[k])) for k in range(m)]
        bottleneck = min(range(m), key=caps.__getitem__)
        up = list(caps)
        for k in range(1, m):
            up[k] = min(up[k], up[k - 1])
        down = [xc] * m
        for k in range(m - 2, -1, -1):
            down[k] = min(caps[k + 1], down[k + 1])
        eff = 1.0
        fill, p_empty, p_full, gap = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        mem = 0.0
        for k, (h, last) in enumerate(zip(hosts, lasts, strict=True)):
            gap[h] = abs(up[k] - down[k]) if down[k] < math.inf else up[k]
            cap = self.capacity(buffers[h], last)
            r = co.r_next[last]
            v = (cv2[k] + (cv2[k + 1] if k + 1 < m else _CONSUMER_CV2) / r) / 2
            n_eff = (cap / r + 2.0) / max(v, _MIN_CV2)
            e, fill[h], p_empty[h], p_full[h] = _mm1n(
                up[k] / down[k] if down[k] < math.inf else 0.0, n_eff
            )
            eff *= e
            mem += fill[h] * cap * co.nbytes[last]
        x *= eff
        host = [fusion_host(fused, i) for i in range(n)]
        busy = tuple(min(1.0, x * co.R[i] * (c[i] / phi + d[i]) / w[host[i]]) for i in range(n))
        mem += sum(self.stage_memory(holds, i, fused) for i in range(n)) + co.resident
        if threads:
            mem += sum(self.thread_memory(threads, i, fused) for i in range(n))
        return SteadyState(
            x,
            phi,
            busy,
            tuple(fill),
            tuple(p_empty),
            tuple(p_full),
            mem,
            hosts[bottleneck],
            tuple(gap),
        )

    def capacity(self, buffer_bytes: int, i: int) -> float:
        """Items of stage ``i`` a buffer of ``buffer_bytes`` holds."""
        # A channel always admits one item, whatever its byte budget.
        return max(1.0, buffer_bytes / self.coef.nbytes[i])

    def stage_memory(self, workers: Sequence[float], i: int, fused: Sequence[bool]) -> int:
        """What stage ``i``'s process ``workers`` hold (``StageStats.memory_bytes``): a host's
        workers also hold what the stages fused into it keep per worker; a fused stage has
        none."""
        if fused[i]:
            return 0
        st = self.workload.stages
        held = sum(st[m].worker_bytes for m in range(i, self.rule.last(i, fused) + 1))
        return int(workers[i] * (self.workload.worker_rss_bytes + held))

    def thread_memory(self, threads: Sequence[float], i: int, fused: Sequence[bool]) -> int:
        """What stage ``i``'s thread workers hold in the consumer's process: what the stage
        (and the stages fused into it) keeps per worker, without a worker RSS."""
        if fused[i] or not threads[i]:
            return 0
        st = self.workload.stages
        return int(
            threads[i] * sum(st[m].worker_bytes for m in range(i, self.rule.last(i, fused) + 1))
        )

    def memory(
        self,
        workers: Sequence[float],
        levels: Sequence[float],
        fused: Sequence[bool],
        threads: Sequence[float] = (),
    ) -> float:
        """Bytes held: the buffers' items at ``levels``, the process ``workers``' and the
        thread workers' (``threads``), the resident state."""
        n, nbytes, last = len(levels), self.coef.nbytes, self.rule.last
        buffered = sum(levels[i] * nbytes[last(i, fused)] for i in range(n))
        held = sum(self.stage_memory(workers, i, fused) for i in range(n))
        total = buffered + held + self.coef.resident
        if threads:
            total += sum(self.thread_memory(threads, i, fused) for i in range(n))
        return total


def _share(
    w: Sequence[float],
    R: Sequence[float],
    c: Sequence[float],
    d: Sequence[float],
    cpus: float,
    cost: float,
    x1: float,
) -> tuple[float, float]:
    """Throughput and per-worker CPU rate under processor sharing of ``cpus`` cores."""
    if x1 * cost <= cpus:
        return x1, 1.0
    x = cpus / cost
    # The rate phi at which the slowest station just meets x; others then block part-time.
    phi = max(
        (c[k] / (w[k] / (R[k] * x) - d[k]) for k in range(len(w)) if c[k] > 0),
        default=1.0,
    )
    return x, min(1.0, phi)
