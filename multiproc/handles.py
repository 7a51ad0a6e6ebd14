"""The router's handle of each worker, starting and stopping workers (processes through a
fork server, :mod:`multiproc.servers`, or threads of this process), and what an executor gives
back when it ends (:class:`Resources`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import arena, lifetime, stats
from . import protocol as P
from . import worker as _worker
from .frames import Unit, WorkerState
from .items import short_repr
from .outbox import Outbox
from .policy import WorkerKind
from .poller import pipe_poller
from .servers import ForkServer, WorkerProcess, context, ensure_server


def _never() -> bool:
    return False


@dataclass
class WorkerHandle:
    """The executor's view of one worker."""

    wid: int
    stage: int
    index: int
    slot: int
    seg_name: str
    thread: bool  # a thread of this process (local or offload), else a process
    remote: bool = False  # an offload worker (multiproc.offload)
    conn: Any = None  # the router's end of its pipe (a multiprocessing Connection), once started
    proc: Any = None  # its process (a multiprocessing process), or its thread
    pid: int = 0
    state: WorkerState = WorkerState.STARTING
    start_ns: int = 0
    ready_ns: int = 0
    inflight: dict = field(default_factory=dict)  # frame id -> Frame, or unit id -> Unit
    ahead: int = 1  # a source worker: units it reads at once (protocol.UnitDone)
    held: dict = field(default_factory=dict)  # stateful: frame id -> Frame
    owes: set = field(default_factory=set)  # (segment, offset) handed to it, not yet released
    blocked: bool = False
    flushing: bool = False
    outbox: Outbox | None = None
    readable: Callable[[], bool] = _never  # whether ``conn`` has a message (or hung up)

    def post(self, *msgs) -> None:
        """Send messages to the worker, in order. Never blocks: a worker busy sending to the
        router (its pipe full) must not stall the router, or both would wait on each other."""
        assert self.outbox is not None, "posted to a worker not started"
        self.outbox.post(*msgs)

    def close_outbox(self, timeout_s: float = 1.0) -> None:
        """Post nothing more, after what is queued has been sent (or the pipe broke)."""
        if self.outbox is not None:
            self.outbox.close(timeout_s)

    @property
    def kind(self) -> WorkerKind:
        """``"process"``, ``"thread"`` (a local thread) or ``"remote"`` (an offload worker):
        :data:`multiproc.policy.WORKER_KINDS`."""
        return "remote" if self.remote else "thread" if self.thread else "process"

    @property
    def sentinel(self):
        return None if self.thread else self.proc.sentinel

    def alive(self) -> bool:
        return self.state in (WorkerState.STARTING, WorkerState.READY, WorkerState.RETIRING)


def _open_outbox(h: WorkerHandle) -> None:
    h.readable = pipe_poller(h.conn)
    h.outbox = Outbox(h.conn, f"multiproc-send-{h.wid}")


_forgets = False


def _forget_workers_in_forks() -> None:
    """Make every child later forked from this process (``os.fork`` in the caller's code, a
    fork server) forget the worker processes this process started: multiprocessing's exit
    handler in that child would otherwise SIGTERM them as its own daemon children, then fail
    to join them ("can only join a child process")."""
    global _forgets
    if not _forgets:
        _forgets = True
        os.register_at_fork(after_in_child=_forget_workers)


def _forget_workers() -> None:
    from multiprocessing import process

    for p in list(process._children):  # type: ignore[attr-defined]
        if isinstance(p, WorkerProcess):
            process._children.discard(p)  # type: ignore[attr-defined]


def start_worker(
    h: WorkerHandle, args: tuple, server: ForkServer | None, preload: tuple[str, ...] = ()
) -> None:
    """Start the worker's process (or thread) with its private pipe and outbox: forked by
    ``server``, or by multiprocessing's spawned server when None."""
    if h.thread:
        parent, child = mp.Pipe(duplex=True)
        t = threading.Thread(
            target=_worker.worker_main,
            args=(child, *args),
            kwargs={"is_thread": True},
            name=f"multiproc-worker-{h.wid}",
            daemon=True,
        )
        h.conn, h.proc = parent, t
        _open_outbox(h)
        t.start()
        h.pid = os.getpid()
        return
    ctx = context(preload)
    if server is None:
        ensure_server(preload)
    parent, child = ctx.Pipe(duplex=True)
    p = WorkerProcess(
        target=_worker.worker_main,
        args=(child, *args),
        kwargs={"owner_pid": os.getpid()},
        daemon=True,
        name=f"multiproc-worker-{h.wid}",
    )
    p._server = server
    _forget_workers_in_forks()
    try:
        p.start()
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    assert p.pid is not None  # started
    h.conn, h.proc, h.pid = parent, p, p.pid
    _open_outbox(h)


def describe_exit(h: WorkerHandle) -> str:
    """Why a worker ended, in words (signal name for kills)."""
    if h.thread:
        return "thread ended"
    code = h.proc.exitcode
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (SIGKILL: often the kernel's OOM killer)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with status {code}"


def describe_work(h: WorkerHandle, work_id: int, item: int) -> str:
    """The unit or frame ``work_id`` (its counters' ``WORK_ID``) of worker ``h``, and where in
    it (``WORK_ITEM``), in words."""
    if not work_id:
        return "its current work"
    held = h.inflight.get(work_id - 1)
    if isinstance(held, Unit):
        at = f", at or after its item {item - 1}" if item > 1 else ""
        return f"work unit {short_repr(held.unit)}{at}"
    at = f"item {item - 1} of " if item else ""
    return f"{at}frame {work_id - 1}"


def work_in_hand(h: WorkerHandle, row: Any) -> str | None:
    """What worker ``h`` is inside its stage function on, in words, from its counters' ``row``;
    for a worker that died before they were folded, what it died on (None: it was between
    calls)."""
    since, work_id, item = (int(v) for v in row[stats.IN_FN_SINCE_NS : stats.WORK_ITEM + 1])
    return describe_work(h, work_id, item) if since else None


def stop_worker(h: WorkerHandle, timeout_s: float) -> None:
    """Wait for the worker to end, then terminate and kill it if it does not."""
    p = h.proc
    if p is None:
        return
    p.join(timeout_s)
    if h.thread:
        return
    if p.is_alive():
        p.terminate()
        p.join(0.5)
    if p.is_alive():
        p.kill()
        p.join(1.0)


@dataclass
class Resources:
    """What an executor must give back, reachable without the executor itself (its finalizer
    runs when the executor is unreferenced, and must not hold it alive).

    ``pid`` is the owner: in a forked child :meth:`release` does nothing (the owner's workers,
    segments and locks are not the child's to touch).
    """

    pid: int
    workers: dict
    segments: set
    cache: arena.MappingCache
    prefix: str = ""  # every segment of the executor is named so (removed at the end)
    stop: threading.Event = field(default_factory=threading.Event)
    counters: Any = None  # the stats table (stats.CounterTable), closed and unlinked last
    wake_r: int = -1
    wake_w: int = -1
    # Guards the write end: a finalizer may wake a closed executor from any thread, and a
    # write to a closed descriptor number could land in whatever file reused it.
    wake_lock: threading.Lock = field(default_factory=threading.Lock)
    router: threading.Thread | None = None
    # Set by the router after each event: a worker has work in flight, so a message (or its
    # death) wakes the router soon, and a released frame waits for that wake instead of making
    # one of its own (see Executor._sink_release).
    reporting: bool = False
    snapshot: Any = None  # the executor's fork server (multiproc.snapshot.Snapshot), ended last

    def wake(self) -> None:
        """Wake the router (a no-op once released)."""
        with self.wake_lock:
            if self.wake_w < 0:
                return
            try:
                os.write(self.wake_w, b"x")
            except (BlockingIOError, OSError):
                pass  # pipe full: already woken

    def release(self, timeout_s: float = 1.5) -> None:
        """Stop the router and every worker; remove every segment. Idempotent; owner only."""
        if not lifetime.is_owner(self.pid):
            return
        self.stop.set()
        self.wake()
        r = self.router
        if r is not None and r.is_alive() and r is not threading.current_thread():
            r.join(timeout_s + 2.0)
        for h in list(self.workers.values()):
            if h.outbox is None:
                continue  # interrupted before its start: nothing to tell
            if h.alive():
                h.post(P.wire(P.Exit()))
        deadline = time.monotonic() + timeout_s
        try:
            for h in list(self.workers.values()):
                stop_worker(h, max(0.0, deadline - time.monotonic()))
                h.close_outbox(max(0.0, deadline - time.monotonic()))
                if h.conn is not None:
                    try:
                        h.conn.close()
                    except OSError:
                        pass
        except BaseException:
            # Interrupted while waiting (Ctrl-C): kill the workers left, then go on below.
            for h in self.workers.values():
                if not h.thread and h.proc is not None and h.proc.is_alive():
                    h.proc.kill()
            raise
        finally:
            self._remove_shared()
            if self.snapshot is not None:
                self.snapshot.stop()  # after its workers: they die with it

    def _remove_shared(self) -> None:
        for name in list(self.segments):
            arena.remove_segment(name)
        self.segments.clear()
        self.cache.clear()
        if self.counters is not None:
            self.counters.close(unlink=True)
            self.counters = None
        if self.prefix:  # what an interrupted start created but did not record
            arena.remove_segments(self.prefix)
        with self.wake_lock:
            for fd in (self.wake_r, self.wake_w):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self.wake_r = self.wake_w = -1
