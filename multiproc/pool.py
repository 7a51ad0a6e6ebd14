"""Starting and stopping stage workers.

Worker processes come from a fork server: a clean, single-threaded process started once,
which forks a child per worker. Forking the (multi-threaded) training process itself is
unsafe, and spawning a fresh interpreter per worker costs hundreds of milliseconds of
imports; forking a server that has already imported torch and this package costs a few.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from dataclasses import dataclass, field

from . import worker as _worker

_PRELOAD = ["multiproc.worker", "torch", "numpy", "cloudpickle"]
_ctx_lock = threading.Lock()
_ctx = None


def context():
    """The fork-server context shared by all executors of this process."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = mp.get_context("forkserver")
            # Only effective before the server starts; harmless afterwards.
            ctx.set_forkserver_preload(_PRELOAD)
            _ctx = ctx
        return _ctx


@dataclass
class WorkerHandle:
    """The executor's view of one worker."""

    wid: int
    stage: int
    index: int
    slot: int
    seg_name: str
    thread: bool
    conn: object = None
    proc: object = None
    pid: int = 0
    state: str = "starting"  # starting, ready, retiring, gone, dead
    start_ns: int = 0
    ready_ns: int = 0
    inflight: dict = field(default_factory=dict)  # frame id -> Frame, or unit id -> Unit
    held: dict = field(default_factory=dict)  # stateful: frame id -> Frame
    owes: set = field(default_factory=set)  # (segment, offset) handed to it, not yet released
    blocked: bool = False
    flushing: bool = False

    @property
    def sentinel(self):
        return None if self.thread else self.proc.sentinel

    def alive(self) -> bool:
        return self.state in ("starting", "ready", "retiring")


def start_worker(h: WorkerHandle, args: tuple) -> None:
    """Start the worker's process (or thread) with its private pipe."""
    if h.thread:
        parent, child = mp.Pipe(duplex=True)
        t = threading.Thread(
            target=_worker.worker_main, args=(child, *args), kwargs={"is_thread": True},
            name=f"multiproc-worker-{h.wid}", daemon=True,
        )
        h.conn, h.proc = parent, t
        t.start()
        h.pid = os.getpid()
        return
    ctx = context()
    parent, child = ctx.Pipe(duplex=True)
    p = ctx.Process(target=_worker.worker_main, args=(child, *args), daemon=True,
                    name=f"multiproc-worker-{h.wid}")
    p.start()
    child.close()
    h.conn, h.proc, h.pid = parent, p, p.pid


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
