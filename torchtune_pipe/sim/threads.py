"""Thread workers of a simulated pipeline: one interpreter lock shared with the consumer.

:class:`ThreadModel` models ``Allocation.threads`` for a workload (the model's step 9 in
:mod:`torchtune_pipe.sim.model`). A thread worker of stage ``i`` runs in the consumer's process
and is a process worker in every other respect: it takes a core as a process does (processor
sharing, oversubscription), its output crosses its channel as a process's does (the executor
encodes it into a shared-memory arena: the hop is kept), and it holds the stage's
``worker_bytes`` (in the consumer's process) but no worker RSS of its own. One output is not
encoded: what the thread workers of the last stage (or of the host of a group ending there)
make for the consumer, in their own process, is handed over as it is
(:func:`multiproc.arena.keep`): their share of that stage's items pays no hop
(:meth:`ThreadModel.handed_over`).

What threads add is the lock. ``g_i = StageModel.gil_share`` of a thread worker's CPU time
``c_i`` holds it, and so does the consumer for ``Workload.consumer_gil_s_per_item`` per item it
takes; the lock-holding CPU of every thread worker of every stage plus the consumer's,

    ``x * (sum_i theta_i * R_i * g_i * c_i + consumer_gil_s_per_item)``

(``theta_i``: the share of stage ``i``'s items its thread workers make), cannot pass one second
per second. Where it would, the lock is processor-shared: its holders proceed at a rate
``psi < 1``, so a thread worker waits ``g_i * c_i * (1 / psi - 1)`` per item for it (a wait,
not CPU: a thread blocked on the lock is not runnable) and so does the consumer. ``psi`` is
what makes the demand meet the lock's one second per second, found by bisection as the
remote model finds its CPU rate: the demand falls as ``psi`` falls (thread workers slow down,
and in a stage with both kinds its process workers take a larger share of its items). As with
remote workers, a stage's process and thread workers are one station whose costs are blended
by the two kinds' rates, which gives the station exactly their summed capacity; a fused
group's host's thread workers run the whole group under the lock. Without a GIL
(``Workload.gil`` False, a free-threaded interpreter) there is no lock: a thread worker is a
process worker holding less memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torchtune_pipe.sim.fused import FusionRule
from torchtune_pipe.sim.remote import RemoteModel
from torchtune_pipe.sim.workload import Coefficients, SteadyState, Workload
from torchtune_pipe.tuning.base import Allocation, fusion_host

# Bisection steps for the lock's rate psi (ThreadModel.solve): psi within 2**-24 of its root.
_PSI_STEPS = 24

# What ThreadModel.solve returns: the steady state, the blended CPU and waits per input item,
# the remote share of each stage's items, and the local workers' waits (lock waits blended in).
Solved = tuple[SteadyState, list[float], list[float], list[float], list[float]]


class ThreadModel:
    """Thread workers of a workload (see the module docstring).

    Args:
        workload: what is simulated.
        coef: its coefficients (:meth:`Coefficients.of`).
        rule: its fusion rule: which stages a host's thread workers run.
        remote: its remote model, which solves the line with the blended costs.
    """

    def __init__(
        self, workload: Workload, coef: Coefficients, rule: FusionRule, remote: RemoteModel
    ) -> None:
        self.workload = workload
        self.coef = coef
        self.rule = rule
        self.remote = remote
        self.gil = tuple(s.gil_share for s in workload.stages)

    def threadable(self, fused: Sequence[bool]) -> tuple[bool, ...]:
        """Per stage, whether its local workers may move between processes and threads
        (``StageStats.threadable``): a threadable stage, while it is not fused."""
        return tuple(
            s.threadable and not f for s, f in zip(self.workload.stages, fused, strict=True)
        )

    def asked(
        self,
        a: Allocation,
        fused: Sequence[bool],
        local: Sequence[int],
        now: Sequence[int],
        now_local: Sequence[int],
    ) -> tuple[int, ...]:
        """Thread workers per stage ``a`` runs with ``local`` local workers per stage, where the
        stages run ``now`` thread workers of ``now_local`` local ones: a threadable stage's
        ``a.threads`` (at most its local workers); a stage that is not threadable, or all of
        them where ``a.threads`` is empty, keeps the kind it runs (all threads stays all
        threads, else as many as now, at most its local workers); none for a fused stage."""
        ok = self.threadable(fused)
        now = now or (0,) * len(local)
        out = []
        for i, n in enumerate(local):
            if a.threads and ok[i]:
                out.append(min(a.threads[i], n))
            elif now[i] > 0 and now[i] >= now_local[i]:
                out.append(n)
            else:
                out.append(min(now[i], n))
        return tuple(out)

    def solve(
        self,
        local: Sequence[float],
        threads: Sequence[float],
        remote: Sequence[float],
        buffers: Sequence[int],
        c: Sequence[float],
        d: Sequence[float],
        cpus: float,
        fused: Sequence[bool],
    ) -> Solved:
        """The steady state with ``local`` workers per stage on the host, ``threads`` of them
        threads, and ``remote`` on the cluster (module docstring)."""
        wl = self.workload
        c = self.handed_over(c, local, threads, fused)
        cg = wl.consumer_gil_s_per_item if wl.gil else 0.0
        if not wl.gil or (not any(threads) and cg <= 0):
            held = threads if any(threads) else ()
            ss, c2, d2, share = self.remote.solve(
                local, remote, buffers, c, d, cpus, fused, threads=held
            )
            return ss, c2, d2, share, list(d)

        def at(psi: float) -> tuple[Solved, list[float]]:
            """The steady state with the lock's holders at rate ``psi``, and per stage the
            share of its local items thread workers make."""
            lag = 1.0 / psi - 1.0
            xc = None
            if cg > 0:  # the consumer waits for the lock too
                xc = 1.0 / (max(wl.consumer_step_s, cg) + cg * lag)
            dl, theta = self._waits(1.0, lag, local, threads, c, d, fused)
            waits: Callable[[float], list[float]] | None = None
            if lag > 0 and any(0 < t < n for t, n in zip(threads, local, strict=True)):
                # A stage runs both kinds: their shares of its items depend on the CPU rate.
                def waits(phi: float) -> list[float]:
                    return self._waits(phi, lag, local, threads, c, d, fused)[0]

            ss, c2, d2, share = self.remote.solve(
                local, remote, buffers, c, dl, cpus, fused, threads=threads, waits=waits, xc=xc
            )
            if waits is not None:
                dl, theta = self._waits(ss.phi, lag, local, threads, c, d, fused)
            return (ss, c2, d2, share, dl), theta

        solved, theta = at(1.0)
        if self._demand(solved[0], solved[3], theta, c) <= 1.0:
            return solved
        lo, hi = 0.0, 1.0
        for _ in range(_PSI_STEPS):
            mid = (lo + hi) / 2
            tried, theta = at(mid)
            if self._demand(tried[0], tried[3], theta, c) > 1.0:
                hi = mid
            else:
                lo, solved = mid, tried
        if lo <= 0.0:  # every root within 2**-24 of 0: the lock lets next to nothing through
            solved = at(hi)[0]
        return solved

    def handed_over(
        self,
        c: Sequence[float],
        local: Sequence[float],
        threads: Sequence[float],
        fused: Sequence[bool],
    ) -> Sequence[float]:
        """``c`` with the last stage's hop left out for :meth:`handed_share` of its items: their
        frames reach the consumer as objects. The hop's share of the stage's cost is taken off
        in proportion, so a drift or noise scaling the cost scales what is left the same way."""
        last = len(c) - 1
        share = self.handed_share(local, threads, fused)
        co = self.coef
        whole = co.c_fn[last] + co.c_out[last]
        if share <= 0 or whole <= 0:
            return c
        out = list(c)
        out[last] *= 1.0 - share * co.c_out[last] / whole
        return out

    @staticmethod
    def handed_share(
        local: Sequence[float], threads: Sequence[float], fused: Sequence[bool]
    ) -> float:
        """The share of the last stage's items handed to the consumer as objects: that of the
        local workers of its host (itself, or the stage its group runs in) that are threads."""
        h = fusion_host(fused, len(local) - 1)
        if threads[h] <= 0 or local[h] <= 0:
            return 0.0
        return min(1.0, threads[h] / local[h])

    def _waits(
        self,
        phi: float,
        lag: float,
        local: Sequence[float],
        threads: Sequence[float],
        c: Sequence[float],
        d: Sequence[float],
        fused: Sequence[bool],
    ) -> tuple[list[float], list[float]]:
        """Per stage, the local workers' wait per input item with the thread workers' lock
        waits (``g c lag`` each) blended in by the kinds' rates at CPU rate ``phi``, and the
        share of its local items thread workers make (a fused stage's: its host's)."""
        R = self.coef.R
        dl, theta = list(d), [0.0] * len(d)
        for h in range(len(d)):
            if fused[h] or threads[h] <= 0:
                continue
            group = range(h, self.rule.last(h, fused) + 1)
            procs = max(0.0, local[h] - threads[h])
            wait = sum(R[m] * self.gil[m] * c[m] for m in group) * lag
            if procs > 0:
                a = sum(R[m] * (c[m] / phi + d[m]) for m in group)
                rate_p, rate_t = procs / a if a > 0 else math.inf, threads[h] / (a + wait)
                f = rate_t / (rate_p + rate_t) if rate_p < math.inf else 0.0
            else:
                f = 1.0
            for m in group:
                dl[m] = d[m] + f * self.gil[m] * c[m] * lag
                theta[m] = f
        return dl, theta

    def _demand(
        self, ss: SteadyState, share: Sequence[float], theta: Sequence[float], c: Sequence[float]
    ) -> float:
        """Lock-holding CPU seconds per second of the thread workers and the consumer, with
        ``theta`` of each stage's local items (``1 - share`` of its items) made by threads."""
        R = self.coef.R
        per_item = sum(
            theta[i] * (1.0 - share[i]) * R[i] * self.gil[i] * c[i] for i in range(len(c))
        )
        return ss.throughput * (per_item + self.workload.consumer_gil_s_per_item)
