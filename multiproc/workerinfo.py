"""What ``torch.utils.data.get_worker_info()`` returns where several readers share a process.

torch keeps the worker info in a module global, which a worker process of torch's owns
alone. Here readers share processes: thread workers beside the consumer's own threads, a
fast start's reads in the consumer's thread, the calls a worker keeps in flight on threads
(:mod:`multiproc.concurrency`, which runs them in its context), an iterable dataset's shards
read by one worker, and a collate that must see no worker at all. So the info is kept per
context (:mod:`contextvars`) too: :func:`install` makes torch's ``get_worker_info`` (every
reference to it, however imported) return the calling context's info where one is set, and
the module global otherwise, as before. Nothing here writes the module global: a setting in
one thread never shows in another, and none outlives its block.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

# The variable's name in torch's worker module, whose globals the getter below runs with.
ATTR = "_ttp_context_worker_info"

_lock = threading.Lock()

# (info,) where this context says what get_worker_info() returns (None included); None where
# the module global decides.
_info: contextvars.ContextVar[tuple[Any] | None] = contextvars.ContextVar(ATTR, default=None)


def _context_aware() -> Any:  # runs with the globals of torch.utils.data._utils.worker
    box = _ttp_context_worker_info.get()  # type: ignore[name-defined]  # noqa: F821 (ATTR)
    return _worker_info if box is None else box[0]  # type: ignore[name-defined]  # noqa: F821


def install() -> None:
    """Make torch's ``get_worker_info`` read the calling context's info first (idempotent)."""
    from torch.utils.data._utils import worker as torch_worker

    if getattr(torch_worker, ATTR, None) is _info:
        return
    assert ATTR in _context_aware.__code__.co_names  # the global _context_aware reads
    with _lock:
        if getattr(torch_worker, ATTR, None) is _info:
            return
        setattr(torch_worker, ATTR, _info)
        torch_worker.get_worker_info.__code__ = _context_aware.__code__


def set_info(info: Any) -> None:
    """From now on, in the calling context (a thread worker's for its life), ``get_worker_info()``
    returns ``info`` (None included), whatever the module global holds."""
    install()
    _info.set((info,))


@contextlib.contextmanager
def info_set(info: Any) -> Iterator[None]:
    """:func:`set_info` for the block only; what the context saw before comes back after."""
    install()
    token = _info.set((info,))
    try:
        yield
    finally:
        _info.reset(token)


def read_with_info(info: Any, it: Iterator[Any]) -> Iterator[Any]:
    """The items of ``it``, each step of it (and its close) run in a context of its own where
    ``get_worker_info()`` returns ``info``: between items the caller sees what it saw before,
    even where ``it`` is a generator that sets context variables of its own."""
    install()
    context = contextvars.copy_context()
    context.run(_info.set, (info,))
    step = it.__next__
    try:
        while True:
            try:
                item = context.run(step)
            except StopIteration:
                return
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            context.run(close)


__all__ = ["ATTR", "info_set", "install", "read_with_info", "set_info"]
