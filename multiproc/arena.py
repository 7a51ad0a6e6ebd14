"""Shared-memory arenas: where payloads live between stages.

Every producing worker owns one arena segment in /dev/shm (or the directory
``MULTIPROC_SHM_DIR`` names, :mod:`multiproc.shm`), created once when the worker starts (never
per item), sparse: a block's pages are reserved when it is allocated (:meth:`Segment.reserve`),
so a full /dev/shm makes the worker wait or send the frame through its pipe instead of
killing it with SIGBUS. The worker alone allocates from it (no cross-process lock, so a
worker killed at any instant cannot leave a lock held); consumers map it read-only by name and
report releases back through the executor, which forwards them to the owner. The byte budget
of a stage's outbound channel is split across its workers' arenas; a full arena blocks its
producer (backpressure).

A payload is either inline (small frames travel inside the control message) or a reference
``(segment, offset, size, header_len, buffer_sizes)`` into an arena, or into a segment of the
frame's own (a frame too big for its worker's budget, :mod:`multiproc.spill`).

A thread worker whose frames go to the consumer, in the same process, hands them over as they
are (:func:`keep`, a :class:`KeptRef`): not serialized, not copied. The frame still holds a
block of its worker's arena as large as its estimated bytes (reserved, never written), so the
budget, the backpressure and the frees are those of any frame; the block's pages stay
untouched.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import lifetime, serialize, shm
from .errors import SharedMemoryError

SHM_DIR = shm.DEFAULT_DIR  # the default; shm.directory() is where segments are
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

    def mapping(self, cache: MappingCache) -> mmap.mmap:
        """This process's mapping of the segment (the arena's, shared by its frames)."""
        return cache.get(self.segment).mm


@dataclass(frozen=True)
class KeptRef(ShmRef):
    """A frame kept as objects in this process (:func:`keep`): ``offset`` and ``size`` are the
    block of arena ``segment`` it holds against its worker's budget."""


# Frames handed over within this process, by (segment, offset), until decoded or dropped.
_kept: dict[tuple[str, int], Any] = {}
_kept_lock = threading.Lock()


def keep(obj: Any, ref: KeptRef) -> tuple:
    """The payload of a frame ``obj`` handed over as it is, within this process."""
    with _kept_lock:
        _kept[(ref.segment, ref.offset)] = obj
    return ("shm", ref)


def _drop_kept(match: Callable[[str], bool]) -> None:
    """Forget the kept frames of the segments ``match`` accepts (their run or worker is gone)."""
    with _kept_lock:
        for key in [k for k in _kept if match(k[0])]:
            del _kept[key]


def segment_path(name: str) -> str:
    """Where segment ``name`` lives (in :func:`multiproc.shm.directory`)."""
    return os.path.join(shm.directory(), name)


def _no_room(what: str, e: OSError) -> SharedMemoryError:
    return SharedMemoryError(shm.no_room(what, shm.directory(), e))


class Segment:
    """A named shared-memory file mapped into this process.

    ``create``: make it, with every page reserved (the executor's counters: small, written
    at once). ``writer``: the arena of the worker that writes it; its blocks' pages are
    reserved as they are allocated (:meth:`reserve`).

    Raises:
        SharedMemoryError: ``create`` and the directory has no room for it.
    """

    def __init__(self, name: str, size: int, create: bool, writer: bool = False):
        self.name = name
        self.path = segment_path(name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            with lifetime.uninterrupted() if create else contextlib.nullcontext():
                fd = os.open(self.path, flags, 0o600)
                if create:
                    lifetime.track(name)  # with its creation: Ctrl-C cannot land between them
        except OSError as e:
            if create and e.errno in shm.NO_ROOM:
                raise _no_room(f"segment {name}", e) from e
            raise
        keep = False
        try:
            if create:
                os.ftruncate(fd, size)
                if not shm.reserve(fd, 0, size):
                    os.close(fd)
                    fd = -1
                    remove_segment(name)
                    raise SharedMemoryError(
                        shm.no_room(f"the executor's counters ({size >> 10} KiB)", shm.directory())
                    )
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            keep = writer
        finally:
            if fd >= 0 and not keep:
                os.close(fd)
        self.view = memoryview(self.mm)
        self._fd = fd if keep else -1
        # Pages reserved so far, one byte each (writer only): a block whose pages are all
        # reserved is written without a system call.
        self._reserved = bytearray(-(-size // mmap.PAGESIZE)) if keep else None
        self.refused = False  # a reservation failed since the worker last asked (took_refusal)
        if keep:
            weakref.finalize(self, os.close, fd)

    def reserve(self, offset: int, size: int) -> bool:
        """Back the pages of ``[offset, offset + size)`` with memory before they are written
        (:func:`multiproc.shm.reserve`); False, and :attr:`refused` set, when the directory
        has no room. Always True for a segment not opened as the writer."""
        if self._reserved is None:
            return True
        lo = offset // mmap.PAGESIZE
        hi = -(-(offset + size) // mmap.PAGESIZE)
        if self._reserved.find(0, lo, hi) < 0:
            return True
        start = lo * mmap.PAGESIZE
        if not shm.reserve(self._fd, start, min(hi * mmap.PAGESIZE, self.size) - start):
            self.refused = True
            return False
        self._reserved[lo:hi] = b"\1" * (hi - lo)
        return True

    def took_refusal(self) -> bool:
        """Whether a reservation failed since the last call."""
        refused, self.refused = self.refused, False
        return refused

    def release(self, start: int, size: int) -> None:
        """Give the memory behind ``[start, start + size)`` back to the system (the whole pages
        inside it); reading there afterwards sees zeros. Only for blocks no frame uses."""
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            self.mm.madvise(mmap.MADV_REMOVE, lo, hi - lo)
            if self._reserved is not None:
                n = (hi - lo) // mmap.PAGESIZE
                p = lo // mmap.PAGESIZE
                self._reserved[p : p + n] = bytes(n)

    def unlink(self) -> None:
        """Remove the segment created here (see :func:`remove_segment`)."""
        remove_segment(self.name)


def sweep_stale_segments(prefix: str = "ttp_") -> list[str]:
    """Remove segments left by executors that no longer exist: the provably dead ones
    (:func:`multiproc.lifetime.stale`). The fork server, or else the resource tracker, unlinks
    the segments of a killed owner (:mod:`multiproc.lifetime`); this sweep is the fallback for
    one that was killed too. Returns the names removed."""
    removed = lifetime.stale(_listing(prefix))
    for name in removed:
        unlink_segment(name)
    return removed


def unlink_segment(name: str) -> None:
    """Unlink a segment this process did not create (e.g. a dead process's)."""
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        pass


def create_segment(name: str, size: int) -> None:
    """Create a sparse segment of ``size`` bytes, tracked (:func:`multiproc.lifetime.track`)
    so it is unlinked even if this process is killed; remove it with :func:`remove_segment`.

    Raises:
        SharedMemoryError: the directory has no room for one more file.
    """
    try:
        with lifetime.uninterrupted():  # created and tracked, or neither (Ctrl-C)
            fd = os.open(segment_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            lifetime.track(name)
    except OSError as e:
        if e.errno in shm.NO_ROOM:
            raise _no_room(f"segment {name}", e) from e
        raise
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def remove_segment(name: str) -> None:
    """Unlink a segment made by :func:`create_segment` (or ``Segment(create=True)``); one
    never made (its creation was interrupted) or already removed is left alone. Frames kept
    in its name (:func:`keep`) are forgotten."""
    if _kept:
        _drop_kept(name.__eq__)
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        return
    lifetime.untrack(name)


def _listing(prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(shm.directory()) if n.startswith(prefix)]
    except FileNotFoundError:
        return []


def segment_names(prefix: str) -> list[str]:
    """The names of the segments named ``prefix...`` (none without the directory), but for
    those of executors alive in another process (:func:`multiproc.lifetime.held_elsewhere`:
    the same pid in another PID namespace sharing the directory)."""
    return lifetime.not_held_elsewhere(_listing(prefix))


def remove_segments(prefix: str) -> list[str]:
    """Remove every segment of this process named ``prefix...`` (see :func:`remove_segment`):
    those an interrupted start made but did not record. Returns the names removed."""
    if _kept:
        _drop_kept(lambda seg: seg.startswith(prefix))
    names = _listing(prefix)
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
        return inline(header, buffers), total
    assert segment is not None  # an allocator allocates in its segment
    off = allocator.alloc(total)
    if off is None:
        return None, total
    if not segment.reserve(off, total):  # the directory is full: as if the arena were
        allocator.free(off)
        return None, total
    dst = segment.view[off : off + total]
    dst[: len(header)] = header
    serialize.copy_into(dst[len(header) :], buffers)
    return ("shm", ShmRef(segment.name, off, total, len(header), tuple(sizes))), total


def inline(header: bytes, buffers: list[pickle.PickleBuffer]) -> tuple:
    """The payload of a frame that travels in the control message: its header and a copy of
    each buffer (:func:`multiproc.serialize.dumps`)."""
    return ("inline", header, [bytes(b.raw()) for b in buffers])


def decode(payload, cache: MappingCache, on_release: Callable[[ShmRef], None] | None):
    """Rebuild a frame. For payloads in shared memory (an arena block, or a segment of its own:
    :class:`multiproc.spill.SpillRef`), ``on_release(ref)`` runs once nothing built from the
    frame (tensors, arrays, views of them) is alive any more."""
    if payload[0] == "inline":
        _, header, bufs = payload
        # bytearray: tensors built on read-only bytes would be read-only views.
        return serialize.loads(header, [memoryview(bytearray(b)) for b in bufs])
    ref: ShmRef = payload[1]
    if isinstance(ref, KeptRef):
        with _kept_lock:
            obj = _kept.pop((ref.segment, ref.offset))
        if on_release is not None:
            on_release(ref)  # its block holds nothing: the budget is free again at once
        return obj
    mm = ref.mapping(cache)
    holder = np.frombuffer(mm, dtype=np.uint8, count=ref.size, offset=ref.offset)
    mv = memoryview(holder)  # type: ignore[arg-type]  # numpy's stubs: no __buffer__
    pos = ref.header_len
    views = []
    for n in ref.buffer_sizes:
        views.append(mv[pos : pos + n])
        pos += n
    obj = serialize.loads(mv[: ref.header_len], views)
    if on_release is not None:
        weakref.finalize(holder, on_release, ref)
    return obj
