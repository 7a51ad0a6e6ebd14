"""Fork servers: where worker processes come from.

A fork server is a single-threaded process that forks a child per worker: spawning a fresh
interpreter per worker costs hundreds of milliseconds of imports, forking a server that has
them costs a few.

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
from dataclasses import dataclass
from multiprocessing import (
    connection,
    forkserver,
    popen_forkserver,
    reduction,
    spawn,
    util,
)
from multiprocessing.context import ForkServerProcess, set_spawning_popen

from . import arena, forking, lifetime
from . import worker as _worker

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
            address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
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
            self.sentinel, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        else:
            self.sentinel, w = _connect(server, self._fds)  # type: ignore[attr-defined]
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))  # type: ignore[attr-defined]
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


class WorkerProcess(ForkServerProcess):
    """A worker process launched through a :class:`ForkServer` (``_server``; None:
    multiprocessing's spawned server)."""

    _server: ForkServer | None = None

    @staticmethod
    def _Popen(process_obj):
        return _NoMainPopen(process_obj)
