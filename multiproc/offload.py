"""Offload workers: some of a stage's workers forward its frames to a remote runtime.

A stage with :attr:`StageSpec.offload <multiproc.spec.StageSpec.offload>` holds two kinds of
workers at once: its own local workers (processes or threads running the stage function) and
*offload* workers, threads of the executor's process that run :attr:`Offload.fn` instead, a
function that sends each frame's items somewhere else (a cluster's actor, say) and returns what
came back. Both kinds take frames from the stage's one queue and commit their outputs with one
message, so order, exactly-once delivery, recovery, retiring and the error contract are the
same for both; ``Executor.resize(stage, n, remote=m)`` sets how many of the stage's ``n``
workers are offload workers (the router starts and retires each kind apart,
:func:`multiproc.policy.resize_plan`), and the stage's snapshot counts the offload workers'
items and time apart (:class:`~multiproc.stats.StageSnapshot` ``remote_*``).

The executor knows nothing of the runtime: the function is an ordinary stage function run by a
thread worker (its ``init`` starts what it needs, its ``on_worker_exit()`` stops it). It may
report each remote call through :meth:`multiproc.concurrency.CallPool.add_remote_call` (bytes
moved, wall time beyond the remote function's own), summed per worker as :class:`CallSums`, from
which a reader fits the link's round trip and bandwidth (:meth:`CallSums.fit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

# Remote calls' bytes are summed in units of this many bytes (their squares must fit int64
# counters over a long run: a 4 MiB frame each way is 2**17 units, its square 2**34).
CALL_BYTES_UNIT = 64


@dataclass(frozen=True)
class Offload:
    """What a stage's offload workers run instead of the stage function.

    Args:
        fn: the forwarding function, run by thread workers of the executor's process as a
            stage function of ``kind``; each worker unpickles its own copy (cloudpickle), and
            a copy with an ``on_worker_exit()`` method has it called when its worker ends.
        kind: how the workers call ``fn``: ``batch_map`` (one call per frame, the usual
            choice for a remote call), ``map`` or ``flat_map``.
        init: ``init(stage_name, worker_index)`` run in each offload worker as it starts (in
            place of the stage's own ``init``), e.g. to start its remote counterpart.
        workers: offload workers at the start (of the stage's ``workers``).
        max_workers: the most offload workers ``resize`` may ask for.
        runtime: the runtime's name, for logs and snapshots (``"ray"``).
    """

    fn: Callable[..., Any]
    kind: Literal["map", "flat_map", "batch_map"] = "batch_map"
    init: Callable[[str, int], None] | None = None
    workers: int = 0
    max_workers: int = 64
    runtime: str = "remote"

    def problem(self) -> str | None:
        """What is wrong with these fields, or None."""
        if not callable(self.fn):
            return f"offload.fn must be callable, got {type(self.fn).__name__}"
        if self.kind not in ("map", "flat_map", "batch_map"):
            return f"offload.kind must be map, flat_map or batch_map, got {self.kind!r}"
        if self.init is not None and not callable(self.init):
            return f"offload.init must be callable or None, got {self.init!r}"
        for arg in ("workers", "max_workers"):
            v = getattr(self, arg)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                return f"offload.{arg} must be an int >= 0, got {v!r}"
        if self.workers > self.max_workers:
            return f"offload.workers ({self.workers}) > offload.max_workers ({self.max_workers})"
        if not isinstance(self.runtime, str) or not self.runtime:
            return f"offload.runtime must be a non-empty str, got {self.runtime!r}"
        return None


S = TypeVar("S")


def remote_problem(off: Offload | None, n: int, remote: int | None) -> str | None:
    """What is wrong with ``remote`` offload workers of ``n`` for a stage with offload ``off``
    (``Executor.resize``), or None."""
    if remote is None:
        return None
    most = min(n, off.max_workers) if off is not None else 0
    if not isinstance(remote, int) or isinstance(remote, bool) or not 0 <= remote <= most:
        why = "" if off is not None else " (the stage has no offload)"
        return f"remote must be an int in [0, {most}]{why}, got {remote!r}"
    return None


def offload_spec(stage: S) -> S:
    """The spec an offload worker of ``stage`` (a ``StageSpec`` with an offload) runs: the
    offload function as a thread worker's stage, under the stage's name and error options."""
    off: Offload = stage.offload  # type: ignore[attr-defined]
    return dataclasses.replace(  # type: ignore[type-var]
        stage,
        kind=off.kind,
        fn=off.fn,
        init=off.init,
        worker_type="thread",
        placement=off.runtime,
        offload=None,
    )


def local_spec(stage: S) -> S:
    """The spec a local worker of ``stage`` runs (without the offload, which it never uses)."""
    return dataclasses.replace(stage, offload=None)  # type: ignore[type-var]


@dataclass(frozen=True)
class CallSums:
    """Sums over remote calls for a least-squares line of each call's wait over its bytes.

    ``x`` is a call's bytes, both ways, in :data:`CALL_BYTES_UNIT` units; ``y`` its wall time
    beyond the remote function's own, in microseconds (the round trip, the bytes' time, the
    runtime's queues). ``n`` calls; ``sx``, ``sy``, ``sxx``, ``sxy`` the sums of ``x``, ``y``,
    ``x*x`` and ``x*y``. Sums subtract (:meth:`__sub__`), so two snapshots give an interval's.
    """

    n: int = 0
    sx: int = 0
    sy: int = 0
    sxx: int = 0
    sxy: int = 0

    def __add__(self, other: CallSums) -> CallSums:
        return CallSums(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def __sub__(self, other: CallSums) -> CallSums:
        return CallSums(*(a - b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[int, int, int, int, int]:
        return (self.n, self.sx, self.sy, self.sxx, self.sxy)

    @staticmethod
    def total(sums: Sequence[CallSums]) -> CallSums:
        out = CallSums()
        for s in sums:
            out = out + s
        return out

    def fit(self) -> tuple[float, float]:
        """``(rpc_s, bytes_per_s)``: the wait of a call of no bytes (s) and the link's
        bandwidth (bytes/s) of the line through the calls; ``(0, 0)`` without calls.

        When the calls' sizes do not tell the two apart (all alike, or a line that falls with
        size on noise), the mean wait is the round trip and the bandwidth is 0 (not measured);
        a line that would start below zero goes through the origin instead (all bandwidth).
        """
        n = self.n
        if n <= 0 or self.sy <= 0:
            return 0.0, 0.0
        mean_y = self.sy / n
        den = n * self.sxx - self.sx * self.sx
        if n < 3 or den <= 0:
            return mean_y / 1e6, 0.0
        slope = (n * self.sxy - self.sx * self.sy) / den  # us per unit
        if slope <= 0:
            return mean_y / 1e6, 0.0
        a = (self.sy - slope * self.sx) / n
        if a < 0:
            slope = self.sxy / self.sxx if self.sxx > 0 else 0.0
            a = 0.0
            if slope <= 0:
                return mean_y / 1e6, 0.0
        return a / 1e6, CALL_BYTES_UNIT / (slope / 1e6)


def call_point(nbytes: int, wait_ns: int) -> tuple[int, int]:
    """A call's ``(x, y)`` in :class:`CallSums` units."""
    return max(0, nbytes) // CALL_BYTES_UNIT, max(0, wait_ns) // 1000


__all__ = ["CallSums", "Offload", "call_point", "local_spec", "offload_spec"]
