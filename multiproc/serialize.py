"""Pickle protocol 5 with out-of-band buffers for tensors and arrays.

`dumps` splits an object into a small pickled header plus the raw buffers of its CPU tensors
and numpy arrays, without copying them. The caller copies those buffers once into a
shared-memory arena; `loads` rebuilds the object with tensors and arrays that *view* the
arena (no copy on the consumer side).

torch's own pickling of a tensor goes through ``torch.save`` of its storage into a bytes
object, which copies every payload; a ``reducer_override`` turns dense CPU tensors into a
raw byte buffer plus (dtype, shape, stride, offset) instead.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any

import torch

# Buffers smaller than this stay inside the header: copying a few hundred bytes in-band is
# cheaper than an arena slot for them.
INBAND_MAX_BYTES = 1024


def _rebuild_tensor(buf, dtype: torch.dtype, shape, stride, offset: int, requires_grad: bool):
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


def _reduce_tensor(t: torch.Tensor):
    """Reduce a dense CPU tensor to its storage bytes (as a PickleBuffer) plus geometry."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    # Only the bytes the view can touch are sent: a small view of a huge tensor must not ship
    # the whole storage.
    if t.numel() == 0:
        return _rebuild_tensor, (
            bytearray(),
            t.dtype,
            tuple(t.shape),
            tuple(t.stride()),
            0,
            t.requires_grad,
        )
    itemsize = t.element_size()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    if span * itemsize < nbytes // 2 or not t.is_contiguous():
        t = t.detach().contiguous()
        storage = t.untyped_storage()
        offset = 0
    else:
        offset = t.storage_offset()
    base = torch.empty(0, dtype=torch.uint8).set_(storage)
    arr = base.numpy() if not t.requires_grad else base.detach().numpy()
    return _rebuild_tensor, (
        pickle.PickleBuffer(arr),
        t.dtype,
        tuple(t.shape),
        tuple(t.stride()),
        offset,
        t.requires_grad,
    )


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
            return _reduce_tensor(obj)
        return NotImplemented


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


__all__ = ["dumps", "loads", "copy_into", "buffer_nbytes", "INBAND_MAX_BYTES"]
