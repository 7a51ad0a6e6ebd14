"""Checking a saved loader state before it is trusted: its shape, types and ranges, and a
fingerprint of the pipeline and source that saved it.

A state is plain data (it may have gone through JSON, which turns int keys into strings), so
each field is checked and the first bad one is named in a :class:`StateError`. Checks that
need the epoch's units (positions past a unit's end, units past the epoch's count) run when
the epoch starts: see :func:`torchtune_pipe._progress.plan_epoch` and :func:`torchtune_pipe.sources.read_indexed`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from .errors import StateError

_WHERE = "Loader.load_state_dict()"


def source_fingerprint(source: Any) -> str:
    """The source's own ``fingerprint()`` where it offers one, else its type and length."""
    own = getattr(source, "fingerprint", None)
    if callable(own):
        return str(own())
    parts = [f"{type(source).__module__}.{type(source).__qualname__}"]
    try:
        parts.append(f"len={len(source)}")
    except TypeError:
        pass
    return ":".join(parts)


def fingerprint(pipeline: Any) -> str:
    """What must match between the loader that saved a state and the one loading it: the
    source (:func:`source_fingerprint`) and the stages that hold items (shuffle buffers and
    seeds, batch sizes). Map stages, worker counts and buffer budgets are left out: they do
    not change which item a position names, so a state loads under any allocation."""
    parts = [source_fingerprint(pipeline.source)]
    for st in pipeline.stages:
        if st.stateful:
            parts.append(f"{st.kind}:{st.size}:{st.drop_last}:{st.buffer}:{st.seed}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _int(value: Any, field: str, low: int) -> int:
    """``field`` as it reads after ``state``: ``['epoch']``, ``['partial'][3]``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise StateError(f"{_WHERE}: state{field} must hold ints >= {low}, got {value!r}")
    return value


def _positions(value: Any, field: str) -> list[int]:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise StateError(
            f"{_WHERE}: state{field} must be a list of positions, got {type(value).__name__}"
        )
    out = [_int(v, field, 0) for v in value]
    if len(set(out)) != len(out):
        raise StateError(f"{_WHERE}: state{field} lists a position twice")
    return out


def check(state: Any, version: int, expected_fingerprint: str) -> dict:
    """A validated copy of ``state`` (keys of ``partial`` as ints).

    Raises:
        StateError: naming the first field that is missing, of the wrong type or out of
            range, or a fingerprint of another pipeline or source.
    """
    if not isinstance(state, Mapping) or state.get("version") != version:
        raise StateError(
            f"{_WHERE}: expected a state of version {version} from Loader.state_dict(), got "
            f"{type(state).__name__}"
            + (f" of version {state.get('version')!r}" if isinstance(state, Mapping) else "")
        )
    missing = {"epoch", "finished", "done", "partial", "delivered", "last_unit"} - set(state)
    if missing:
        raise StateError(f"{_WHERE}: state lacks {sorted(missing)}")
    saved = state.get("fingerprint")
    if saved is not None and saved != expected_fingerprint:
        raise StateError(
            f"{_WHERE}: state['fingerprint'] is {saved!r}, this loader's is "
            f"{expected_fingerprint!r}: the state was saved by another pipeline or source "
            "(stages, batch sizes, shuffle seeds or the source's type or length differ)"
        )
    out = dict(state)
    _int(state["epoch"], "['epoch']", 0)
    if not isinstance(state["finished"], bool):
        raise StateError(f"{_WHERE}: state['finished'] must be a bool, got {state['finished']!r}")
    done = _positions(state["done"], "['done']")
    _int(state["delivered"], "['delivered']", 0)
    _int(state["last_unit"], "['last_unit']", -1)
    if not isinstance(state["partial"], Mapping):
        raise StateError(
            f"{_WHERE}: state['partial'] must map units to positions, got "
            f"{type(state['partial']).__name__}"
        )
    partial = {}
    for u, ks in state["partial"].items():
        try:
            unit = int(u)  # JSON turns the int keys into strings
        except (TypeError, ValueError):
            raise StateError(
                f"{_WHERE}: state['partial'] has a key {u!r} that is no unit"
            ) from None
        field = f"['partial'][{unit}]"
        _int(unit, "['partial'] keys", 0)
        if unit in done:
            raise StateError(f"{_WHERE}: unit {unit} is both in state['done'] and state['partial']")
        partial[unit] = _positions(ks, field)
    out["partial"] = partial
    return out
