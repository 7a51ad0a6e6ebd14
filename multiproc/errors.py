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


class RemoteTraceback(Exception):
    """Holds the formatted traceback of an exception raised in a worker (as ``__cause__``)."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class ExecutorClosedError(ExecutorError):
    """The executor was closed; create a new one (or a new iterator) to continue."""
