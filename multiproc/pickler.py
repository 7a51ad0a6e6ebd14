"""The pickler of stage functions: cloudpickle, with code objects that keep their file name.

cloudpickle pickles a function or class it cannot import by name (those of ``__main__``, a
notebook's, a closure) by value, and writes ``"<dynamic-code>"`` as the file of every code
object it pickles that way, so that a traceback raised in a worker named
``File "<dynamic-code>", line 8`` and no source line where torch's worker names the script
and shows the line. :class:`StagePickler` pickles code objects with :mod:`marshal` instead,
which keeps every field, the file name included: a worker's traceback reads the line from
that file as this process's would. Workers run this interpreter (forked from it, or spawned
with it), so marshal's per-version format is theirs.
"""

from __future__ import annotations

import marshal
import types
from typing import Any

import cloudpickle


class StagePickler(cloudpickle.CloudPickler):
    """cloudpickle's pickler, but code objects keep their file name (module docstring)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)
