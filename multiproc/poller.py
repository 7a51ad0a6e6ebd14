"""Readiness of the router's pipes and sentinels, without a selector per wait.

``multiprocessing.connection.wait`` and ``Connection.poll`` build a selector, register every
descriptor, wait once and close it: ~20-40 us of Python per call. The router waits once per
event and polls each worker's pipe once per message it reads (hundreds of times a second each),
so it keeps one ``select.poll`` across waits (:class:`Poller`) and one per pipe
(:func:`pipe_poller`). A ``poll`` object is only a list of descriptors handed to the kernel at
each call: a closed descriptor whose number is used again needs nothing done.
"""

from __future__ import annotations

import math
import select
from collections.abc import Callable, Iterable

_ANY = select.POLLIN | select.POLLPRI


class Poller:
    """Waits until one of the given objects (descriptors, or objects with ``fileno()``) is
    ready to read, or has hung up, as ``multiprocessing.connection.wait`` does."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._of: dict[int, object] = {}

    def wait(self, objects: Iterable, timeout_s: float | None) -> list:
        of = {(o if isinstance(o, int) else o.fileno()): o for o in objects}
        if of.keys() != self._of.keys():
            for fd in self._of.keys() - of.keys():
                self._poll.unregister(fd)
            for fd in of.keys() - self._of.keys():
                self._poll.register(fd, _ANY)
        self._of = of
        ms = None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))
        return [of[fd] for fd, _ in self._poll.poll(ms)]


def pipe_poller(conn) -> Callable[[], bool]:
    """A check that ``conn`` has something to read (or hung up), without waiting."""
    p = select.poll()
    p.register(conn.fileno(), _ANY)
    return lambda: bool(p.poll(0))
