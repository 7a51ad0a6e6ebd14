"""Large arrays in a stage's pickle, held once and shared by the stage's workers.

Workers forked from a snapshot (:mod:`multiproc.snapshot`) inherit their stage. Where a stage
travels pickled instead (thread workers, workers of multiprocessing's spawned server), what it
holds travels too: a map-style dataset's tensors unpickled in each worker are a private copy
per worker (26 MB per worker for 200,000 rows of 32 floats). :meth:`BufferFile.dumps` pickles
a stage with every CPU tensor storage and every numpy array (memory-mapped ones included) of
at least :data:`MIN_BYTES` replaced by a reference to memory the workers can map, in this
order:

- **The file it is mapped from**, for an array in a shared mapping of a regular file
  (``np.load(mmap_mode="r")``, ``np.memmap``, a tensor from ``torch.from_file``): the workers
  map the same bytes of that file, shared through the page cache as a forked worker's mapping
  is, and see the file as this process does.
- **A file in /dev/shm** that the workers map copy-on-write (``MAP_PRIVATE``), for other
  arrays. The pipeline then holds two copies of such an array (this process's and the
  file's). An array goes to the file only while ``/dev/shm`` keeps room for it and as much
  again for the channels (:func:`_room_for`), else it travels in the pickle. The file is named
  after the executor (``ttp_<pid>_...``), so the executor removes it with its other segments
  when it closes and the stale-segment sweep removes it after a crash. A worker's pages are
  shared until it writes one, and the values are those of when the stage was pickled, as the
  pickle's own bytes would be.

Tensors that view one storage in this process view one region in a worker, so they share
memory there as they do here. Tensors that need gradients, are not on the CPU or not strided
(sparse, quantized), and arrays of Python objects pickle as usual.
"""

from __future__ import annotations

import bisect
import io
import mmap
import os
import pickle
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from . import lifetime, shm
from .pickler import StagePickler

MIN_BYTES = 1 << 20  # smaller arrays stay in the pickle: a page of the file each is no gain
FILE_SUFFIX = "_pickled"  # an executor's file is ttp_<tag>_pickled (memory.py counts it apart)
ROOM_LEFT_BYTES = 256 << 20  # /dev/shm left free past an array written (see _room_for)
_ALIGN = mmap.PAGESIZE

# This process's mappings of buffer files, by name: every array unpickled from one file views
# one mapping, released once no array views it.
_maps: weakref.WeakValueDictionary[str, mmap.mmap] = weakref.WeakValueDictionary()


class BufferFile:
    """The shared file of one executor's stage pickles; written by :meth:`dumps`."""

    def __init__(self, name: str):
        self.name = name
        self.path = os.path.join(shm.directory(), name)
        self.size = 0
        self._fd = -1
        self._created = False
        self._regions: dict[tuple[int, int], int] = {}  # (data address, bytes) -> offset
        self._files: _SharedFiles | None = None

    @property
    def created(self) -> bool:
        """Whether the file exists (an array was written to it, or was to be)."""
        return self._created

    def dumps(self, obj: Any) -> bytes:
        """``obj`` pickled by cloudpickle (:class:`~multiproc.pickler.StagePickler`), its large
        arrays referred to in the file they are mapped from, else written to this file."""
        out = io.BytesIO()
        self._files = None  # this process's shared file mappings, read once per pickle
        try:
            _Pickler(out, self).dump(obj)
        finally:
            self._files = None
        return out.getvalue()

    def close(self) -> None:
        """Stop writing (the file stays until :func:`multiproc.arena.remove_segment`)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _write(self, key: tuple[int, int], data: np.ndarray) -> int | None:
        offset = self._regions.get(key)
        if offset is not None:
            return offset
        if not _room_for(data.nbytes):
            return None
        if self._fd < 0:
            try:
                with lifetime.uninterrupted():  # created and tracked, or neither
                    self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                    self._created = True
                    lifetime.track(self.name)
            except OSError:  # no /dev/shm to write to: every array travels in the pickle
                return None
        offset = -(-self.size // _ALIGN) * _ALIGN
        view = memoryview(data.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy's stubs: no __buffer__
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError:  # /dev/shm filled up meanwhile: this one travels in the pickle
            os.ftruncate(self._fd, self.size)
            return None
        self.size = offset + len(view)
        self._regions[key] = offset
        return offset

    def _place(self, key: tuple[int, int], data: np.ndarray) -> tuple | None:
        """Where a worker finds ``data`` (flat bytes; ``key``: its address and size here, or
        a negative address for a copy made here): the file it is mapped from or the buffer
        file (module docstring, in this order), or None."""
        if key[0] >= 0:
            if self._files is None:
                self._files = _SharedFiles()
            region = self._files.region(key[0], data.nbytes)
            if region is not None:
                return region
        offset = self._write(key, data)
        return None if offset is None else ("file", self.name, offset)

    def reduce(self, obj: Any) -> tuple | None:
        """The reduction of a large array to the file it is mapped from or to a region of
        this file, or None (then it pickles as usual: also for an array whose memory cannot
        be read as bytes here)."""
        try:
            if type(obj) is np.ndarray or type(obj) is np.memmap:
                return self._reduce_array(obj)
            torch = _torch()
            if torch is not None and type(obj) is torch.Tensor:
                return self._reduce_tensor(torch, obj)
        except (RuntimeError, TypeError, ValueError):
            return None
        return None

    def _reduce_array(self, a: np.ndarray) -> tuple | None:
        if a.nbytes < MIN_BYTES or a.dtype.hasobject:
            return None
        order: Literal["C", "F"] = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
        data = np.asarray(a, order=order)  # a view of a contiguous array (or memmap)
        key = (data.__array_interface__["data"][0], data.nbytes)
        if not np.may_share_memory(data, a):
            key = (-len(self._regions) - 1, 0)  # a copy made here: no other array views it
        where = self._place(key, data.reshape(-1, order=order).view(np.uint8))
        if where is None:
            return None
        return _array, (where, a.dtype, a.shape, order)

    def _reduce_tensor(self, torch: Any, t: Any) -> tuple | None:
        if (
            t.device.type != "cpu"
            or t.layout != torch.strided
            or t.requires_grad
            or t.is_quantized
            or t.is_conj()
            or t.is_neg()
        ):
            return None
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < MIN_BYTES:
            return None
        whole = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        where = self._place((storage.data_ptr(), nbytes), whole)
        if where is None:
            return None
        geometry = (t.storage_offset(), tuple(t.size()), tuple(t.stride()))
        return _tensor, (where, nbytes, t.dtype, *geometry)


def dumps_light(obj: Any) -> bytes:
    """``obj`` pickled as :meth:`BufferFile.dumps` pickles it, but with nothing written for
    its large arrays (a pickle never to be loaded): whether it pickles, and the modules it
    names (:func:`multiproc.spec.imported_modules`), without copying a dataset's tensors."""
    out = io.BytesIO()
    _Pickler(out, _Unwritten("ttp_unwritten")).dump(obj)
    return out.getvalue()


class _Unwritten(BufferFile):
    def _write(self, key: tuple[int, int], data: np.ndarray) -> int | None:
        return 0


class _Pickler(StagePickler):
    def __init__(self, file: io.BytesIO, out: BufferFile):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._out = out

    def reducer_override(self, obj: Any) -> Any:
        reduced = self._out.reduce(obj)
        if reduced is not None:
            return reduced
        return super().reducer_override(obj)


def _room_for(nbytes: int) -> bool:
    """Whether ``/dev/shm`` has room for ``nbytes`` more with as much again left for the
    channels' arenas (a container's is often 64 MiB): an array that does not fit travels in
    the pickle, as it would without this module."""
    try:
        st = os.statvfs(shm.directory())
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * nbytes + ROOM_LEFT_BYTES


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")  # a tensor exists only where torch is imported


def _mappings(pid: int | str) -> Iterator[tuple[int, int, str, int, str]]:
    """Process ``pid``'s memory mappings: ``(start, end, perms, file offset, path)``."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            yield lo, hi, parts[1], int(parts[2], 16), path


class _SharedFiles:
    """This process's shared mappings of regular files (``np.load(mmap_mode="r")``,
    ``np.memmap``, ``torch.from_file``), read once from ``/proc/self/maps``."""

    def __init__(self) -> None:
        self._maps: list[tuple[int, int, int, str, bool]] = []  # lo, hi, offset, path, writable
        try:
            for lo, hi, perms, offset, path in _mappings("self"):
                if perms[3] != "s" or not path.startswith("/") or path.endswith(")"):
                    continue  # private, anonymous, or "(deleted)"
                self._maps.append((lo, hi, offset, path, perms[1] == "w"))
        except (OSError, ValueError, IndexError):
            self._maps = []
        self._maps.sort()
        self._starts = [m[0] for m in self._maps]

    def region(self, address: int, nbytes: int) -> tuple | None:
        """``("path", file, offset, writable)`` when ``nbytes`` at ``address`` lie in one shared
        mapping of a regular file: a worker maps the same bytes of the file (its page cache, no
        copy) and sees what this process sees; else None. Private file mappings
        (``mmap_mode="c"``) are not: their changed pages are in no file."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        lo, hi, offset, path, writable = self._maps[i]
        if address + nbytes > hi or not os.path.isfile(path):
            return None
        return ("path", path, offset + address - lo, writable)


def _file_bytes(path: str, offset: int, nbytes: int, writable: bool) -> np.ndarray:
    """``nbytes`` of ``path`` from ``offset``, mapped shared as this process's were."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        mm = mmap.mmap(fd, offset - start + nbytes, offset=start, access=access)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset - start)


def _bytes(where: tuple, nbytes: int) -> np.ndarray:
    if where[0] == "path":
        return _file_bytes(where[1], where[2], nbytes, where[3])
    _, name, offset = where
    return np.frombuffer(_mapping(name), dtype=np.uint8, count=nbytes, offset=offset)


def _mapping(name: str) -> mmap.mmap:
    mm = _maps.get(name)
    if mm is None:
        fd = os.open(os.path.join(shm.directory(), name), os.O_RDONLY)
        try:
            # Copy-on-write: a worker that writes an array changes its own copy of the page.
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        _maps[name] = mm
    return mm


def _array(where: tuple, dtype: np.dtype, shape: tuple, order: Literal["C", "F"]) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    raw = _bytes(where, count * np.dtype(dtype).itemsize)
    return raw.view(dtype).reshape(shape, order=order)


def _tensor(
    where: tuple, nbytes: int, dtype: Any, storage_offset: int, size: tuple, stride: tuple
) -> Any:
    import torch

    storage = torch.from_numpy(_bytes(where, nbytes)).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, storage_offset, size, stride)
