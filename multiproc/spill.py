"""Spilled frames: a frame bigger than its worker's arena budget, in a segment of its own.

When the router lets a blocked worker's frame through (``SpillOk``, :mod:`multiproc.policy`),
the worker writes it once into a new segment, ``<arena>_s<n>`` (under its executor's prefix
``ttp_<tag>_``), laid out as an arena block is (header, then the buffers back to back), and
sends a :class:`SpillRef` naming it. Consumers map the whole segment
(:func:`multiproc.arena.decode`: tensors view the mapping), and release it as they release an
arena block; the router then unlinks it (:class:`multiproc.ledger.Ledger`), and the last
mapping's end frees its pages.

The segment is written with ``write()``, not through a mapping: a directory with no room fails
the write with ENOSPC where a store into a mapped page would raise SIGBUS. A frame that would
take more than :data:`multiproc.shm.SHARE` of the directory's free bytes, or that does not fit,
travels inline in the worker's pipe instead: slower, but a 64 MiB Docker ``/dev/shm`` works.

While the executor runs, only the router unlinks a segment it was told of. One a worker made
but never sent (it died first) is removed when the router forgets that worker
(:meth:`multiproc.ledger.Ledger.maybe_unlink`, :func:`orphans`). Whatever is left at the end
goes with every other segment of the executor's prefix (``handles.Resources``), or, when the
owner is killed, with its pid's prefix (:mod:`multiproc.lifetime`), failing which the next
executor's sweep of stale segments removes it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from typing import Any

from . import arena, serialize, shm
from .arena import KeptRef, MappingCache, ShmRef

# Buffers per writev() call: Linux's IOV_MAX.
_IOV_MAX = 1024


@dataclass(frozen=True)
class SpillRef(ShmRef):
    """A frame alone in a segment of its own (``offset`` 0, ``size`` the whole file)."""

    def mapping(self, cache: MappingCache) -> mmap.mmap:
        """A mapping of the whole segment, this frame's only (``cache`` unused): unmapped
        once nothing built from the frame is alive. Pages are mapped as they are read, as
        torch's shared tensors are: a consumer that reads part of a frame pays for that part."""
        fd = os.open(arena.segment_path(self.segment), os.O_RDWR)
        try:
            return mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class KeptSpillRef(KeptRef, SpillRef):
    """A frame too big for its worker's budget, kept as objects in this process
    (:func:`multiproc.arena.keep`): it holds no block, and no segment is made in its name."""


def name(arena_name: str, n: int) -> str:
    """The name of the ``n``-th segment the worker owning arena ``arena_name`` spills to."""
    return f"{arena_name}_s{n}"


def orphans(arena_name: str, known: set[str]) -> list[str]:
    """The segments the worker owning ``arena_name`` spilled to that are not in ``known``
    (frames it never sent: call once it can make no more)."""
    return [n for n in arena.segment_names(f"{arena_name}_s") if n not in known]


def write(obj: Any, segment: str) -> tuple[Any, int]:
    """Serialize ``obj`` into a new segment named ``segment``; ``(payload, bytes)``.

    The payload is ``("shm", SpillRef)``, or, where the shared-memory directory has no room
    for it (see the module docstring), an inline one (:func:`multiproc.arena.encode`).
    """
    header, buffers = serialize.dumps(obj)
    sizes = serialize.buffer_nbytes(buffers)
    total = len(header) + sum(sizes)
    size, free = shm.usage(shm.directory())
    if size and total > free * shm.SHARE:
        return arena.inline(header, buffers), total
    try:
        fd = os.open(arena.segment_path(segment), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as e:
        if e.errno in shm.NO_ROOM:
            return arena.inline(header, buffers), total
        raise
    try:
        _write_all(fd, [memoryview(header), *(b.raw() for b in buffers)])
    except BaseException as e:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(arena.segment_path(segment))
        if isinstance(e, OSError) and e.errno in shm.NO_ROOM:
            return arena.inline(header, buffers), total
        raise
    os.close(fd)
    return ("shm", SpillRef(segment, 0, total, len(header), tuple(sizes))), total


def _write_all(fd: int, chunks: list[memoryview]) -> None:
    """Write ``chunks`` (byte views) to ``fd`` in order, whatever each call takes."""
    chunks = [c for c in chunks if c.nbytes]
    i = 0
    while i < len(chunks):
        n = os.writev(fd, chunks[i : i + _IOV_MAX])
        while n > 0:
            c = chunks[i]
            if n >= c.nbytes:
                n -= c.nbytes
                i += 1
            else:
                chunks[i] = c[n:]
                n = 0
