"""What items cost and what fails to travel: sizes, bounded reprs, and the part of an item
that does not pickle, named for the error message."""

from __future__ import annotations

import pickle
import reprlib

from . import arena, serialize

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 120


def short_repr(x) -> str:
    """A bounded repr for error messages (a unit may hold a million ids)."""
    return _short.repr(x)


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
