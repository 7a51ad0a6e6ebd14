"""The router's messages to one worker: written straight into the worker's pipe.

The router must never block on a worker: a worker busy sending to the router (its pipe
full) would wait on the router while the router waits on it. A thread per worker that sends
what the router queues avoids that, but costs a thread wake-up and a hand-off of the GIL per
message (two or three per batch a worker makes). :class:`Outbox` writes a message into the
pipe at once, without waiting (``MSG_DONTWAIT``), when nothing is queued before it and the
pipe has room, which is nearly always; only what does not fit is queued, for a sender thread
started the first time one is needed, and every later message queues behind it until the
queue is empty again, so messages arrive in the order they were posted. The bytes are
``multiprocessing.connection.Connection``'s (a 4-byte length, then the pickle): the worker
reads them with ``Connection.recv``.
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import threading
from multiprocessing import reduction

_MAX = 0x7FFFFFFF  # the longest message Connection's 4-byte header holds


class Outbox:
    """Messages to one worker through ``conn`` (a duplex ``multiprocessing`` pipe, i.e. a Unix
    socket pair), in order, never blocking the caller (see the module docstring)."""

    def __init__(self, conn, name: str) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._sock.setblocking(True)  # one file description with ``conn``: keep it blocking
        self._name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._backlog = 0  # messages queued and not yet written
        self._closed = False

    def post(self, *msgs) -> None:
        """Send ``msgs``, in order (several at once: one write, one wake-up of the worker)."""
        parts: list[bytes | memoryview] = []
        for msg in msgs:
            data = reduction.ForkingPickler.dumps(msg)
            n = len(data)
            # Connection's header: the length, or -1 and an 8-byte length past 2 GiB.
            head = struct.pack("!i", n) if n <= _MAX else struct.pack("!iQ", -1, n)
            parts += (head, data)
        buf: bytes | memoryview = b"".join(parts)
        with self._lock:
            if self._closed:
                return
            if not self._backlog:
                try:
                    n = self._sock.send(buf, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    n = 0
                except OSError:
                    return  # the worker is gone: its sentinel or EOF tells the router
                if n == len(buf):
                    return
                buf = memoryview(buf)[n:]
            self._backlog += 1
            if self._thread is None:
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._send_loop, name=self._name, daemon=True
                )
                self._thread.start()
            assert self._queue is not None
            self._queue.put(buf)

    def _send_loop(self) -> None:
        assert self._queue is not None
        while True:
            buf = self._queue.get()
            if buf is None:
                return
            try:
                self._sock.sendall(buf)
            except OSError:
                return  # the worker is gone: its sentinel or EOF tells the router
            with self._lock:
                self._backlog -= 1

    def close(self, timeout_s: float = 1.0) -> None:
        """Post nothing more; wait up to ``timeout_s`` for what is queued to be written (or the
        pipe to break), then close this side's copy of the descriptor."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            t = self._thread
            if t is not None:
                assert self._queue is not None
                self._queue.put(None)
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)
        self._sock.close()

    @property
    def thread(self) -> threading.Thread | None:
        """The sender thread, once a message had to wait for room."""
        return self._thread
