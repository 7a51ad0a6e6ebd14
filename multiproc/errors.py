"""Exceptions raised by the executor. Each says what failed, where, and what to do."""

from __future__ import annotations


class ExecutorError(RuntimeError):
    """Base class of executor failures."""


class SpecError(ValueError):
    """A stage or executor spec is invalid; the message names the stage and argument."""


class StageError(ExecutorError):
    """A stage function raised and its original exception could not be re-raised as is
    (e.g. it does not pickle). The message carries the stage, worker and remote traceback."""


class WorkerDiedError(ExecutorError):
    """Workers died more often than ``max_restarts`` allows (SIGKILL, segfault, OOM kill)."""


class SharedMemoryError(ExecutorError):
    """The shared-memory directory (``/dev/shm``, or ``MULTIPROC_SHM_DIR``) has no room even
    for the executor's counters. The message gives its size and free bytes, and the fixes:
    more room (``docker run --shm-size``) or another directory (``MULTIPROC_SHM_DIR``)."""


class RemoteTraceback(Exception):
    """Holds the formatted traceback of an exception raised in a worker (as ``__cause__``)."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class ExecutorClosedError(ExecutorError):
    """The executor was closed; create a new one (or a new iterator) to continue."""


class TooManyErrorsError(StageError):
    """A stage with ``on_error='skip'`` skipped more than its ``max_errors``. The message has
    the counts and the last errors; fix the data or the stage function, or raise the bound."""


class StageTimeoutError(ExecutorError):
    """A worker stayed in its stage function longer than the stage's ``timeout_s``. The message
    names the stage, the worker, the time and the item or unit; ``stuck`` holds the same as
    :class:`~multiproc.faults.Busy` records."""

    def __init__(self, message: str, stuck: tuple = ()):
        super().__init__(message)
        self.stuck = stuck
