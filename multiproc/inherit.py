"""Objects a worker inherits from its fork server instead of unpickling them.

A thread worker may instead be handed a stage spec itself, unpickled by nobody (:func:`resolve`).

A snapshot (:mod:`multiproc.snapshot`) publishes objects here just before it forks its server,
and pickles stage specs with :class:`RefPickler`, which writes each published object as a
reference. A worker forked from that server resolves them in :func:`loads` from its own copy
of this module's table: the object as this process held it at the fork, open files included.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from .pickler import StagePickler

# key -> objects, as published for a fork (read in workers; written only around a fork).
published: dict[str, tuple[Any, ...]] = {}


class RefPickler(StagePickler):
    """Pickles ``objects`` (published under ``key``) as references, the rest by value."""

    def __init__(self, file: io.BytesIO, key: str, objects: tuple[Any, ...]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._key = key
        self._objects = objects
        self._ids = {id(o): i for i, o in enumerate(objects)}

    def persistent_id(self, obj: Any) -> Any:
        i = self._ids.get(id(obj))
        if i is None or self._objects[i] is not obj:
            return None
        return (self._key, i)


class _RefUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        key, i = pid
        try:
            return published[key][i]
        except KeyError:
            raise RuntimeError(
                f"multiproc: a stage refers to snapshot {key!r}, which this process did not "
                "inherit (a worker of that snapshot's fork server only)"
            ) from None


def loads(data: bytes) -> Any:
    """Unpickle a stage spec made by :class:`RefPickler` (or by plain cloudpickle)."""
    return _RefUnpickler(io.BytesIO(data)).load()


def resolve(form: Any) -> tuple[Any, bool]:
    """A stage spec as a worker is handed it: pickled (``bytes``, unpickled here into the
    worker's own copy, by :func:`loads`), or, for a thread worker, the spec itself, shared with
    the executor's process. Returns the spec and whether it is the worker's own copy."""
    if isinstance(form, bytes):
        return loads(form), True
    return form, False
