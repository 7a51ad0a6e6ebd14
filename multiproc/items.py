"""What items cost and what fails to travel: sizes, bounded reprs, and the part of an item
that does not pickle, named for the error message."""

from __future__ import annotations

import itertools
import pickle
import reprlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from . import arena, serialize

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 120


def short_repr(x) -> str:
    """A bounded repr for error messages (a unit may hold a million ids)."""
    return _short.repr(x)


# Sizing a frame walks its first item instead of pickling it: pickling a batch of 128 samples
# (tensor views) only to measure it cost 1.5 ms, twenty times collating them. A long container
# is measured by its first elements, the rest taken to be alike; an object that is neither a
# container nor an array is pickled.
_SAMPLED = 16
_MAX_DEPTH = 6
_SCALAR_BYTES = 16


def estimated_size(item, depth: int = 0) -> int:
    """About the serialized size of one item, in bytes, without serializing it: arrays and
    tensors by their ``nbytes`` (a view's own bytes: that is what travels), strings and bytes
    by their length, containers by their elements (a long one by its first
    :data:`_SAMPLED`), anything else by pickling it (:func:`serialized_size`). The same item
    always gets the same estimate."""
    t = type(item)
    if t is int or t is float or t is bool or item is None:
        return _SCALAR_BYTES
    if t is str or t is bytes or t is bytearray:
        return len(item) + _SCALAR_BYTES
    try:
        nbytes = getattr(item, "nbytes", None)  # numpy arrays, torch tensors, memoryviews
    except RuntimeError:  # a sparse tensor's raises: measured by pickling, below
        nbytes = None
    if type(nbytes) is int:
        return nbytes + 4 * _SCALAR_BYTES
    if depth < _MAX_DEPTH and isinstance(item, (list, tuple, dict)):
        values = item.values() if isinstance(item, dict) else item
        n = len(values)
        head = list(itertools.islice(values, _SAMPLED))
        size = sum(estimated_size(x, depth + 1) for x in head)
        if isinstance(item, dict):
            size += sum(estimated_size(k, depth + 1) for k in itertools.islice(item, _SAMPLED))
        return _SCALAR_BYTES + (size * n // len(head) if head else 0)
    return serialized_size(item)


def own_memory(x: Any, depth: int = 0) -> Any:
    """``x`` with every tensor or array that views memory it does not own (a row of a
    dataset's tensor, a slice of a memory map) replaced by a copy: what a worker process's
    output is once it has crossed to the consumer. Containers (lists, tuples, dicts) are
    rebuilt only where something inside them was copied; anything else is left as it is."""
    if isinstance(x, torch.Tensor):
        return x.clone() if x._base is not None else x
    if isinstance(x, np.ndarray):
        return x.copy() if x.base is not None else x
    t = type(x)
    if depth < _MAX_DEPTH:
        if t is list or t is tuple:
            out = [own_memory(v, depth + 1) for v in x]
            return x if all(a is b for a, b in zip(out, x, strict=True)) else t(out)
        if t is dict:
            got = {k: own_memory(v, depth + 1) for k, v in x.items()}
            return x if all(got[k] is v for k, v in x.items()) else got
    return x


def serialized_size(item) -> int:
    """Serialized size of one item (its out-of-band buffers are not copied to measure it)."""
    try:
        header, buffers = serialize.dumps(item)
    except Exception:
        return 0  # reported with its place when its frame is encoded
    return len(header) + sum(serialize.buffer_nbytes(buffers))


def exc_payload(exc: BaseException) -> bytes | None:
    """The pickled exception, when it pickles and unpickles (None: send its text only)."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:
        return None


def unpicklable(items: list) -> dict[int, tuple[str, str, BaseException]]:
    """The items of a frame that do not pickle: index -> (path to the first part that does
    not, its type name, the error). Runs only after a frame failed to encode."""
    bad = {}
    for i, x in enumerate(items):
        err = _pickle_error(x)
        if err is not None:
            path, part, err = _culprit(x, err)
            bad[i] = (path, f"a {type(part).__module__}.{type(part).__qualname__}", err)
    return bad


def _pickle_error(x) -> BaseException | None:
    try:
        arena.encode([x], None, None)
        return None
    except Exception as e:
        return e


def _culprit(x, err: BaseException, depth: int = 0) -> tuple[str, object, BaseException]:
    """Descend into containers to the innermost part that does not pickle."""
    if depth < 6:
        parts: Iterable[tuple[Any, Any]]
        if isinstance(x, (list, tuple)):
            parts = enumerate(x)
        elif isinstance(x, dict):
            parts = x.items()
        else:
            parts = ()
        for key, part in parts:
            e = _pickle_error(part)
            if e is not None:
                path, inner, e = _culprit(part, e, depth + 1)
                return f"[{key!r}]{path}", inner, e
    return "", x, err
