"""A worker's end of its private pipe to the router.

Messages (:mod:`multiproc.protocol`) go out through :meth:`Link.say` and come in through
:meth:`Link.next`: first any message set aside in ``deferred`` (one read while the worker
waited for something else, such as room in its arena, that must wait its turn), else the
pipe's next, once the arena blocks of other workers released here since the last commit are
sent back (:class:`~multiproc.protocol.Frees`). Whoever waits on the pipe for something
particular reads it through :meth:`Link.read` and sets aside what is not for it.
"""

from __future__ import annotations

import collections
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import numpy as np

from . import protocol as P
from . import stats
from .arena import ShmRef
from .poller import pipe_poller

_ns = time.perf_counter_ns


class Link:
    """A worker's end of its pipe to the router (see the module docstring).

    Args:
        conn: the worker's end of the pipe.
        wid: the worker's id, the first field of every message it sends.
        row: the worker's counter row; the time :meth:`next` waits goes to ``BLOCKED_IN_NS``.
    """

    def __init__(self, conn: Connection, wid: int, row: np.ndarray) -> None:
        self.conn = conn
        self.wid = wid
        self.ready = pipe_poller(conn)  # a message waits (Connection.poll costs ~20 us)
        self.deferred: collections.deque[Any] = collections.deque()  # read early, in turn later
        self._row = row
        self._frees: list[tuple[str, int]] = []  # (arena, offset) of blocks released here

    def say(self, msg: NamedTuple) -> None:
        """Send one message."""
        self.conn.send(P.wire(msg))

    def read(self) -> Any:
        """The next message on the pipe, waiting for it."""
        return P.read(self.conn.recv())

    def next(self) -> Any:
        """The next message to handle: the first set aside, else the pipe's next (the blocks
        released so far are sent first, and the wait is counted)."""
        if self.deferred:
            return self.deferred.popleft()
        frees = self.take_frees()
        if frees:
            self.say(P.Frees(self.wid, frees))
        t0 = _ns()
        msg = P.read(self.conn.recv())
        self._row[stats.BLOCKED_IN_NS] += _ns() - t0
        return msg

    def release(self, ref: ShmRef) -> None:
        """Note a block of another worker's arena that nothing here uses any more."""
        # Runs from a finalizer, possibly in the middle of anything: only append.
        self._frees.append((ref.segment, ref.offset))

    def take_frees(self) -> list[tuple[str, int]]:
        """The blocks noted since the last call, to send back with a message."""
        if not self._frees:
            return []
        out, self._frees = self._frees, []
        return out
