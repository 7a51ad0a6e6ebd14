"""What ties an executor's processes and shared memory to the process that owns it.

Three ways the owner stops without running ``close()``, and what covers each:

- **It forks** (torch DataLoader workers of another loader, a user's ``multiprocessing``
  fork). The child inherits the executor's objects but none of its threads, and possibly a
  lock some thread held at the fork. Every finalizer and ``close()`` checks
  :func:`is_owner` first and does nothing in another process: the child must not stop the
  owner's workers, unlink its segments or wait on its locks.
- **It is killed** (SIGTERM from a scheduler, SIGKILL, the OOM killer). Workers die with it:
  :func:`die_with_owner` (run in every worker) sets ``PR_SET_PDEATHSIG`` towards the fork
  server, which exits as soon as the owner does, and watches the owner itself through a
  pidfd. Segments (:func:`track`) are removed by the fork server the owner forked
  (:mod:`multiproc.handles`): it ignores SIGINT/SIGTERM, and when the owner is gone it
  unlinks every segment named after the owner's pid (:func:`owner_gone`) before it
  exits. Where no such server runs (not started yet, or spawned as a new interpreter), a
  segment is registered with multiprocessing's resource tracker instead, a process that
  does the same for what is registered with it.
- **It drops the executor** without closing it: the router thread holds the executor weakly,
  so an unreferenced executor is collected and its finalizer stops everything.

What is left after all of these failed (the fork server was killed too) is removed by the next
executor's sweep of stale segments (:func:`multiproc.arena.sweep_stale_segments`), but only
what is provably dead. A pid says nothing about a process of another PID namespace sharing
the directory (``docker run --ipc=host``, a Kubernetes memory volume at ``/dev/shm``), so
each executor holds a lock on a file of its own, ``ttp_<tag>_alive`` (:class:`Alive`),
created before its other segments and removed after them: its segments are dead when that
lock is free (:func:`owner_dead`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker

from . import shm

_PR_SET_PDEATHSIG = 1
_RTYPE = "shared_memory"  # the tracker unlinks these with shm_unlink, i.e. /dev/shm/<name>


def is_owner(pid: int, _getpid: Callable[[], int] = os.getpid) -> bool:
    """Whether this process is ``pid`` (False in a child forked from it). Callable while the
    interpreter shuts down (a run iterator collected then, in a forked child that exits):
    it needs no module global, which may be None by then."""
    return _getpid() == pid


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """SIGINT held back (in this thread) until the block ends: a segment created and tracked
    (:func:`track`) in it is both or neither, whenever Ctrl-C lands."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# The fork servers this process forked, which sweep its segments when they end (the pid of
# this process recorded with them: a child forked from this one has no such server).
_sweepers: tuple[int, set[int]] = (0, set())
_with_tracker: set[str] = set()  # segments registered with the resource tracker


def swept_by(server_pid: int) -> None:
    """Fork server ``server_pid``, forked by this process, sweeps its segments from now on."""
    global _sweepers
    if _sweepers[0] != os.getpid():
        _sweepers = (os.getpid(), set())
    _sweepers[1].add(server_pid)


def not_swept_by(server_pid: int, live: Callable[[str], list[str]]) -> None:
    """Fork server ``server_pid`` has ended. When no server is left to sweep, the segments of
    this process that relied on one (``live(prefix)`` lists them) are registered with the
    resource tracker instead."""
    if _sweepers[0] != os.getpid() or server_pid not in _sweepers[1]:
        return
    _sweepers[1].discard(server_pid)
    if _sweepers[1]:
        return
    for name in live(segment_prefix(os.getpid())):
        if name not in _with_tracker:
            resource_tracker.register("/" + name, _RTYPE)
            _with_tracker.add(name)


def sweeper() -> int | None:
    """The pid of a fork server that sweeps this process's segments, or None."""
    if _sweepers[0] != os.getpid() or not _sweepers[1]:
        return None
    return next(iter(_sweepers[1]))


def segment_prefix(pid: int) -> str:
    """How the names of process ``pid``'s segments start (executors name them so)."""
    return f"ttp_{pid}_"


def track(name: str) -> None:
    """Have segment ``name`` unlinked if this process dies holding it: by the fork server it
    forked (a segment named with :func:`segment_prefix`), else by the resource tracker."""
    if sweeper() is not None and name.startswith(segment_prefix(os.getpid())):
        return
    if shm.directory() != shm.DEFAULT_DIR:
        return  # the tracker unlinks in /dev/shm only: the sweeps cover another directory
    resource_tracker.register("/" + name, _RTYPE)
    _with_tracker.add(name)


def untrack(name: str) -> None:
    """The segment was unlinked here; whatever would unlink it forgets it (call once per
    :func:`track`)."""
    if name in _with_tracker:
        _with_tracker.discard(name)
        resource_tracker.unregister("/" + name, _RTYPE)


def owner_gone(owner: int, wait_s: float = 5.0) -> bool:
    """In the fork server, as it ends: whether its owner is gone (then the server unlinks the
    owner's segments, :mod:`multiproc.handles`).

    The server ends when no process holds its "alive" pipe, i.e. once the owner has closed
    its files on the way out; the owner is gone once this process is reparented, moments
    later. A server that ends while its owner lives (an error) leaves the segments alone.
    """
    deadline = time.monotonic() + wait_s
    while os.getppid() == owner:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)  # reparenting comes with the owner's exit: no event to wait on here
    return True


def die_with_owner(owner_pid: int) -> None:
    """In a worker process: end this process when ``owner_pid`` (the executor's) ends.

    Two mechanisms, because a worker's parent is the fork server, not the owner: the kernel
    kills it when the fork server exits (which the fork server does as soon as the owner
    does), and a daemon thread blocked on a pidfd of the owner exits it directly (this also
    covers a fork server kept alive by some other child of the owner). Both are events, no
    polling; either may be missing on a platform, the other still works.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return
    try:
        fd = pidfd_open(owner_pid)
    except ProcessLookupError:
        os._exit(1)  # the owner is already gone: nobody will read what this worker makes
    except OSError:
        return  # kernel without pidfds: the parent-death signal still applies
    threading.Thread(
        target=_exit_when_readable, args=(fd,), name="multiproc-owner", daemon=True
    ).start()


def _exit_when_readable(fd: int) -> None:
    # A pidfd becomes readable when its process exits.
    select.select([fd], [], [])
    os._exit(1)


# Alive locks this process holds: a child forked from it closes its copies of their
# descriptors (os.register_at_fork), so that the lock ends with the owner, not with whichever
# fork of it (a torch DataLoader worker, a fork server started later) lives longest.
_alive: weakref.WeakSet[Alive] = weakref.WeakSet()
_fork_hook = False


class Alive:
    """The lock that says an executor is alive: file ``path``, created empty, locked
    (``flock``) for as long as the owner holds it open, then sized one byte (sparse: no page
    of a full directory needed). A sweeper sees the lock free only once the owner closed it or
    died (the kernel releases it with the last descriptor). An empty file is one whose owner
    is between creating and locking it.

    Raises:
        OSError: the file cannot be created (the caller names the directory's state).
    """

    def __init__(self, path: str):
        global _fork_hook
        self.path = path
        self.pid = os.getpid()
        self.fd = -1
        with uninterrupted():  # created and tracked, or neither (Ctrl-C)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            track(os.path.basename(path))
        try:
            # Blocking: a sweeper that opened the file a moment ago holds the lock only until
            # it has seen the file empty.
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 1)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            untrack(os.path.basename(path))
            raise
        self.fd = fd
        if not _fork_hook:
            _fork_hook = True
            os.register_at_fork(after_in_child=_forget_alive)
        _alive.add(self)

    def close(self) -> None:
        """Release the lock (after the owner removed its segments and this file)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            _alive.discard(self)
            os.close(fd)


def _forget_alive() -> None:
    for a in list(_alive):
        fd, a.fd = a.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    _alive.clear()


def owner_dead(path: str) -> bool | None:
    """Whether the owner of alive file ``path`` (:class:`Alive`) is gone: True when its lock is
    free and the file complete, False while it is held (or the file is being created, or not
    ours to open), None when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return os.fstat(fd).st_size > 0
    finally:
        os.close(fd)  # releases the lock taken here


ALIVE_SUFFIX = "_alive"  # ttp_<tag>_alive: the lock of the executor tagged <tag>


def alive_name(tag: str) -> str:
    """The name of the alive file of the executor tagged ``tag`` (``<pid>_<n>_<hex>``)."""
    return f"ttp_{tag}{ALIVE_SUFFIX}"


def _alive_path(name: str) -> str | None:
    """The alive file of the executor that made segment ``name`` (``ttp_<tag>_...``), or
    None for a name of another form."""
    parts = name.split("_", 4)
    if len(parts) < 5 or parts[0] != "ttp" or not parts[1].isdigit():
        return None
    return os.path.join(shm.directory(), alive_name("_".join(parts[1:4])))


def _pid_gone(name: str) -> bool:
    """Whether no process here has the pid segment ``name`` is named after."""
    parts = name.split("_")
    if len(parts) < 3 or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def stale(names: list[str]) -> list[str]:
    """Those of segment ``names`` that are provably dead: their executor's alive lock is free
    (:func:`owner_dead`), or, for a segment without an alive file (named otherwise), no
    process here has its pid. A pid alone proves nothing where the directory is shared with
    another PID namespace, where that pid is a live process; an alive file is made before its
    executor's other segments, so a segment of a live executor always has one. Segments named
    after this process are never stale."""
    own = segment_prefix(os.getpid())
    dead: dict[str, bool | None] = {}
    out = []
    for name in names:
        if name.startswith(own):
            continue
        path = _alive_path(name)
        if path is not None and path not in dead:
            dead[path] = owner_dead(path)
        gone = dead.get(path) if path is not None else None
        if gone is None:
            gone = _pid_gone(name)
        if gone:
            out.append(name)
    return out


def not_held_elsewhere(names: list[str]) -> list[str]:
    """``names`` less the segments of executors alive in other processes
    (:func:`held_elsewhere`)."""
    held: dict[str, bool] = {}
    out = []
    for name in names:
        path = _alive_path(name)
        if path is not None and path not in held:
            held[path] = held_elsewhere(path)
        if path is None or not held[path]:
            out.append(name)
    return out


def held_elsewhere(path: str) -> bool:
    """Whether alive file ``path`` is locked by another process (an executor alive there,
    though its pid may be this one's or absent here: another PID namespace)."""
    if any(a.path == path and a.fd >= 0 for a in list(_alive)):
        return False  # this process's own
    return owner_dead(path) is False
