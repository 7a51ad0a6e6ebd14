"""Pickle protocol 5 with out-of-band buffers for tensors and arrays.

`dumps` splits an object into a small pickled header plus the raw buffers of its CPU tensors
and numpy arrays, without copying them. The caller copies those buffers once into a
shared-memory arena; `loads` rebuilds the object with tensors and arrays that *view* the
arena (no copy on the consumer side).

torch's own pickling of a tensor goes through ``torch.save`` of its storage into a bytes
object, which copies every payload; a ``reducer_override`` turns dense CPU tensors into the
raw bytes their view covers plus (dtype, shape, stride) instead. A view is never sent as its
whole storage: what arrives is a tensor with the sender's values and strides, rebased to the
start of its own buffer, whatever the sender's storage offset.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import mmap
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils import collate as _torch_collate

from . import workerinfo

# Buffers smaller than this stay inside the header: copying a few hundred bytes in-band is
# cheaper than an arena slot for them.
INBAND_MAX_BYTES = 1024


def _rebuild_tensor(buf, dtype: torch.dtype, shape, stride, offset: int, requires_grad: bool):
    """Inverse of `_reduce_tensor`: ``buf`` holds exactly the elements the view spans, so
    ``offset`` is 0 for every tensor this version sends (kept in the format for clarity)."""
    raw = (
        torch.frombuffer(buf, dtype=torch.uint8)
        if len(memoryview(buf))
        else torch.empty(0, dtype=torch.uint8)
    )
    flat = raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype)
    t = torch.as_strided(flat, shape, stride, offset)
    if requires_grad:
        t.requires_grad_(True)
    return t


# A view that spans more than this many elements per element it holds (a column of a
# row-major matrix, ``x[::8]``) is compacted before sending: shipping the gaps would cost more
# than the one copy that removes them. Denser views (a row, a transpose, an expand) keep their
# strides and send only the elements between their first and last one.
_SPARSE_SPAN_RATIO = 2


def _span(t: torch.Tensor) -> int:
    """Elements of storage between the first and the last one ``t`` reads, both included.

    torch strides are never negative, so the first element is at ``storage_offset()``."""
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))


def _reduce_tensor(t: torch.Tensor):
    """Reduce a dense CPU tensor to the bytes it covers (a PickleBuffer) plus its geometry.

    Only the slice of storage the view reads is sent, rebased to offset 0: a row of a 1 GB
    table ships one row, and a view at a nonzero storage offset arrives with its own values.
    Lazy conjugate and negative views are materialised (their storage holds the other values).
    """
    requires_grad = t.requires_grad
    if requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.numel() == 0:
        return _rebuild_tensor, (bytearray(), t.dtype, tuple(t.shape), t.stride(), 0, requires_grad)
    span = _span(t)
    if span > _SPARSE_SPAN_RATIO * t.numel():
        t = t.contiguous()
        span = t.numel()
    storage = t.untyped_storage()
    start, nbytes = t.storage_offset() * t.element_size(), span * t.element_size()
    base = torch.empty(0, dtype=torch.uint8).set_(storage)
    if start or nbytes != storage.nbytes():
        base = base[start : start + nbytes]
    return _rebuild_tensor, (
        pickle.PickleBuffer(base.numpy()),  # type: ignore[arg-type]  # numpy's stubs: no __buffer__
        t.dtype,
        tuple(t.shape),
        tuple(t.stride()),
        0,
        requires_grad,
    )


def _rebuild_small(data: bytearray, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """Inverse of `_reduce_small`: a tensor over the unpickled (writable) bytes, no copy."""
    flat = torch.frombuffer(data, dtype=dtype)
    if len(shape) == 1:
        return flat
    return flat[0] if not shape else flat.reshape(shape)  # indexing is the cheapest 0-d


def _reduce_small(t: torch.Tensor):
    """A small contiguous tensor (fewer than ``INBAND_MAX_BYTES``, so in-band anyway) as its
    bytes, dtype and shape: the general path's storage handling costs ~6 us a tensor, which
    dominates a row of a few small tensors. None where it does not apply."""
    if t.requires_grad or t.is_conj() or t.is_neg() or not t.is_contiguous():
        return None
    try:
        a = t.numpy()
    except TypeError:  # a dtype numpy lacks (bfloat16, ...)
        return None
    return _rebuild_small, (bytearray(a.data), t.dtype, tuple(t.shape))


def _reduce_ndarray(a: np.ndarray):
    """A non-contiguous array (a strided or reversed slice) is compacted once so that its bytes
    travel out of band; numpy itself would pickle it through an in-band ``tobytes()`` copy."""
    return np.ascontiguousarray(a).__reduce_ex__(5)


def _tensor_is_plain(obj: torch.Tensor) -> bool:
    return (
        (type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter)
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.is_quantized
    )


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()

    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor) and _tensor_is_plain(obj):
            if 0 < obj.nbytes < INBAND_MAX_BYTES:
                small = _reduce_small(obj)
                if small is not None:
                    return small
            return _reduce_tensor(obj)
        if (
            type(obj) is np.ndarray
            and not obj.dtype.hasobject
            and not (obj.flags.c_contiguous or obj.flags.f_contiguous)
        ):
            return _reduce_ndarray(obj)
        return NotImplemented


def _stack_in_private_memory(batch, *, collate_fn_map=None):
    """torch's ``collate_tensor_fn`` (same checks, same values) as it runs outside a torch
    worker: the stacked tensor in ordinary memory, in a worker process or a thread worker.
    ``get_worker_info()`` reads None for the call, in the calling context only
    (:mod:`multiproc.workerinfo`): a read on another thread still sees its own."""
    with workerinfo.info_set(None):
        return _torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def collate_into_private_memory() -> None:
    """In a worker process of the executor, torch's ``default_collate`` stacks tensors in
    ordinary memory.

    Where ``get_worker_info()`` is set (as it is in a worker of the drop-in DataLoader), torch's
    collate stacks each tensor into a new shared-memory segment of its own, for its own
    queues to pass by descriptor; a channel here copies the batch into its arena anyway, so
    the segment (created, mapped, faulted in and unlinked per tensor per batch: ~8% of a
    worker's time on cheap rows) bought nothing. Only torch's own tensor entry is replaced;
    one a user registered stays."""
    fns = getattr(_torch_collate, "default_collate_fn_map", None)
    torchs = getattr(_torch_collate, "collate_tensor_fn", None)
    if fns is not None and torchs is not None and fns.get(torch.Tensor) is torchs:
        fns[torch.Tensor] = _stack_in_private_memory


_private_lock = threading.Lock()
_private_users = 0  # blocks of private_collate open now, in any thread
_private_before: Any = None  # the entry the first of them replaced


@contextlib.contextmanager
def private_collate() -> Iterator[None]:
    """:func:`collate_into_private_memory` for the block only: batches read in the calling
    process as a worker would read them (torch's worker info set: a fast start's reads, the
    threads of thread workers) are stacked in ordinary memory too, not in a shared-memory
    segment per tensor (which a small or full /dev/shm refuses). Blocks may overlap, in any
    threads and in any order: the first to open installs the entry, the last to close puts
    back the one it found. Outside a worker the entry gives what torch's gives."""
    global _private_users, _private_before
    fns = getattr(_torch_collate, "default_collate_fn_map", None)
    with _private_lock:
        if _private_users == 0:
            _private_before = None if fns is None else fns.get(torch.Tensor)
            collate_into_private_memory()
        _private_users += 1
    try:
        yield
    finally:
        with _private_lock:
            _private_users -= 1
            if _private_users == 0:
                before, _private_before = _private_before, None
                if (
                    fns is not None
                    and before is not None
                    and fns.get(torch.Tensor) is _stack_in_private_memory
                ):
                    fns[torch.Tensor] = before


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Serialize ``obj`` into a header and a list of out-of-band buffers (not copied).

    Raises:
        pickle.PicklingError, TypeError, AttributeError: the object cannot be pickled.
    """
    buffers: list[pickle.PickleBuffer] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < INBAND_MAX_BYTES:
            return True  # serialize in-band
        buffers.append(buf)
        return False

    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=keep).dump(obj)
    return f.getvalue(), buffers


def loads(header: bytes | memoryview, buffers: list) -> Any:
    """Rebuild an object; tensors and arrays view ``buffers`` (no copy)."""
    return pickle.loads(header, buffers=buffers)


def buffer_nbytes(buffers: list[pickle.PickleBuffer]) -> list[int]:
    return [b.raw().nbytes for b in buffers]


def copy_into(dst: memoryview, buffers: list[pickle.PickleBuffer]) -> None:
    """Copy buffers back to back into ``dst`` (the one copy per hop)."""
    pos = 0
    for b in buffers:
        raw = b.raw()
        n = raw.nbytes
        dst[pos : pos + n] = raw
        pos += n


# A hop's copy is timed on at most this many bytes and scaled to the rest: the copy's rate,
# not the whole copy, is what is measured.
HOP_SCRATCH_BYTES = 4 << 20


def hop_s(objs: list, arena_bytes: int | None = None) -> float:
    """Seconds one hop between processes costs ``objs`` here, measured: pickled as a worker
    sends them (:func:`dumps`), their buffers copied once (timed on up to
    ``HOP_SCRATCH_BYTES`` and scaled), and rebuilt as the consumer rebuilds them
    (:func:`loads`). Where they fit ``arena_bytes`` (a worker's arena; None: no bound) the
    copy goes to pages written before, as an arena's are once it has cycled; else
    to pages the kernel must first give, as a frame bigger than its worker's arena pays
    (:mod:`multiproc.spill`: a segment of its own each time). 0.0 where they cannot be
    pickled (the hop is then not theirs to make), or none are given."""
    if not objs:
        return 0.0
    t0 = time.perf_counter()
    try:
        sent = [dumps(o) for o in objs]
    except Exception:
        return 0.0
    took = time.perf_counter() - t0
    raws = [b.raw() for _, bufs in sent for b in bufs]
    total = sum(r.nbytes for r in raws)
    if total:
        frames = total + sum(len(header) for header, _ in sent)
        fresh_pages = arena_bytes is not None and frames > arena_bytes
        size = min(total, HOP_SCRATCH_BYTES)
        fresh = mmap.mmap(-1, size) if fresh_pages else None
        scratch = memoryview(bytearray(size) if fresh is None else fresh)  # bytearray: written
        copied = 0
        t0 = time.perf_counter()
        for raw in raws:  # copy_into's copy, cut at the scratch's size
            n = min(raw.nbytes, size - copied)
            scratch[copied : copied + n] = raw[:n]
            copied += n
            if copied >= size:
                break
        took += (time.perf_counter() - t0) * total / copied
        scratch.release()
        if fresh is not None:
            fresh.close()
    t0 = time.perf_counter()
    for header, bufs in sent:
        loads(header, [b.raw() for b in bufs])
    return took + time.perf_counter() - t0


__all__ = [
    "dumps",
    "loads",
    "copy_into",
    "hop_s",
    "HOP_SCRATCH_BYTES",
    "buffer_nbytes",
    "collate_into_private_memory",
    "private_collate",
    "INBAND_MAX_BYTES",
]
