"""The router's handle of each worker, and starting and stopping workers.

Worker processes come from a fork server, a single-threaded process that forks a child per
worker: spawning a fresh interpreter per worker costs hundreds of milliseconds of imports,
forking a server that has them costs a few.

Each executor's server (:class:`ForkServer`) is forked from this process when a snapshot is
taken (:mod:`multiproc.snapshot`; a loader takes one at ``iter()``), not spawned as a new
interpreter as multiprocessing does: its workers see the process as it was then, share its
pages until either writes them, and inherit its open files. Only the forking thread lives on
in the server; the fork waits for other threads' imports to end, and the server lets go of the
pipes, sockets and segments it inherited (:mod:`multiproc.forking`), runs nothing of this
process but the server loop, and ends when its executor closes (after its workers).
``MULTIPROC_FORKSERVER=spawn`` (read when an executor starts) or ``start_method="spawn"`` keeps
multiprocessing's spawned server instead, shared by the executors of the process: for a process
whose state must not be copied at all (e.g. one that holds a CUDA context it cannot have
forked; torch refuses CUDA in a forked child anyway, as it does in DataLoader workers). A
process that has imported Ray gets the spawned server too (:func:`fork_unsafe`): gRPC's threads
do not survive a fork, and workers forked from such a copy died of SIGSEGV as they started.
"""

from __future__ import annotations

import gc
import importlib
import io
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import (
    connection,
    forkserver,
    popen_forkserver,
    reduction,
    spawn,
    util,
)
from multiprocessing.context import ForkServerProcess, set_spawning_popen
from typing import Any

from . import arena, forking, lifetime
from . import protocol as P
from . import worker as _worker
from .frames import WorkerState
from .outbox import Outbox
from .policy import WorkerKind
from .poller import pipe_poller

# numpy.random: every worker seeds numpy's global generator per batch; imported in the server,
# its pages are shared (imported in each worker, ~1 MiB of each one's own).
_PRELOAD = ["multiproc.worker", "torch", "numpy", "numpy.random", "cloudpickle"]
_ctx_lock = threading.Lock()
_ctx = None


def context(preload: tuple[str, ...] = ()):
    """The fork-server context shared by all executors of this process.

    Args:
        preload: more modules the server imports before forking workers (e.g. the modules
            that define the stage functions, such as ``torchrec``), so that no new worker pays
            for importing them. Only the first call before the server starts has an effect.
    """
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = mp.get_context("forkserver")
            modules = list(dict.fromkeys(_PRELOAD + [m for m in preload if m != "__main__"]))
            ctx.set_forkserver_preload(modules)
            _ctx = ctx
        return _ctx


def warm(preload: tuple[str, ...] = ()) -> None:
    """Start the fork server now, with ``preload`` (see :func:`context`), so the first workers
    start without waiting for it. Does nothing once the server runs."""
    ensure_server(preload)


SPAWN_ENV = "MULTIPROC_FORKSERVER"


def spawn_requested() -> bool:
    """Whether workers start from multiprocessing's spawned server (``MULTIPROC_FORKSERVER=spawn``
    in the environment) instead of a snapshot of this process."""
    return os.environ.get(SPAWN_ENV, "").lower() == "spawn"


def fork_unsafe() -> str | None:
    """Why this process must not be copied into a fork server, or None: it has loaded gRPC
    (Ray's transport), whose threads and locks a forked copy is left without mid-call, connected
    or not (they outlive ``ray.shutdown()``)."""
    for module in ("ray", "grpc"):
        if module in sys.modules:
            return f"this process has imported {module}"
    if hasattr(forkserver._forkserver, "_forkserver_authkey"):
        # Python 3.14's server authenticates every launch, which ForkServer's does not do.
        return "this Python's fork server authenticates its clients"
    return None


def ensure_server(preload: tuple[str, ...] = ()) -> None:
    """Make sure multiprocessing's spawned fork server runs (the server of executors that do
    not fork theirs from this process: spawn requested, or :func:`fork_unsafe`)."""
    context(preload)
    forkserver.ensure_running()


@dataclass(eq=False)
class ForkServer:
    """A fork server forked from this process (module docstring): its pid, the address
    workers are launched through, and the write end of its "alive" pipe (every client holds
    one; the server ends when all are closed)."""

    pid: int
    address: str
    alive_w: int
    owner: int
    _stopped: bool = False

    @classmethod
    def start(cls, preload: tuple[str, ...] = ()) -> ForkServer:
        """Fork a server from this process now; it imports ``preload`` modules this process
        has not imported."""
        modules = [m for m in dict.fromkeys(_PRELOAD + list(preload)) if m != "__main__"]
        for m in modules:
            if m not in sys.modules:
                # Once, here, not in every server (one per snapshot): each then inherits it.
                try:
                    importlib.import_module(m)
                except Exception:  # the server tries again, and its workers report it
                    pass
        modules = [m for m in modules if m not in sys.modules]
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            owner = os.getpid()
            try:
                pid, pending = forking.fork_between_imports()
                if pid == 0:  # the server
                    _serve(listener.fileno(), alive_r, modules, owner, pending)
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        _servers[pid] = owner
        lifetime.swept_by(pid)
        return cls(pid, address, alive_w, owner)

    def ended(self) -> bool:
        """Whether the server has ended (reaped here if so). Owner only."""
        if self._stopped:
            return True
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid = self.pid  # reaped elsewhere
        if not pid:
            return False
        self._forget()
        return True

    def stop(self) -> None:
        """End the server now and reap it; its workers (children that die with it) must be
        stopped first. Idempotent; does nothing in a process forked from the owner."""
        if self._stopped or not lifetime.is_owner(self.owner):
            return
        try:
            os.kill(self.pid, signal.SIGKILL)  # it ignores SIGTERM; the owner lives: no sweep
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self._forget()

    def _forget(self) -> None:
        self._stopped = True
        try:
            os.close(self.alive_w)
        except OSError:
            pass
        _servers.pop(self.pid, None)
        lifetime.not_swept_by(self.pid, arena.segment_names)

    def wait_ended(self, wait_s: float = 2.0) -> bool:
        """Whether the server has ended, waiting up to ``wait_s`` for a killed one to be
        reaped: launching a worker through a server that was just killed can fail (EOF,
        refused) while ``waitpid`` still sees it running."""
        deadline = time.monotonic() + wait_s
        while not self.ended():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


_servers: dict[int, int] = {}  # pid of each server this process forked -> its owner


def _serve(
    listener_fd: int, alive_r: int, modules: list[str], owner: int, imports_pending: bool
) -> None:
    """The forked server's life: keep what a forked worker would inherit, let go of what
    would keep other processes' pipes open, serve launches until no client is left."""
    try:
        # Outlives a SIGTERM sent to the whole group, as the resource tracker does, to sweep
        # the owner's segments when it is gone (multiproc.lifetime).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        forking.detach_fds_but((0, 1, 2, listener_fd, alive_r))
        if imports_pending:
            forking.forget_imports_in_flight()
        _servers.clear()  # the owner's servers are not this process's children
        # What this process held stays as it is: no collection of the server or of a worker
        # frees it.
        gc.freeze()
        # Free heap pages it drops are not kept as old copies when the owner writes them again.
        _worker._trim_heap()
        forkserver.main(listener_fd, alive_r, modules)
    except Exception:  # its clients see only EOF: say why here
        print("multiproc: the fork server failed", file=sys.stderr)
        traceback.print_exc()
    finally:
        try:
            _sweep_if_gone(owner)
        finally:
            os._exit(0)


def _sweep_if_gone(owner: int) -> None:
    """In the fork server, as it ends: unlink the segments of ``owner`` if it is gone, as the
    resource tracker would have (:mod:`multiproc.lifetime`)."""
    if not lifetime.owner_gone(owner):
        return
    for name in arena.segment_names(lifetime.segment_prefix(owner)):
        try:
            arena.unlink_segment(name)
        except OSError:
            pass


class _NoMainPopen(popen_forkserver.Popen):
    """Fork-server launch without re-importing the parent's ``__main__`` in the child.

    multiprocessing makes every child import the parent's main script again, so a worker
    costs whatever the script imports (seconds for a Lightning script) and a script without
    an ``if __name__ == "__main__":`` guard runs again in every worker. Stage functions are
    inherited from a snapshot (:mod:`multiproc.snapshot`) or travel by value (cloudpickle),
    so workers never need ``__main__``.
    """

    def _launch(self, process_obj):  # mirrors popen_forkserver.Popen._launch (3.10-3.13)
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_name", None)
        prep_data.pop("init_main_from_path", None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        server = getattr(process_obj, "_server", None)
        if server is None:
            self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        else:
            self.sentinel, w = _connect(server, self._fds)
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


def _connect(server: ForkServer, fds: list[int]) -> tuple[int, int]:
    """multiprocessing's ``connect_to_new_process`` for a server this process forked, whose
    worker gets no resource tracker: the server removes what the tracker would (this
    process's segments, :func:`multiproc.lifetime.track`), and a tracker is one more process.
    The worker's tracker descriptor writes to ``/dev/null``: what a stage function registers
    there itself (a ``SharedMemory`` it creates) is its own to unlink."""
    if len(fds) + 4 >= forkserver.MAXFDS_TO_SEND:
        raise ValueError("too many fds")
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(server.address)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            reduction.sendfds(client, [child_r, child_w, server.alive_w, null, *fds])
            return parent_r, parent_w
        except BaseException:
            os.close(parent_r)
            os.close(parent_w)
            raise
        finally:
            os.close(child_r)
            os.close(child_w)
            os.close(null)


class _WorkerProcess(ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _NoMainPopen(process_obj)


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
    p = _WorkerProcess(
        target=_worker.worker_main,
        args=(child, *args),
        kwargs={"owner_pid": os.getpid()},
        daemon=True,
        name=f"multiproc-worker-{h.wid}",
    )
    p._server = server
    try:
        p.start()
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
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
    cache: object
    prefix: str = ""  # every segment of the executor is named so (removed at the end)
    stop: threading.Event = field(default_factory=threading.Event)
    counters: object = None
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
    snapshot: object = None  # the executor's fork server (multiproc.snapshot), ended last

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
