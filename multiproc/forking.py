"""Forking the fork server out of a process that runs other threads.

The fork server is forked from the executor's process (:mod:`multiproc.handles`), which may run
other threads: the user's, other loaders' routers. Only the forking thread lives on in the
child, and what the others held at the fork comes along held. Three such things matter here:
file descriptors (a pipe the child kept open would never be seen closed by its reader), imports
in progress (the module's import lock, held forever in the child, would hang the first import
of that module in the server or in any worker it forks), and GNU OpenMP's thread pool (below).

GNU libgomp (torch's OpenMP on Linux) keeps, per thread that has run a parallel region, a pool
of threads it reuses for the next one, and registers nothing to run at a fork: a child of that
thread believes it has the pool, and its first parallel region waits forever for threads that
do not exist there. Every training process has run torch kernels on its main thread, and a
worker with ``torch_threads`` > 1 runs its kernels on a team. So before each fork the forking
thread's pool is let go (``omp_pause_resource_all``, OpenMP 5.0: its threads end; its next
parallel region starts new ones, ~0.2 ms): the child starts with none. Other threads' pools
do not come along (only the forking thread does); LLVM's and Intel's OpenMP runtimes, which
reset themselves in a forked child, are left alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import stat
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


def fork_between_imports() -> tuple[int, bool]:
    """``os.fork()`` once no other thread is importing a module (waiting up to
    :data:`IMPORT_WAIT_S`). A thread importing at the fork does not exist in the child, but
    the module's import lock comes along held and the module half run: the first import of it
    in the server, or in any worker the server forks, would wait for that lock forever.

    Returns ``os.fork()``'s pid, and whether imports were still in flight at the fork (the
    wait timed out: the child must :func:`forget_imports_in_flight`)."""
    import _imp

    deadline = time.monotonic() + IMPORT_WAIT_S
    while True:
        # No other thread starts an import until the fork is done; the child holds the lock
        # too (CPython keeps it for a fork made while it is held) and lets go of it as well.
        _imp.acquire_lock()
        try:
            pending = bool(imports_in_flight())
            if not pending or time.monotonic() > deadline:
                return _fork(), pending  # past the deadline: the child forgets them
        finally:
            _imp.release_lock()
        # Imports end on their own threads, with no event to wait on: look again shortly.
        time.sleep(0.005)


def gnu_openmp_libraries() -> list[str]:
    """Paths of the GNU OpenMP runtimes (``libgomp``) this process has loaded, from its
    memory map (none where it has no ``/proc``)."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split(None, 5)[-1].strip() for line in f if "libgomp" in line]
    except OSError:
        return []
    return [p for p in dict.fromkeys(paths) if p.startswith("/")]


def release_openmp_pool() -> int:
    """Let go of the calling thread's GNU OpenMP thread pool, in every libgomp loaded (module
    docstring); returns how many runtimes let go of it. Called outside any parallel region (a
    thread inside one keeps its pool: the runtime refuses)."""
    released = 0
    for path in gnu_openmp_libraries():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all  # GCC >= 9
        except (OSError, AttributeError):
            continue
        pause.restype = ctypes.c_int
        pause.argtypes = [ctypes.c_int]
        released += pause(1) == 0  # omp_pause_soft; libgomp treats both kinds alike
    return released


def _fork() -> int:
    """``os.fork()`` with SIGINT held back until it returns: a Ctrl-C raised inside the
    at-fork hooks (logging's among them) would leave their locks held, and the next log call
    of the parent would wait forever. The signal arrives after the fork instead. The calling
    thread's OpenMP pool is let go first (:func:`release_openmp_pool`)."""
    release_openmp_pool()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return os.fork()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


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


def detach_fds_but(keep: tuple[int, ...]) -> None:
    """In a forked server: let go of every inherited pipe, socket and shared-memory segment
    but ``keep``, and keep every other file open, as a forked DataLoader worker does (a
    dataset's open file, a sqlite or LMDB handle). A pipe or socket the server kept open would
    never be seen closed by its reader (another executor's worker, another server's "alive"
    pipe); a segment it kept would hold its memory after the owner removed it. Each is
    replaced by ``/dev/null`` rather than closed, so that its number is not reused while some
    inherited object still refers to it: such an object then reads nothing and writes nowhere
    (a socket call fails), instead of reaching whatever file took the number."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, os.sysconf("SC_OPEN_MAX")))
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            if fd in keep or fd == null or not _detached(fd):
                continue
            try:
                os.dup2(null, fd, inheritable=os.get_inheritable(fd))
            except OSError:
                pass
    finally:
        os.close(null)


def _detached(fd: int) -> bool:
    """Whether a forked server lets go of ``fd`` (see :func:`detach_fds_but`)."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False  # closed already (the directory listing's own descriptor)
    if stat.S_ISDIR(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return False
    if stat.S_ISREG(mode):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False
        return os.path.basename(path).startswith("ttp_") and path.startswith("/dev/shm/")
    return True  # pipes, sockets, eventfds and other anonymous files
