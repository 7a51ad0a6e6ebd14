"""The remote side of a live observation: a stage's remote workers and the network's fit.

``telemetry.observe`` reads a stage's remote fields here (:func:`placement_stats`: a
``placement="ray"`` stage runs every worker remote, a ``placement="auto"`` one the executor's
offload workers) and the link's round trip and bandwidth (:func:`network`), which mean what the
simulator's do (:mod:`torchtune_pipe.sim.remote`): ``rpc_s`` a call's wait besides its bytes,
``network_bytes_per_s`` the bytes' rate.
"""

from __future__ import annotations

from multiproc import Snapshot, StageSnapshot
from multiproc.offload import CallSums


def placement_stats(s: StageSnapshot, p: StageSnapshot | None, out: int, dt: float) -> dict:
    """A stage's remote and network fields (``telemetry.observe``) over the interval from
    snapshot ``p`` (None: from the start) to ``s``."""
    bytes_out = s.bytes_out - (p.bytes_out if p is not None else 0)
    frames = sum(w.frames_in for w in s.per_worker)
    items = sum(w.items_in for w in s.per_worker)
    fields = {
        "bytes_per_item": bytes_out / out if out > 0 and bytes_out > 0 else 0.0,
        "items_per_call": items / frames if frames > 0 and items >= frames else 1.0,
    }
    # The calls' wait beyond the remote function's own wall time (us), summed: the round
    # trips and the bytes' time (a stage's local workers make no remote calls).
    waited_us = max(0, s.calls.sy - (p.calls.sy if p is not None else 0))
    if s.placement != "local":  # placement="ray": every worker remote
        return {
            **fields,
            "remote_workers": s.workers,
            "remote_items_per_s": max(0, out) / dt,
            "net_s_per_item": waited_us / 1e6 / out if out > 0 else 0.0,
        }
    if not s.remotable:
        return fields
    # placement="auto": the offload workers' own counters (multiproc.offload).
    if s.remote_workers <= 0:
        return {**fields, "remotable": True}

    def d(attr: str) -> int:
        return max(0, getattr(s, attr) - (getattr(p, attr) if p is not None else 0))

    r_out = d("remote_items_out")
    return {
        **fields,
        "remotable": True,
        "remote_workers": s.remote_workers,
        "remote_items_per_s": r_out / dt,
        "net_s_per_item": waited_us / 1e6 / r_out if r_out > 0 else 0.0,
    }


def network(cur: Snapshot, before: dict) -> tuple[float, float]:
    """``(rpc_s, network_bytes_per_s)`` of the interval: a least-squares line of the remote
    calls' wait beyond their function's own time over the bytes they moved, all remote stages'
    calls together (:meth:`multiproc.offload.CallSums.fit`); 0 where not measured."""
    sums = [s.calls - before[s.name].calls if s.name in before else s.calls for s in cur.stages]
    return CallSums.total(sums).fit()
