"""The messages between the router and a worker, one class each.

On the wire a message is a plain tuple ``(TAG, *fields)`` (:func:`wire`): a tuple pickles
several times faster than a named tuple, and a router handles one or more messages per frame.
:func:`read` turns a received tuple back into its class, so both sides name every field.

Router -> worker: :class:`Run`, :class:`Unit`, :class:`Flush`, :class:`Retire`, :class:`Free`,
:class:`Budget`, :class:`Concurrency`, :class:`Fuse`, :class:`SpillOk`, :class:`Drop`,
:class:`Epoch`, :class:`Exit`.

Worker -> router: :class:`Hello`, :class:`Emit`, :class:`UnitDone`, :class:`Done`,
:class:`Flushed`, :class:`Handoff`, :class:`Frees`, :class:`Blocked`, :class:`Unblocked`,
:class:`Bye`, :class:`Error`, :class:`Skipped`.

A worker commits its outputs and the release of its input in one message (``Done``,
``UnitDone``), so whatever a dead worker held can be delivered again exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

_M = TypeVar("_M")

_BY_TAG: dict[str, Any] = {}  # tag on the wire -> message class, filled by _tagged


def _tagged(tag: str) -> Callable[[type[_M]], type[_M]]:
    """Give a message class its tag on the wire (a class attribute ``TAG``, not a field)."""

    def put(cls: type[_M]) -> type[_M]:
        setattr(cls, "TAG", tag)  # noqa: B010 -- written in the body, it would be a field to mypy
        _BY_TAG[tag] = cls
        return cls

    return put


# ------------------------------------------------------------------- router -> worker


@_tagged("run")
class Run(NamedTuple):
    """Run the stage function over a frame; ``skip``: item positions already consumed."""

    frame_id: int
    payload: Any
    skip: frozenset


@_tagged("unit")
class Unit(NamedTuple):
    """Read a work unit (source stages); its first ``skip_frames`` frames are committed."""

    unit_id: int
    unit: Any
    skip_frames: int


@_tagged("flush")
class Flush(NamedTuple):
    """Input is exhausted: a stateful stage emits what it still holds."""


@_tagged("retire")
class Retire(NamedTuple):
    """Finish what is held, hand a stateful stage's items back, say :class:`Bye`, end."""


@_tagged("free")
class Free(NamedTuple):
    """Arena blocks (offsets) consumers no longer use."""

    offsets: list


@_tagged("budget")
class Budget(NamedTuple):
    """This worker's new share of its stage's byte budget (its arena's limit)."""

    nbytes: int


@_tagged("concurrency")
class Concurrency(NamedTuple):
    """Calls of the stage function in flight in this worker."""

    n: int


@_tagged("fuse")
class Fuse(NamedTuple):
    """Run the next ``depth`` stages' functions too, on this stage's outputs (fusion)."""

    depth: int


@_tagged("spill_ok")
class SpillOk(NamedTuple):
    """A blocked worker may send its frame without room in its arena, in a segment of its own
    (see ``policy``, :mod:`multiproc.spill`)."""


@_tagged("drop")
class Drop(NamedTuple):
    """Unmap another worker's arena (that worker is gone)."""

    segment: str


@_tagged("epoch")
class Epoch(NamedTuple):
    """A new epoch starts: stateful stages build a fresh reducer seeded by it."""

    epoch: int


@_tagged("exit")
class Exit(NamedTuple):
    """End now (the executor closes)."""


# ------------------------------------------------------------------- worker -> router


@_tagged("hello")
class Hello(NamedTuple):
    """The worker runs and takes work."""

    wid: int
    pid: int


@_tagged("emit")
class Emit(NamedTuple):
    """A source committed frame ``k`` of a unit (``n`` items), the output of the stage
    ``depth`` after its own (0: its own; more when stages are fused into it)."""

    wid: int
    unit_id: int
    k: int
    payload: Any
    n: int
    depth: int


@_tagged("unit_done")
class UnitDone(NamedTuple):
    """A source finished a unit of ``frames`` frames; it reads ``ahead`` units at once now
    (:mod:`multiproc.readahead`: the router keeps one more than that in flight to it)."""

    wid: int
    unit_id: int
    frames: int
    frees: list
    ahead: int = 1


@_tagged("done")
class Done(NamedTuple):
    """A frame is done: its outputs ``[(payload, n)]`` (made by the stage ``depth`` after
    the worker's own, see :class:`Emit`) and, for stateful stages, the input items now fully
    consumed (``{frame_id: [positions]}``)."""

    wid: int
    frame_id: int | None
    outs: list
    consumed: dict | None
    frees: list
    depth: int = 0


@_tagged("flushed")
class Flushed(NamedTuple):
    """A stateful stage's last outputs, after :class:`Flush` (fields as :class:`Done`)."""

    wid: int
    frame_id: None
    outs: list
    consumed: dict | None
    frees: list


@_tagged("handoff")
class Handoff(NamedTuple):
    """A retiring stateful worker gives its held items back (fields as :class:`Done`)."""

    wid: int
    frame_id: None
    outs: list
    consumed: dict | None
    frees: list


@_tagged("frees")
class Frees(NamedTuple):
    """Arena blocks of other workers this worker no longer uses."""

    wid: int
    frees: list


@_tagged("blocked")
class Blocked(NamedTuple):
    """The worker's next frame does not fit its arena; it waits (see ``policy``).
    ``no_room``: the arena had room under the budget, but the shared-memory directory had no
    pages for it (:mod:`multiproc.shm`)."""

    wid: int
    frees: list
    no_room: bool = False


@_tagged("unblocked")
class Unblocked(NamedTuple):
    """Room appeared before the router let the frame through."""

    wid: int


@_tagged("bye")
class Bye(NamedTuple):
    """A retiring worker is done."""

    wid: int
    frees: list


@_tagged("error")
class Error(NamedTuple):
    """The stage function raised (``on_error='raise'``), or the worker could not start."""

    wid: int
    work_id: int | None
    exc: bytes | None  # the pickled exception, when it pickles
    type_name: str
    text: str
    traceback: str
    where: str
    depth: int = 0  # whose function: the stage this many after the worker's own


@_tagged("skipped")
class Skipped(NamedTuple):
    """An item was dropped under ``on_error='skip'``."""

    wid: int
    where: str
    type_name: str
    text: str
    depth: int = 0  # whose function: the stage this many after the worker's own


def wire(msg: NamedTuple) -> tuple:
    """The tuple that travels: ``(TAG, *fields)``."""
    return (msg.TAG, *msg)  # type: ignore[attr-defined]


def read(msg: tuple) -> Any:
    """The message class instance of a received tuple.

    Raises:
        ValueError: an unknown tag (a peer of another version, or a bug).
    """
    cls = _BY_TAG.get(msg[0])
    if cls is None:
        raise ValueError(f"unknown message {msg[0]!r}")
    return cls._make(msg[1:])
