"""The router's messages for workers, batched per event: one write per worker.

While the router handles one event (between :meth:`Mail.collect` and :meth:`Mail.post`),
what it has for each worker is kept and then sent together, in one write
(:mod:`multiproc.outbox`); outside an event (the consumer's thread, under the executor's
lock) a message goes at once.
"""

from __future__ import annotations

from typing import NamedTuple

from . import handles
from . import protocol as P


class Mail:
    """Messages for workers (see the module docstring). Callers hold the executor's lock."""

    def __init__(self) -> None:
        # wid -> (its handle, its wire messages) while an event is handled; None otherwise.
        self._outgoing: dict[int, tuple[handles.WorkerHandle, list[tuple]]] | None = None

    def send(self, h: handles.WorkerHandle, msg: NamedTuple) -> None:
        """Send ``msg`` to worker ``h``: at the end of the event being handled, else now."""
        out = self._outgoing
        if out is None:
            h.post(P.wire(msg))
        elif h.wid in out:
            out[h.wid][1].append(P.wire(msg))
        else:
            out[h.wid] = (h, [P.wire(msg)])

    def collect(self) -> None:
        """Keep what :meth:`send` gets from now on until :meth:`post`."""
        self._outgoing = {}

    def post(self) -> None:
        """Send what was kept for each worker, in one write per worker; stop keeping."""
        out, self._outgoing = self._outgoing, None
        for h, msgs in (out or {}).values():
            h.post(*msgs)
