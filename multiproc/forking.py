"""Forking the fork server out of a process that runs other threads.

The fork server is forked from the executor's process (:mod:`multiproc.handles`), which may run
other threads: the user's, other loaders' routers. Only the forking thread lives on in the
child, and what the others held at the fork comes along held. Two such things matter here:
file descriptors (a pipe the child kept open would never be seen closed by its reader) and
imports in progress (the module's import lock, held forever in the child, would hang the first
import of that module in the server or in any worker it forks).
"""

from __future__ import annotations

import os
import sys
import threading
import time

IMPORT_WAIT_S = 5.0  # how long the server's fork waits for other threads' imports to end


def imports_in_flight() -> list[str]:
    """The modules other threads of this process are importing now (their import locks)."""
    import importlib._bootstrap as bootstrap

    me = threading.get_ident()
    names = []
    for name, ref in list(getattr(bootstrap, "_module_locks", {}).items()):
        lock = ref()
        if lock is not None and getattr(lock, "owner", None) not in (None, me):
            names.append(name)
    return names


def fork_between_imports() -> int:
    """``os.fork()`` once no other thread is importing a module (waiting up to
    :data:`IMPORT_WAIT_S`). A thread importing at the fork does not exist in the child, but
    the module's import lock comes along held and the module half run: the first import of it
    in the server, or in any worker the server forks, would wait for that lock forever."""
    import _imp

    deadline = time.monotonic() + IMPORT_WAIT_S
    while True:
        # No other thread starts an import until the fork is done; the child holds the lock
        # too (CPython keeps it for a fork made while it is held) and lets go of it as well.
        _imp.acquire_lock()
        try:
            if not imports_in_flight() or time.monotonic() > deadline:
                return os.fork()  # past the deadline: the server forgets them instead
        finally:
            _imp.release_lock()
        # Imports end on their own threads, with no event to wait on: look again shortly.
        time.sleep(0.005)


def forget_imports_in_flight() -> None:
    """In the forked server: forget the imports other threads of the parent were still running
    at the fork (its wait for them timed out). Their modules are dropped half run, with their
    held locks, so that the next import of one runs it afresh (it may then fail, with an
    ImportError naming it, where a forever-held lock would hang)."""
    import importlib._bootstrap as bootstrap

    me = threading.get_ident()
    locks = getattr(bootstrap, "_module_locks", {})
    mine = set()
    for name, ref in list(locks.items()):
        lock = ref()
        if lock is not None and getattr(lock, "owner", None) == me:
            mine.add(name)
        elif lock is not None and getattr(lock, "owner", None) is not None:
            locks.pop(name, None)
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if name not in mine and getattr(spec, "_initializing", False):
            sys.modules.pop(name, None)
            locks.pop(name, None)


def close_fds_but(keep: tuple[int, ...]) -> None:
    """Close every file descriptor of this process but ``keep`` (a forked server must not
    hold the parent's pipes and sockets open: their readers would never see them close)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, os.sysconf("SC_OPEN_MAX")))
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
