"""Two budgets: what a stage's worker costs on the host and on the cluster.

A remote worker (:attr:`~.base.StageStats.remote_workers`) runs the stage function on one
cluster CPU; the host pays only its hop: the CPU to pack and unpack an item and to make the
call (:attr:`~.base.StageStats.hop_cpu_s_per_item`), and the worker waits the call's round
trip and the bytes' time on the wire (:attr:`~.base.StageStats.net_s_per_item`). Where the
observation measured them (the stage runs remote workers now) they are taken as measured;
otherwise they are predicted from the observation's network facts, or from the priors below
where those are not measured (live). The planner, the Plumber LP and the oracle decide the
split with these numbers; the hard limits (:mod:`~.safety`) charge them.

Priors, from ``benchmarks/remote.py`` on this project's machine (BENCHMARKS.md, "Remote
stages"): a remote call costs 1.3-1.5 ms however small its frame (``RPC_S``), and 1.5-2 ms per
MiB each way once frames go through Ray's object store (``NETWORK_BYTES_PER_S``, 1 MiB per
1.75 ms). Of a call's time, the host spends ``RPC_CPU_S`` on its own CPU (Ray's submit and
get in the calling thread; an assumption, a fifth of the call: the rest is the actor's side
and the wait), and every byte that crosses is copied ``HOP_COPIES`` times on the host (packed
into one array and handed to Ray on the way out, copied out of the object store and into the
items on the way back, ``remote._pack``/``_unpack``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtune_pipe.tuning.base import Allocation, Observation, StageStats

# Seconds one remote call costs besides its bytes (benchmarks/remote.py: 1.3-1.5 ms).
RPC_S = 1.4e-3
# Bytes per second between host and cluster (benchmarks/remote.py: 1.5-2 ms per MiB each way).
NETWORK_BYTES_PER_S = (1 << 20) / 1.75e-3
# Host CPU seconds per remote call (module docstring).
RPC_CPU_S = 0.3e-3
# Host copies of every byte that crosses to or from a remote worker (module docstring).
HOP_COPIES = 4
# DRAM copy bandwidth when the observation does not give it (GB/s).
DEFAULT_DRAM_GBPS = 10.0


@dataclass(frozen=True)
class RemoteCost:
    """What one item of a stage costs when a remote worker makes it.

    Attributes:
        hop_cpu_s: host CPU seconds per item (the hop), charged to local cores.
        net_s: wall seconds per item the worker waits on the network (round trip share plus
            bytes over bandwidth).
        net_bytes: bytes per item on the wire, in and out.
        measured: taken from the stage's remote workers (else predicted).
    """

    hop_cpu_s: float
    net_s: float
    net_bytes: float
    measured: bool


def network_of(obs: Observation) -> tuple[float, float]:
    """``(rpc_s, network_bytes_per_s)`` as measured, or the priors where they are not."""
    rpc = obs.rpc_s if obs.rpc_s > 0 else RPC_S
    bw = obs.network_bytes_per_s if obs.network_bytes_per_s > 0 else NETWORK_BYTES_PER_S
    return rpc, bw


def wire_bytes(obs: Observation, i: int) -> float:
    """Bytes one item of stage ``i`` moves over the network when made remotely: its input (the
    previous stage's items per item out) and its output."""
    st = obs.stages[i]
    out = max(0.0, st.bytes_per_item)
    if i == 0:
        return out
    prev = obs.stages[i - 1]
    ratio = st.items_in_per_s / st.items_per_s if st.items_in_per_s > 0 < st.items_per_s else 1.0
    return out + ratio * max(0.0, prev.bytes_per_item)


def remote_cost(obs: Observation, i: int) -> RemoteCost:
    """What an item of stage ``i`` costs when a remote worker makes it (module docstring)."""
    st = obs.stages[i]
    rpc, bw = network_of(obs)
    nbytes = wire_bytes(obs, i)
    if st.remote_workers > 0 and st.remote_items_per_s > 0 and st.net_s_per_item > 0:
        return RemoteCost(st.hop_cpu_s_per_item, st.net_s_per_item, nbytes, True)
    calls = max(1.0, st.items_per_call)
    dram = (obs.dram_gbps if obs.dram_gbps > 0 else DEFAULT_DRAM_GBPS) * 1e9
    hop = RPC_CPU_S / calls + HOP_COPIES * nbytes / dram
    return RemoteCost(hop, rpc / calls + nbytes / bw, nbytes, False)


def remote_of(alloc: Allocation, obs: Observation) -> tuple[int, ...]:
    """Remote workers per stage that ``alloc`` asks for, its empty ``remote`` read as "each
    stage keeps its placement" (:class:`~.base.Allocation`), each at most the stage's workers
    (none for a fused stage)."""
    stages = obs.stages
    if alloc.remote:
        asked = alloc.remote
    else:
        asked = tuple(_kept(s, w) for s, w in zip(stages, alloc.workers, strict=True))
    fused = alloc.fused or (False,) * len(asked)
    return tuple(0 if f else min(r, w) for r, w, f in zip(asked, alloc.workers, fused, strict=True))


def _kept(stage: StageStats, workers: int) -> int:
    # A stage whose workers all run remote (a placement="ray" stage) keeps them all there.
    if stage.workers > 0 and stage.remote_workers >= stage.workers:
        return workers
    return stage.remote_workers


def local_total(alloc: Allocation, obs: Observation) -> int:
    """Workers ``alloc`` runs on the host in total (its remote ones, as
    :func:`remote_of` reads them, left out)."""
    return sum(alloc.workers) - sum(remote_of(alloc, obs))
