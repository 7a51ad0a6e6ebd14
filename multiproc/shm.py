"""The shared-memory directory: where segments live, how much room it has, reserving pages.

A container's ``/dev/shm`` is often small (Docker's default is 64 MiB) and shared with
everything else in it. Three rules keep a pipeline from crashing there:

- **Pages are reserved before they are written.** A page of a sparse tmpfs file is only backed
  by memory when first written; with the filesystem full, that write kills the process with
  SIGBUS. :func:`reserve` allocates the pages first (``posix_fallocate``), which fails with
  ENOSPC instead; a worker then waits for room or sends its frame through its pipe.
- **An executor's budgets fit what is free.** :class:`Room` caps the sum of an executor's
  channel budgets at :data:`SHARE` of the bytes free when it starts, and lowers the cap when
  a reservation fails.
- **The directory can be moved.** ``MULTIPROC_SHM_DIR`` names another directory (a larger
  tmpfs, or a disk) for every segment of the process's executors (:func:`directory`).

Only when not even the executor's counters fit does it raise
:class:`~multiproc.errors.SharedMemoryError`, with the directory's size, its free bytes and
the fixes (:func:`no_room`).
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Sequence

DEFAULT_DIR = "/dev/shm"
DIR_ENV = "MULTIPROC_SHM_DIR"
# The share of the free bytes one executor's arenas may hold: a train and a validation loader
# started one after the other, and whatever else the container keeps in /dev/shm (torch's
# own shared tensors, another process's loaders), still fit beside it.
SHARE = 1 / 3
# errnos of a filesystem with no room (bytes, inodes or quota) for a file or its pages.
NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG)


@functools.cache
def directory() -> str:
    """Where segments live: ``$MULTIPROC_SHM_DIR`` if set, else ``/dev/shm``.

    Read once per process: the fork server and workers forked from it keep the value, so every
    process of a pipeline agrees even if the environment changes after the first executor.
    """
    return os.environ.get(DIR_ENV) or DEFAULT_DIR


def usage(path: str) -> tuple[int, int]:
    """``(size, free)`` in bytes of the filesystem holding ``path`` (``(0, 0)`` if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0, 0
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def reserve(fd: int, offset: int, nbytes: int) -> bool:
    """Back ``[offset, offset + nbytes)`` of file ``fd`` with memory (or disk) now, so that
    writing it through a mapping cannot raise SIGBUS. False when the filesystem has no room;
    True as well where it cannot reserve (no ``fallocate``), as before this existed."""
    if nbytes <= 0:
        return True
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except AttributeError:  # a platform without it
        return True
    except OSError as e:
        if e.errno in NO_ROOM:
            return False
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENODEV):
            return True  # a filesystem that cannot reserve: pages are backed when written
        raise
    return True


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def no_room(what: str, path: str, err: BaseException | None = None) -> str:
    """The message for a segment that does not fit: the directory, its size, its free bytes
    and what to do about it."""
    size, free = usage(path)
    why = f" ({err.strerror})" if isinstance(err, OSError) and err.strerror else ""
    return (
        f"no room in {path} for {what}{why}: {path} is {_mib(size)} with {_mib(free)} free. "
        f"Give it more room (docker run --shm-size=1g; Kubernetes: an emptyDir volume with "
        f"medium: Memory and a sizeLimit mounted at /dev/shm), free what else holds it, or set "
        f"{DIR_ENV} to a directory with room (a larger tmpfs, or a disk) before the first "
        f"loader starts."
    )


def sigbus_hint(path: str) -> str:
    """What a worker's SIGBUS most likely means, with the directory's size and free bytes."""
    size, free = usage(path)
    return (
        f" (a SIGBUS usually means a shared-memory file could not get a page: {path} is "
        f"{_mib(size)} with {_mib(free)} free; see {DIR_ENV} and docker run --shm-size)"
    )


class Room:
    """How many bytes one executor's arenas may hold in the shared-memory directory.

    Args:
        path: the directory.
        floor: the least budget a stage gets, however little is free.
    """

    def __init__(self, path: str, floor: int):
        self.path = path
        self.floor = floor
        _, free = usage(path)
        # Unknown (no statvfs): no cap, as before budgets were fitted.
        self.cap_bytes = int(free * SHARE) if free else None

    def fit(self, budgets: Sequence[int]) -> list[int]:
        """``budgets`` scaled down together (each at least ``floor``) to sum to the cap."""
        budgets = list(budgets)
        total = sum(budgets)
        if self.cap_bytes is None or total <= self.cap_bytes:
            return budgets
        return [max(self.floor, b * self.cap_bytes // total) for b in budgets]

    def clamp(self, budget: int, others: int) -> int:
        """A stage's new ``budget`` within what the cap leaves beside ``others`` (the other
        stages' budgets)."""
        if self.cap_bytes is None:
            return budget
        return max(self.floor, min(budget, self.cap_bytes - others))

    def refit(self, held: int) -> bool:
        """After a reservation failed: read the free bytes again and lower the cap to ``held``
        (the bytes the executor's frames hold now) plus :data:`SHARE` of what is free. True
        when the cap went down."""
        _, free = usage(self.path)
        cap = held + int(free * SHARE)
        if self.cap_bytes is not None and cap >= self.cap_bytes:
            return False
        self.cap_bytes = cap
        return True
