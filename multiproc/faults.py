"""What goes wrong, seen by the router: workers stuck in their function, stage timeouts,
errors raised in a worker, and items skipped under ``on_error='skip'``.

:class:`Faults` is the part of :class:`~multiproc.executor.Executor` that says which workers
are inside their stage function and for how long (:meth:`Faults.busy`, from the counters the
workers write), raises :class:`~multiproc.errors.StageTimeoutError` when one passes its
stage's ``timeout_s``, rebuilds a worker's exception for the consumer (its own type, the stage,
worker and remote traceback), and bounds skipped items by ``max_errors``.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass

from . import handles, stats
from .errors import RemoteTraceback, StageError, StageTimeoutError, TooManyErrorsError
from .frames import Unit
from .items import short_repr
from .spec import too_many_errors

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


class Faults:
    """Stuck workers, timeouts, errors and skips (see the module docstring)."""

    def busy(self, min_s: float = 0.0) -> list[Busy]:
        """The workers inside their stage function for at least ``min_s`` now, longest
        first: which stage, worker, for how long, on which item or unit. What to look at when
        nothing comes out."""
        with self._lock:
            if self._closed:
                raise self._closed_error("busy()")
            return self._busy(time.monotonic_ns(), min_s)

    def _busy(self, now: int, min_s: float, stages: set | None = None) -> list[Busy]:
        out = []
        for h in self._workers.values():
            if not h.alive() or (stages is not None and h.stage not in stages):
                continue
            row = self._counters.row(h.slot)
            since, work_id, item = (int(v) for v in row[stats.IN_FN_SINCE_NS : stats.WORK_ITEM + 1])
            secs = (now - since) / 1e9
            if not since or secs < min_s:
                continue
            out.append(Busy(self._names[h.stage], h.wid, h.pid, secs, self._work(h, work_id, item)))
        return sorted(out, key=lambda b: -b.seconds)

    def _work(self, h: handles.WorkerHandle, work_id: int, item: int) -> str:
        if not work_id:
            return "its current work"
        held = h.inflight.get(work_id - 1)
        if isinstance(held, Unit):
            at = f", at or after its item {item - 1}" if item > 1 else ""
            return f"work unit {short_repr(held.unit)}{at}"
        at = f"item {item - 1} of " if item else ""
        return f"{at}frame {work_id - 1}"

    def _on_skipped(
        self, h: handles.WorkerHandle, where: str, tname: str, text: str, j: int
    ) -> None:
        """Count a skip of stage ``j`` (on_error='skip', run by worker ``h`` of that stage or
        of its fusion host); log the first; past max_errors, fail the run."""
        s = self.spec.stages[j]
        st = self._stages[j]
        st.skipped += 1
        st.last_errors.append(f"worker {h.wid}, {where}: {tname}: {text}")
        if st.skipped == 1:
            log.warning(
                "stage %r skipped an item (on_error='skip'; more are counted in the stage's "
                "errors): worker %d, %s: %s: %s", s.name, h.wid, where, tname, text,
            )  # fmt: skip
        items_in = sum(int(self._counters.row(slot)[stats.ITEMS_IN]) for slot in st.slots)
        if st.retired is not None:
            items_in += int(st.retired[stats.ITEMS_IN])
        items_in += sum(r.items_in for r in self._fused_rows(j, 0))
        if self._error is None and too_many_errors(st.skipped, items_in, s.max_errors):
            last = "; ".join(st.last_errors)
            self._error = TooManyErrorsError(
                f"stage {s.name!r}: {st.skipped} items skipped of {items_in} taken in, more "
                f"than max_errors={s.max_errors!r} allows; last errors: {last}"
            )

    def _make_error(self, stage: str, h, exc_bytes, tname, text, tb, where) -> BaseException:
        note = f"in stage {stage!r}, worker {h.wid} (pid {h.pid}), {where}"
        exc = None
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
        return exc

    def _next_deadline_s(self, live: list) -> float | None:
        """Seconds until a busy worker of a stage with ``timeout_s`` would pass it."""
        if not self._timeouts or self._error is not None:
            return None
        now = time.monotonic_ns()
        soonest = None
        for h in live:
            limit = self._timeouts.get(h.stage)
            if limit is None or not h.inflight:
                continue
            since = int(self._counters.row(h.slot)[stats.IN_FN_SINCE_NS])
            left = limit - (now - since) / 1e9 if since else limit
            soonest = left if soonest is None else min(soonest, left)
        return None if soonest is None else max(soonest, 0.005)

    def _check_timeouts(self) -> None:
        limits = self._timeouts
        if not limits or self._error is not None:
            return
        busy = self._busy(time.monotonic_ns(), min(limits.values()), set(limits))
        stuck = [b for b in busy if b.seconds > limits[self._names.index(b.stage)]]
        if stuck:
            b = stuck[0]
            limit = limits[self._names.index(b.stage)]
            self._error = StageTimeoutError(
                f"{b} (timeout_s={limit:g}); it is stopped when the executor closes", tuple(stuck)
            )
