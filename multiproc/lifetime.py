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
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker

_PR_SET_PDEATHSIG = 1
_RTYPE = "shared_memory"  # the tracker unlinks these with shm_unlink, i.e. /dev/shm/<name>


def is_owner(pid: int) -> bool:
    """Whether this process is ``pid`` (False in a child forked from it)."""
    return os.getpid() == pid


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """SIGINT held back (in this thread) until the block ends: a segment created and tracked
    (:func:`track`) in it is both or neither, whenever Ctrl-C lands."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# The fork server this process forked, which sweeps its segments when it ends (the pid of
# this process recorded with it: a child forked from this one has no such server).
_sweeper: tuple[int, int] | None = None
_with_tracker: set[str] = set()  # segments registered with the resource tracker


def swept_by(server_pid: int) -> None:
    """Fork server ``server_pid``, forked by this process, sweeps its segments from now on."""
    global _sweeper
    _sweeper = (os.getpid(), server_pid)


def sweeper() -> int | None:
    """The pid of the fork server that sweeps this process's segments, or None."""
    return _sweeper[1] if _sweeper is not None and _sweeper[0] == os.getpid() else None


def segment_prefix(pid: int) -> str:
    """How the names of process ``pid``'s segments start (executors name them so)."""
    return f"ttp_{pid}_"


def track(name: str) -> None:
    """Have segment ``name`` unlinked if this process dies holding it: by the fork server it
    forked (a segment named with :func:`segment_prefix`), else by the resource tracker."""
    if sweeper() is not None and name.startswith(segment_prefix(os.getpid())):
        return
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
