"""Large arrays in a stage's pickle, written once and shared by the stage's workers.

A stage function travels to every worker process pickled, with what it holds: a map-style
dataset's tensors unpickled in each worker are a private copy per worker (26 MB per worker for
200,000 rows of 32 floats). :func:`dumps` pickles a stage with every CPU tensor storage and
every numpy array of at least :data:`MIN_BYTES` written into one file in ``/dev/shm`` instead,
and the workers map that file copy-on-write (``MAP_PRIVATE``): its pages are shared until a
worker writes one, as the pages of a forked DataLoader worker's dataset are. The values are a
snapshot taken when the stage was pickled, as the pickle's own bytes would be; tensors that
view one storage in this process view one region of the file, so they share memory in a worker
as they do here.

The pipeline then holds two copies of such an array (this process's own and the file's) where
it held one per worker. An array goes to the file only while ``/dev/shm`` keeps room for it and
as much again for the channels (:func:`_room_for`), else it travels in the pickle. The file is
named after the executor (``ttp_<pid>_...``), so the executor removes it with its other
segments when it closes and the stale-segment sweep removes it after a crash. Tensors that
need gradients, are not on the CPU or not strided (sparse, quantized), and arrays of Python
objects pickle as usual.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import weakref
from typing import Any

import cloudpickle
import numpy as np

from . import arena, lifetime

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
        self.path = os.path.join(arena.SHM_DIR, name)
        self.size = 0
        self._fd = -1
        self._created = False
        self._regions: dict[tuple[int, int], int] = {}  # (data address, bytes) -> offset

    @property
    def created(self) -> bool:
        """Whether the file exists (an array was written to it, or was to be)."""
        return self._created

    def dumps(self, obj: Any) -> bytes:
        """``obj`` pickled by cloudpickle, its large arrays written to the file."""
        out = io.BytesIO()
        _Pickler(out, self).dump(obj)
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
                with lifetime.uninterrupted():  # created and registered, or neither
                    self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                    self._created = True
                    lifetime.track(self.name)
            except OSError:  # no /dev/shm to write to: every array travels in the pickle
                return None
        offset = -(-self.size // _ALIGN) * _ALIGN
        view = memoryview(data.reshape(-1).view(np.uint8))
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

    def reduce(self, obj: Any) -> tuple | None:
        """The reduction of a large array to a region of the file, or None (then it pickles
        as usual: also for an array whose memory cannot be read as bytes here)."""
        try:
            if type(obj) is np.ndarray:
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
        order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
        data = np.asarray(a, order=order)
        key = (data.__array_interface__["data"][0], data.nbytes)
        if data is not a:
            key = (-len(self._regions) - 1, 0)  # a copy made here: no other array views it
        offset = self._write(key, data.reshape(-1, order=order))
        if offset is None:
            return None
        return _array, (self.name, offset, a.dtype, a.shape, order)

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
        offset = self._write((storage.data_ptr(), nbytes), whole)
        if offset is None:
            return None
        geometry = (t.storage_offset(), tuple(t.size()), tuple(t.stride()))
        return _tensor, (self.name, offset, nbytes, t.dtype, *geometry)


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


class _Pickler(cloudpickle.CloudPickler):
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
        st = os.statvfs(arena.SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * nbytes + ROOM_LEFT_BYTES


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")  # a tensor exists only where torch is imported


def _mapping(name: str) -> mmap.mmap:
    mm = _maps.get(name)
    if mm is None:
        fd = os.open(os.path.join(arena.SHM_DIR, name), os.O_RDONLY)
        try:
            # Copy-on-write: a worker that writes an array changes its own copy of the page.
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        _maps[name] = mm
    return mm


def _array(name: str, offset: int, dtype: np.dtype, shape: tuple, order: str) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    flat = np.frombuffer(_mapping(name), dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order=order)


def _tensor(
    name: str, offset: int, nbytes: int, dtype: Any, storage_offset: int, size: tuple,
    stride: tuple,
) -> Any:  # fmt: skip
    import torch

    raw = np.frombuffer(_mapping(name), dtype=np.uint8, count=nbytes, offset=offset)
    storage = torch.from_numpy(raw).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, storage_offset, size, stride)
