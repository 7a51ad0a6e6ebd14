"""Map stages split between host and cluster (``Pipeline.map(fn, placement="auto")``).

An ``"auto"`` stage starts as a local map stage (its workers are processes, or threads, of the
host, as any stage's) and may run some of its workers on the Ray cluster this process is
connected to: those are the executor's *offload* workers (:mod:`multiproc.offload`), threads
of this process that each own one Ray actor and forward a frame's items to it in one call, the
machinery of ``placement="ray"`` (:class:`~torchtune_pipe.remote.stage.RayMap`). Both kinds take
frames from the stage's one queue, so order, exactly-once delivery, resume, retiring and the
error contract are the executor's; ``RunningPipeline.apply`` moves workers between host and
cluster with ``Allocation.remote`` (``Executor.resize(stage, n, remote=m)``), and the stage
reports ``remotable=True``, its ``remote_workers`` and their items.

Whether the stage may use the cluster is decided when the pipeline's executor is built
(``Pipeline.spec``): with Ray connected (``ray.init(...)`` first), it can; without Ray, or not
connected, it runs local only and reports ``remotable=False``, with no error. Nothing here
imports ``ray``: an actor starts only when a worker moves to the cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from multiproc.offload import Offload
from torchtune_pipe.remote import stage as _remote
from torchtune_pipe.stages import Stage


def auto_offload(st: Stage, fn: Callable[[Any], Any]) -> Offload | None:
    """The offload of an ``"auto"`` stage ``st`` running ``fn`` (the user's function), or
    None when this process is not connected to a Ray cluster (the stage runs local only).

    No worker starts on the cluster until the tuner (or ``Executor.resize(..., remote=m)``)
    moves some there; at most ``st.max_workers`` do.
    """
    if not _remote.connected():
        return None
    options = st.ray_options if st.ray_options is not None else _remote.DEFAULT_RAY_OPTIONS
    forward = _remote.RayMap(fn, st.name, options, init=st.init, ends_not_items=True)
    return Offload(
        forward,
        kind="batch_map",
        init=forward.start,
        workers=0,
        max_workers=st.max_workers,
        runtime="ray",
    )
