"""Shared-memory arenas: where payloads live between stages.

Every producing worker owns one arena segment in /dev/shm, created once when the worker
starts (never per item). The worker alone allocates from it (no cross-process lock, so a
worker killed at any instant cannot leave a lock held); consumers map it read-only by name and
report releases back through the executor, which forwards them to the owner. The byte budget
of a stage's outbound channel is split across its workers' arenas; a full arena blocks its
producer (backpressure).

A payload is either inline (small frames travel inside the control message) or a reference
``(segment, offset, size, header_len, buffer_sizes)`` into an arena.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import lifetime, serialize

SHM_DIR = "/dev/shm"
ALIGN = 64
# Frames whose serialized size is below this travel inline in the control message.
INLINE_MAX_BYTES = 16 * 1024


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


@dataclass(frozen=True)
class ShmRef:
    """Where one serialized frame lives in an arena."""

    segment: str
    offset: int
    size: int
    header_len: int
    buffer_sizes: tuple[int, ...]


class Segment:
    """A named shared-memory file mapped into this process."""

    def __init__(self, name: str, size: int, create: bool):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        with lifetime.uninterrupted() if create else contextlib.nullcontext():
            fd = os.open(self.path, flags, 0o600)
            if create:
                lifetime.track(name)  # with its creation: Ctrl-C cannot land between them
        try:
            if create:
                # Sparse: pages are only backed by memory once written, so a segment sized
                # for the largest budget costs nothing until it is used.
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self.mm)

    def release(self, start: int, size: int) -> None:
        """Give the memory behind ``[start, start + size)`` back to the system (the whole pages
        inside it); reading there afterwards sees zeros. Only for blocks no frame uses."""
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            self.mm.madvise(mmap.MADV_REMOVE, lo, hi - lo)

    def unlink(self) -> None:
        """Remove the segment created here (see :func:`remove_segment`)."""
        remove_segment(self.name)


def sweep_stale_segments(prefix: str = "ttp_") -> list[str]:
    """Remove segments left by executors whose process no longer exists.

    Segments are named ``ttp_<pid>_...`` after the process that created them. The fork
    server, or else the resource tracker, unlinks the segments of a killed owner
    (:mod:`multiproc.lifetime`); this sweep is the fallback for one that was killed too.
    Returns the names removed.
    """
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        parts = name.split("_")
        if not name.startswith(prefix) or len(parts) < 3 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        unlink_segment(name)
        removed.append(name)
    return removed


def unlink_segment(name: str) -> None:
    """Unlink a segment this process did not create (e.g. a dead process's)."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def create_segment(name: str, size: int) -> None:
    """Create a sparse segment of ``size`` bytes, tracked (:func:`multiproc.lifetime.track`)
    so it is unlinked even if this process is killed; remove it with :func:`remove_segment`."""
    with lifetime.uninterrupted():  # created and tracked, or neither (Ctrl-C)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        lifetime.track(name)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def remove_segment(name: str) -> None:
    """Unlink a segment made by :func:`create_segment` (or ``Segment(create=True)``); one
    never made (its creation was interrupted) or already removed is left alone."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return
    lifetime.untrack(name)


def segment_names(prefix: str) -> list[str]:
    """The names of the segments named ``prefix...`` (none without a ``SHM_DIR``)."""
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except FileNotFoundError:
        return []


def remove_segments(prefix: str) -> list[str]:
    """Remove every segment of this process named ``prefix...`` (see :func:`remove_segment`):
    those an interrupted start made but did not record. Returns the names removed."""
    names = segment_names(prefix)
    for name in names:
        remove_segment(name)
    return names


class Allocator:
    """First-fit allocator over one arena, with coalescing frees; single owner, no locks."""

    def __init__(self, size: int, limit: int):
        self.size = size
        self.limit = min(limit, size)
        self.used = 0
        self._free_starts = [0]
        self._free_sizes = {0: size}
        self._live: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh block, or None when the budget or the arena is full."""
        n = _align(max(nbytes, 1))
        if self.used + n > self.limit:
            return None
        for start in self._free_starts:
            sz = self._free_sizes[start]
            if sz >= n:
                i = bisect.bisect_left(self._free_starts, start)
                del self._free_starts[i]
                del self._free_sizes[start]
                if sz > n:
                    bisect.insort(self._free_starts, start + n)
                    self._free_sizes[start + n] = sz - n
                self._live[start] = n
                self.used += n
                return start
        return None

    def free(self, offset: int) -> None:
        n = self._live.pop(offset)
        self.used -= n
        i = bisect.bisect_left(self._free_starts, offset)
        start, size = offset, n
        # Merge with the next free block.
        if i < len(self._free_starts) and self._free_starts[i] == start + size:
            nxt = self._free_starts.pop(i)
            size += self._free_sizes.pop(nxt)
        # Merge with the previous free block.
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_sizes[prev] == start:
                self._free_sizes[prev] += size
                return
        self._free_starts.insert(i, start)
        self._free_sizes[start] = size

    @property
    def live(self) -> int:
        return len(self._live)

    def free_blocks(self) -> list[tuple[int, int]]:
        """``(start, size)`` of every free block."""
        return [(start, self._free_sizes[start]) for start in self._free_starts]


class MappingCache:
    """Segments of other processes mapped here, opened on first use."""

    def __init__(self) -> None:
        self._segs: dict[str, Segment] = {}

    def get(self, name: str) -> Segment:
        seg = self._segs.get(name)
        if seg is None:
            seg = self._segs[name] = Segment(name, 0, create=False)
        return seg

    def drop(self, name: str) -> None:
        # Views handed to users keep the mmap alive; dropping our reference is always safe.
        self._segs.pop(name, None)

    def clear(self) -> None:
        self._segs.clear()


def encode(obj, allocator: Allocator | None, segment: Segment | None):
    """Serialize ``obj``.

    Returns ``("inline", bytes_header, [bytes...])`` for small frames or when no arena space is
    available and the caller allowed inline (``allocator is None``); ``("shm", ShmRef)`` when
    written to the arena; or ``None`` when the arena is full (caller waits for releases).
    """
    header, buffers = serialize.dumps(obj)
    sizes = serialize.buffer_nbytes(buffers)
    total = len(header) + sum(sizes)
    if allocator is None or total <= INLINE_MAX_BYTES:
        return ("inline", header, [bytes(b.raw()) for b in buffers]), total
    off = allocator.alloc(total)
    if off is None:
        return None, total
    dst = segment.view[off : off + total]
    dst[: len(header)] = header
    serialize.copy_into(dst[len(header) :], buffers)
    return ("shm", ShmRef(segment.name, off, total, len(header), tuple(sizes))), total


def decode(payload, cache: MappingCache, on_release: Callable[[ShmRef], None] | None):
    """Rebuild a frame. For arena payloads, ``on_release(ref)`` runs once nothing built from
    the frame (tensors, arrays, views of them) is alive any more."""
    if payload[0] == "inline":
        _, header, bufs = payload
        # bytearray: tensors built on read-only bytes would be read-only views.
        return serialize.loads(header, [memoryview(bytearray(b)) for b in bufs])
    ref: ShmRef = payload[1]
    seg = cache.get(ref.segment)
    holder = np.frombuffer(seg.mm, dtype=np.uint8, count=ref.size, offset=ref.offset)
    mv = memoryview(holder)
    pos = ref.header_len
    views = []
    for n in ref.buffer_sizes:
        views.append(mv[pos : pos + n])
        pos += n
    obj = serialize.loads(mv[: ref.header_len], views)
    if on_release is not None:
        weakref.finalize(holder, on_release, ref)
    return obj
