"""What goes wrong, seen by the router: workers stuck in their function, stage timeouts,
errors raised in a worker, and items skipped under ``on_error='skip'``.

:class:`FaultHandler` says which workers are inside their stage function and for how long
(:meth:`FaultHandler.busy`, from the counters the workers write), raises
:class:`~multiproc.errors.StageTimeoutError` when one passes its stage's ``timeout_s``
(:func:`multiproc.policy.overdue`), rebuilds a worker's exception for the consumer (its own
type, the stage, worker and remote traceback), and bounds skipped items by ``max_errors``.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass
from typing import Any

from . import handles, policy, stats
from .errors import RemoteTraceback, StageError, StageTimeoutError, TooManyErrorsError
from .fusion import FusionControl
from .spec import too_many_errors
from .state import ExecutorState

log = logging.getLogger("multiproc.executor")


@dataclass(frozen=True)
class Busy:
    """A worker inside its stage function now (see :meth:`Executor.busy`)."""

    stage: str
    worker: int
    pid: int
    seconds: float  # in the function, on this frame or unit
    work: str  # the item, frame or unit, in words

    def __str__(self) -> str:
        return (
            f"stage {self.stage!r} worker {self.worker} (pid {self.pid}) has been in its "
            f"function for {self.seconds:.1f} s on {self.work}"
        )


class FaultHandler:
    """Stuck workers, timeouts, errors and skips (see the module docstring). Callers hold the
    executor's lock."""

    def __init__(self, state: ExecutorState, fusion: FusionControl) -> None:
        self.state = state
        self.fusion = fusion
        # Stage name -> its timeout_s, for the stages that have one; and those stages.
        self.limits = {s.name: s.timeout_s for s in state.spec.stages if s.timeout_s}
        self.timed = {i for i, s in enumerate(state.spec.stages) if s.timeout_s}

    def busy(self, now: int, min_s: float, stages: set[int] | None = None) -> list[Busy]:
        """The workers (of ``stages``; None: all) inside their stage function for at least
        ``min_s`` at ``now`` (``monotonic_ns``), longest first."""
        state = self.state
        out = []
        for h in state.workers.values():
            if not h.alive() or (stages is not None and h.stage not in stages):
                continue
            row = state.counters.row(h.slot)
            since, work_id, item = (int(v) for v in row[stats.IN_FN_SINCE_NS : stats.WORK_ITEM + 1])
            secs = (now - since) / 1e9
            if not since or secs < min_s:
                continue
            name = state.names[h.stage]
            out.append(Busy(name, h.wid, h.pid, secs, handles.describe_work(h, work_id, item)))
        return sorted(out, key=lambda b: -b.seconds)

    def on_skipped(
        self, h: handles.WorkerHandle, where: str, tname: str, text: str, j: int
    ) -> None:
        """Count a skip of stage ``j`` (on_error='skip', run by worker ``h`` of that stage or
        of its fusion host); log the first; past max_errors, fail the run."""
        state = self.state
        s = state.spec.stages[j]
        st = state.stages[j]
        st.skipped += 1
        st.last_errors.append(f"worker {h.wid}, {where}: {tname}: {text}")
        if st.skipped == 1:
            log.warning(
                "stage %r skipped an item (on_error='skip'; more are counted in the stage's "
                "errors): worker %d, %s: %s: %s", s.name, h.wid, where, tname, text,
            )  # fmt: skip
        items_in = sum(int(state.counters.row(slot)[stats.ITEMS_IN]) for slot in st.slots)
        if st.retired is not None:
            items_in += int(st.retired[stats.ITEMS_IN])
        items_in += sum(r.items_in for r in self.fusion.fused_rows(j, 0))
        if state.error is None and too_many_errors(st.skipped, items_in, s.max_errors):
            last = "; ".join(st.last_errors)
            state.error = TooManyErrorsError(
                f"stage {s.name!r}: {st.skipped} items skipped of {items_in} taken in, more "
                f"than max_errors={s.max_errors!r} allows; last errors: {last}"
            )

    def on_error(
        self,
        stage: str,
        h: handles.WorkerHandle,
        exc_bytes: bytes | None,
        tname: str,
        text: str,
        tb: str,
        where: str,
    ) -> None:
        """Worker ``h`` raised in stage ``stage``'s function: the consumer gets its exception
        (its own type, with a note naming the stage, worker and process, and the worker's
        traceback as its cause; a :class:`StageError` when it does not unpickle)."""
        note = f"in stage {stage!r}, worker {h.wid} (pid {h.pid}), {where}"
        # Whatever type the worker raised: the stage and worker ride on it as attributes.
        exc: Any = None
        if exc_bytes is not None:
            try:
                exc = pickle.loads(exc_bytes)
            except Exception:
                exc = None
        if exc is None:
            exc = StageError(f"{tname}: {text} ({note})")
        exc.__cause__ = RemoteTraceback(f'\n"""\n{tb}"""')
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised {note}")
        exc.stage = stage
        exc.worker = h.wid
        self.state.error = exc

    def next_deadline_s(self, live: list[handles.WorkerHandle]) -> float | None:
        """Seconds until a busy worker of ``live`` in a stage with ``timeout_s`` would pass it."""
        state = self.state
        if not self.limits or state.error is not None:
            return None
        clocks = [
            (
                self.limits[state.names[h.stage]],
                int(state.counters.row(h.slot)[stats.IN_FN_SINCE_NS]),
            )
            for h in live
            if h.inflight and state.names[h.stage] in self.limits
        ]
        return policy.next_deadline_s(time.monotonic_ns(), clocks)

    def check_timeouts(self) -> None:
        """Fail the run when a worker has been in its function past its stage's timeout_s."""
        state, limits = self.state, self.limits
        if not limits or state.error is not None:
            return
        busy = self.busy(time.monotonic_ns(), min(limits.values()), self.timed)
        stuck = policy.overdue(busy, limits)
        if stuck:
            b = stuck[0]
            state.error = StageTimeoutError(
                f"{b} (timeout_s={limits[b.stage]:g}); it is stopped when the executor closes",
                tuple(stuck),
            )
