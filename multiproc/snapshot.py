"""What a worker process sees: this process as it was when the snapshot was taken.

A :class:`Snapshot` is a fork server forked from this process (:class:`multiproc.servers.ForkServer`)
at a moment the caller picks (a loader takes one at ``iter()``, as torch's DataLoader forks its
workers there). Every worker of the executor that holds it is forked from that server, so it
sees the process as it was then: module globals, environment variables, a dataset's attributes,
and what does not pickle (open files, database handles), exactly as a forked torch worker does,
whenever the worker starts (a resize in the middle of the epoch included).

Stage functions reach those workers by inheritance, not by value: the objects given to
:meth:`Snapshot.take` (the stages' functions and ``init``s) are published
(:mod:`multiproc.inherit`) before the fork, and :meth:`Snapshot.dumps` pickles a stage spec
with each of them replaced by a reference that :func:`multiproc.inherit.loads`, in a worker,
resolves to the server's copy. Anything else in the spec (its knobs,
a wrapper made after the snapshot) travels by value.
"""

from __future__ import annotations

import io
import itertools
import threading
from collections.abc import Iterable
from typing import Any

from . import inherit, servers
from .errors import ExecutorClosedError

_lock = threading.Lock()  # one fork at a time publishes
_keys = itertools.count()


class Snapshot:
    """A fork server forked from this process now, holding ``roots`` for its workers.

    Args:
        roots: the objects workers take from the server's memory instead of a pickle
            (typically every stage's ``fn`` and ``init``); None entries are ignored.
        preload: modules the server imports before forking workers (those this process has
            not imported yet, e.g. named by a stage only by its pickle).

    The server runs until :meth:`stop` (its workers gone first: they die with it).
    """

    def __init__(self, roots: Iterable[Any], preload: tuple[str, ...] = ()):
        self.roots = tuple(r for r in roots if r is not None)
        self.preload = preload
        self.key = f"s{next(_keys)}"
        self.stopped = False  # by stop(): its executor closed
        self.server = self._fork()

    def _fork(self) -> servers.ForkServer:
        with _lock:
            inherit.published[self.key] = self.roots
            try:
                return servers.ForkServer.start(self.preload)
            finally:
                # This process needs no entry: the server's copy is the one workers read.
                del inherit.published[self.key]

    @classmethod
    def take(cls, stages: Iterable[Any], preload: tuple[str, ...] = ()) -> Snapshot:
        """A snapshot for executor stage specs ``stages``: their functions and ``init``s."""
        roots: list[Any] = []
        for s in stages:
            roots += [s.fn, s.init]
        return cls(roots, preload)

    def renew(self) -> None:
        """Fork a new server from this process now (the old one ended: killed): workers
        started from now on see the process as it is now, not as at the snapshot.

        Raises:
            ExecutorClosedError: the snapshot was stopped (its executor closed, e.g. by the
                interpreter's exit while a thread was still starting its workers).
        """
        if self.stopped:
            raise ExecutorClosedError("the executor was closed while its workers were starting")
        self.server.stop()
        self.server = self._fork()

    def dumps(self, obj: Any) -> bytes:
        """``obj`` pickled with every root replaced by a reference to the server's copy;
        :func:`multiproc.inherit.loads` in a worker of this snapshot resolves it."""
        out = io.BytesIO()
        inherit.RefPickler(out, self.key, self.roots).dump(obj)
        return out.getvalue()

    def stop(self) -> None:
        """End the server (after its workers, which die with it); none is forked again.
        Idempotent."""
        self.stopped = True
        self.server.stop()


def forks(spec: Any) -> bool:
    """Whether executor spec ``spec``'s process workers fork from a snapshot (else from
    multiprocessing's spawned server: ``start_method="spawn"``, ``MULTIPROC_FORKSERVER=spawn``,
    or a process that must not be forked, :func:`multiproc.servers.fork_unsafe`). Not when
    every stage starts as threads: one moved to processes later spawns them."""
    return (
        not all(s.starts_as_threads for s in spec.stages)
        and spec.start_method == "fork"
        and not servers.spawn_requested()
        and servers.fork_unsafe() is None
    )
