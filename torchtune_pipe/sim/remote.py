"""Remote workers of a simulated pipeline: a stage's workers split between host and cluster.

:class:`RemoteModel` models ``Allocation.remote`` for a workload (the model's step 8 in
:mod:`torchtune_pipe.sim.model`). A remote
worker of stage ``i`` runs the stage function on a cluster CPU of its own (no share of the
host's cores, no processor sharing), and per input item:

* waits ``rpc_s / items_per_call`` (the call's round trip, shared by a frame's items) plus
  its bytes over the link, in (the previous stage's item) and out (its own), ``net_i``;
* costs the host ``h_i`` of CPU: ``rpc_cpu_s / items_per_call``, ``hop_copies`` copies of its
  bytes at DRAM speed, and the channel its output still crosses on the host;
* holds no memory on the host (its local side is a thread).

So, seen from the host, a remote worker is a worker with CPU ``h_i`` and a wait of
``c_i + d_i + net_i`` (its function's CPU on the cluster, its own waits, the network). A stage
with ``L`` local and ``Rm`` remote workers is one station with ``L + Rm`` workers whose items
split by the two kinds' rates (``L / A`` against ``Rm / B``, with ``A`` and ``B`` a local and a
remote worker's wall time per item at the CPU rate ``phi``): costs blended by that share give
the station exactly the two kinds' summed capacity. The link is shared: throughput is at most
``network_bytes_per_s`` over the bytes every pipeline item moves through it. Remote workers
past the cluster's CPUs are pending (Ray keeps an actor it has no room for waiting) and do
nothing; the largest remote counts wait first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torchtune_pipe.sim.solve import Solver
from torchtune_pipe.sim.workload import Coefficients, StageModel, SteadyState, Workload
from torchtune_pipe.tuning.base import Allocation

# Bisection steps for the CPU rate local and remote workers share (``RemoteModel.solve``).
_PHI_STEPS = 14
_NO_WORKERS = 1e-9


def can_run_remote(stage: StageModel) -> bool:
    """Whether ``stage``'s workers may run on the cluster: a ``remotable`` ``"map"``."""
    return stage.kind == "map" and stage.remotable


# Per stage: workers, blended CPU and wait per input item, remote share of its items; and the
# link's cap on throughput (RemoteModel._blend).
_Blend = tuple[list[float], list[float], list[float], list[float], float]


class RemoteModel:
    """Remote workers of a workload (see the module docstring).

    Args:
        workload: what is simulated.
        coef: its coefficients (:meth:`Coefficients.of`).
        solver: the solver of its line, run with the blended costs.
    """

    def __init__(self, workload: Workload, coef: Coefficients, solver: Solver) -> None:
        self.workload = workload
        self.coef = coef
        self.solver = solver

    def remotable(self) -> tuple[bool, ...]:
        """Per stage, whether its workers may run on the cluster (``StageStats.remotable``): a
        remotable map; only while it is neither fused nor hosting a fused stage
        (:meth:`error`)."""
        return tuple(can_run_remote(sm) for sm in self.workload.stages)

    def error(self, remote: Sequence[int], fused: Sequence[bool]) -> str | None:
        """Why ``remote`` cannot run under ``fused`` (None: it can)."""
        ok, n = self.remotable(), len(self.workload.stages)
        for i, r in enumerate(remote):
            if r > 0 and not ok[i]:
                return f"stage {self.workload.stages[i].name!r} cannot run remote workers"
            if r > 0 and (fused[i] or (i + 1 < n and fused[i + 1])):
                return (
                    f"stage {self.workload.stages[i].name!r} runs fused: its workers run "
                    "where the group's host runs"
                )
        return None

    def local(self, remote: Sequence[int], workers: Sequence[int]) -> tuple[int, ...]:
        """Local workers per stage: its workers less the remote ones it asks for (running or
        pending: a pending one waits for a cluster CPU, not for a local core)."""
        if not remote:
            return tuple(workers)
        return tuple(w - min(r, w) for r, w in zip(remote, workers, strict=True))

    def running(
        self, remote: Sequence[int], workers: Sequence[int], cluster_cpus: float
    ) -> list[int]:
        """Remote workers that run (at most each stage's workers, in total at most the
        cluster's CPUs: the rest are pending, the largest counts first)."""
        run = [min(r, w) for r, w in zip(remote, workers, strict=True)] if remote else []
        if not run:
            return [0] * len(self.workload.stages)
        cap = int(cluster_cpus + 1e-9)
        while sum(run) > cap:
            run[max(range(len(run)), key=run.__getitem__)] -= 1
        return run

    def hop(
        self, c: Sequence[float], fused: Sequence[bool]
    ) -> tuple[list[float], list[float], list[float], list[float]]:
        """Per input item of each stage made remotely: host CPU ``h``, the function's CPU on
        the cluster, and the network wait ``net`` (module docstring); bytes per item too."""
        wl, co, n = self.workload, self.coef, len(self.workload.stages)
        copy_s = 1.0 / (wl.dram_gbps * 1e9)
        h, far, net, wire = [], [], [], []
        for i, sm in enumerate(wl.stages):
            channel = 0.0 if i + 1 < n and fused[i + 1] else co.c_out[i]
            nbytes = (co.nbytes[i - 1] if i > 0 else 0.0) + sm.bytes_per_item / sm.ratio
            calls = sm.items_per_call
            h.append(wl.rpc_cpu_s / calls + wl.hop_copies * nbytes * copy_s + channel)
            far.append(max(0.0, c[i] - channel))
            net.append(wl.rpc_s / calls + nbytes / wl.network_bytes_per_s)
            wire.append(nbytes)
        return h, far, net, wire

    def _blend(
        self,
        local: Sequence[float],
        remote: Sequence[float],
        c: Sequence[float],
        d: Sequence[float],
        phi: float,
        fused: Sequence[bool],
    ) -> _Blend:
        """Per stage: workers, blended CPU and wait per input item, the remote share of its
        items, and the link's cap on throughput (module docstring)."""
        if not any(remote):
            w = [max(float(n), _NO_WORKERS) for n in local]
            return w, list(c), list(d), [0.0] * len(c), math.inf
        h, far, net, wire = self.hop(c, fused)
        w, c2, d2, share = [], [], [], []
        n = len(self.workload.stages)
        for i in range(n):
            wl, wr = local[i], remote[i]
            a = c[i] / phi + d[i]
            wait = far[i] + d[i] + net[i]
            b = h[i] / phi + wait
            rate_l = wl / a if a > 0 else (math.inf if wl > 0 else 0.0)
            rate_r = wr / b if b > 0 else 0.0
            f = rate_r / (rate_l + rate_r) if wr > 0 else 0.0
            # A stage whose workers all wait for cluster CPUs makes (next to) nothing.
            w.append(max(float(wl + wr), _NO_WORKERS))
            c2.append((1 - f) * c[i] + f * h[i])
            d2.append((1 - f) * d[i] + f * wait)
            share.append(f)
        moved = sum(self.coef.R[i] * share[i] * wire[i] for i in range(n))
        link = self.workload.network_bytes_per_s / moved if moved > 0 else math.inf
        return w, c2, d2, share, link

    def solve(
        self,
        local: Sequence[float],
        remote: Sequence[float],
        buffers: Sequence[int],
        c: Sequence[float],
        d: Sequence[float],
        cpus: float,
        fused: Sequence[bool],
        threads: Sequence[float] = (),
        waits: Callable[[float], Sequence[float]] | None = None,
        xc: float | None = None,
    ) -> tuple[SteadyState, list[float], list[float], list[float]]:
        """The steady state with ``local`` and ``remote`` workers per stage. The share of
        items each kind makes depends on the CPU rate ``phi`` local workers get, and ``phi``
        on that share (more items remote leave more cores): the rate the blend assumes must
        be the rate the solve gives. The solved rate falls as the assumed one rises, so the
        fixed point lies between the rate solved at ``phi = 1`` and 1 (bisection). Returns
        the steady state, the blended costs and the remote shares.

        ``threads`` of the local workers are threads (they hold no worker RSS); ``waits``, the
        local workers' waits at a CPU rate (default ``d`` at every rate), and ``xc``, the
        consumer's rate (default the workload's), are the thread model's
        (:mod:`torchtune_pipe.sim.threads`)."""
        solve = self.solver.solve
        held = local
        if threads:
            held = [max(0.0, n - t) for n, t in zip(local, threads, strict=True)]
        dl = d if waits is None else waits(1.0)
        w, c2, d2, share, link = self._blend(local, remote, c, dl, 1.0, fused)
        ss = solve(w, buffers, c2, d2, cpus, fused, link, held, threads, xc)
        if (not any(remote) and waits is None) or ss.phi >= 1.0:
            return ss, c2, d2, share
        lo, hi = ss.phi, 1.0
        for _ in range(_PHI_STEPS):
            mid = (lo + hi) / 2
            dl = d if waits is None else waits(mid)
            w, c2, d2, share, link = self._blend(local, remote, c, dl, mid, fused)
            ss = solve(w, buffers, c2, d2, cpus, fused, link, held, threads, xc)
            lo, hi = (mid, hi) if ss.phi > mid else (lo, mid)
        return ss, c2, d2, share

    def asked(self, a: Allocation, fused: Sequence[bool], now: Allocation) -> tuple[int, ...]:
        """Remote workers per stage ``a`` asks for, with ``now`` in force: ``a.remote``, or
        where it is empty each stage's placement kept (all remote stays all remote; else the
        count, at most its workers); none for a fused stage."""
        if a.remote:
            asked = a.remote
        elif not now.remote:
            return ()
        else:
            asked = tuple(
                w if r >= v else min(r, w)
                for r, v, w in zip(now.remote, now.workers, a.workers, strict=True)
            )
        return tuple(0 if fused[i] else min(r, a.workers[i]) for i, r in enumerate(asked))
