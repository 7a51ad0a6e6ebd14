"""Exceptions raised by torchtune_pipe.

Every error of the library derives from :class:`TorchtunePipeError`, so callers can catch the
library's failures in one ``except`` clause. Each class also derives from the builtin that
describes the kind of failure (``ValueError`` for bad data), so code written against plain
Python exceptions keeps working.
"""

from __future__ import annotations

from collections.abc import Mapping


class TorchtunePipeError(Exception):
    """Base class of every error raised by torchtune_pipe."""


class SourceError(TorchtunePipeError, ValueError):
    """A source could not turn its input into items (a malformed line, an unreadable file).

    The message names the file and the 1-based line number when they are known; the
    original exception is chained as ``__cause__``. Fix the input, or construct the source
    with ``on_error="skip"`` to drop bad lines and count them.

    Attributes:
        path: the file that holds the bad input, or None.
        line: 1-based line number in ``path``, or None.
    """

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        super().__init__(message)
        self.path = path
        self.line = line

    def __reduce__(self):
        # Keep path/line when the error crosses a process boundary.
        return (_rebuild_source_error, (str(self), self.path, self.line))


def _rebuild_source_error(message: str, path: str | None, line: int | None) -> SourceError:
    return SourceError(message, path=path, line=line)


class BadLinesError(TorchtunePipeError, ValueError):
    """Raised by a batch line parser to say which lines of its batch are malformed.

    A parser given to ``LineFileSource(parse_batch=...)`` raises this instead of a bare
    exception so that the source can name the exact file and line, or drop just those lines
    under ``on_error="skip"``, without re-parsing the batch line by line.

    Attributes:
        reasons: maps the 0-based index of each bad line in the batch to why it is bad.
    """

    def __init__(self, reasons: Mapping[int, str]):
        if not reasons:
            raise ValueError("BadLinesError(): reasons must name at least one line")
        self.reasons = dict(sorted(reasons.items()))
        first, why = next(iter(self.reasons.items()))
        more = f" (and {len(self.reasons) - 1} more)" if len(self.reasons) > 1 else ""
        super().__init__(f"line {first} of the batch: {why}{more}")

    def __reduce__(self):
        return (BadLinesError, (self.reasons,))


class PipelineError(TorchtunePipeError, ValueError):
    """A pipeline is invalid; raised when it is built, naming the stage and the argument.

    Fix the argument the message names (e.g. ``batch('batch'): size must be a positive int,
    got 0``).
    """


class LoaderTimeoutError(TorchtunePipeError, RuntimeError):
    """No item arrived within the loader's ``timeout_s``. The message names the workers inside
    their stage function the longest (stage, worker, seconds, item or unit); ``stuck`` holds
    them as :class:`multiproc.Busy`. Fix the stage, or raise the timeout."""

    stuck: tuple = ()


class RemoteStageError(TorchtunePipeError, RuntimeError):
    """A stage with ``placement="ray"`` could not run its work remotely: Ray is not installed
    (``pip install torchtune-pipe[ray]``), or a frame's Ray actor died twice (the message
    names the frame's items and the actors; check their logs for out-of-memory kills or a
    lost node)."""


class StateError(TorchtunePipeError, ValueError):
    """A saved loader state does not fit this loader (another pipeline or source); load a
    state saved by the same pipeline."""
