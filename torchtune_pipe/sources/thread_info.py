"""What ``torch.utils.data.get_worker_info()`` returns on a thread worker.

torch keeps the worker info in a module global, which a worker process owns alone. Thread
workers share the consumer's process, so each needs its own: :func:`set_thread_info` keeps it
per thread, and :func:`install` makes torch's ``get_worker_info`` (every reference to it,
however imported) return the calling thread's info where one is set, and the module global
otherwise, as before. The info is a context variable (:mod:`contextvars`), so the calls a
thread worker keeps in flight on threads of its own (:mod:`multiproc.concurrency`, which runs
them in its context) see it too. So the consumer's own threads still see ``None``, and a thread worker
sees its worker's id, count, seed and dataset, as it would in a worker process.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

from multiproc.serialize import THREAD_INFO_ATTR as _NAME  # the variable, in torch's worker module

_lock = threading.Lock()


_info: contextvars.ContextVar[Any] = contextvars.ContextVar("ttp_thread_worker_info", default=None)


def _thread_aware() -> Any:  # runs with the globals of torch.utils.data._utils.worker
    info = _ttp_thread_worker_info.get()  # noqa: F821  (the global named _NAME)
    return _worker_info if info is None else info  # noqa: F821


def install() -> None:
    """Make torch's ``get_worker_info`` read the calling thread's info first (idempotent)."""
    from torch.utils.data._utils import worker as torch_worker

    assert _NAME in _thread_aware.__code__.co_names  # the global _thread_aware reads
    with _lock:
        if hasattr(torch_worker, _NAME):
            return
        setattr(torch_worker, _NAME, _info)
        torch_worker.get_worker_info.__code__ = _thread_aware.__code__


def set_thread_info(info: Any) -> None:
    """Set (None: clear) the calling thread's worker info (in its current context)."""
    install()
    _info.set(info)
