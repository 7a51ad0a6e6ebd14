"""Drive a tuner against a :class:`~.base.Tunable`: a background thread, or synchronously.

:class:`TuningLoop` is the daemon thread that runs beside training: at every interval it
observes, asks the tuner and applies the decision through :class:`~.safety.Guarded` (the hard
limits, once), logging every decision as one JSON line. :func:`run_episode` does the same
steps back to back with no waiting: the one episode loop of the simulator's studies,
pre-training and held-out evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from torchtune_pipe.tuning.base import (
    Allocation,
    ExecutorClosedError,
    Observation,
    StageStats,
    Tunable,
    Tuner,
)
from torchtune_pipe.tuning.safety import Guarded, LimitsFn

log = logging.getLogger(__name__)


def _tuner_name(tuner: Tuner) -> str:
    return str(getattr(tuner, "name", type(tuner).__name__))


def run_episode(
    tunable: Tunable,
    tuner: Tuner,
    steps: int,
    *,
    start: Allocation | None = None,
    on_step: Callable[[Observation], None] | None = None,
    limits_fn: LimitsFn | None = None,
) -> list[Observation]:
    """Run ``reset`` then ``steps`` tuning steps back to back, without waiting.

    The first observation goes to ``tuner.reset(obs, start)``; then each step observes (a
    simulator advances one interval), calls ``on_step(obs)``, asks the tuner and applies its
    decision through :class:`~.safety.Guarded`. After an observation with ``oom`` set the
    tuner still steps on it (a learner sees the outcome) but the episode ends: the pipeline
    is dead.

    Args:
        tunable: the pipeline or simulator (wrapped in :class:`~.safety.Guarded` unless it is).
        tuner: the tuner deciding allocations.
        steps: tuning steps after the reset.
        start: passed to ``tuner.reset`` (a random start in pre-training).
        on_step: called with each observation before the tuner steps on it.
        limits_fn: hard limits for an observation (default: those the observation implies).

    Returns:
        The observations the tuner stepped on, in order (at most ``steps``; the reset's
        observation is not among them).

    Example:
        >>> trace = run_episode(SimPipeline(workload, cpus=16, memory_limit_bytes=8 << 30),
        ...                     make_tuner("plumber"), steps=100)
    """
    if steps < 0:
        raise ValueError(f"run_episode(): steps must be >= 0, got {steps}")
    pipe = Guarded(tunable, limits_fn)
    pipe.apply(tuner.reset(pipe.observe(), start=start))
    trace: list[Observation] = []
    for _ in range(steps):
        obs = pipe.observe()
        trace.append(obs)
        if on_step is not None:
            on_step(obs)
        decision = tuner.step(obs)
        if obs.oom:
            break
        pipe.apply(decision)
    return trace


# An observation's own fields, as a decision's record holds them (its stages and time apart).
_OBS_FIELDS = tuple(
    f.name for f in dataclasses.fields(Observation) if f.name not in ("stages", "t")
)


def _stage_record(s: StageStats) -> dict:
    """Every field of ``s`` (a float to 4 significant digits: a stage's CPU seconds per item
    are microseconds), so that :func:`observation` gives back what the tuner saw."""
    return {
        f.name: float(f"{v:.4g}") if isinstance(v, float) else v
        for f in dataclasses.fields(s)
        if (v := getattr(s, f.name)) is not None
    }


def read_log(path: str | os.PathLike) -> list[dict]:
    """The decisions of a tuning log (one JSON object per line, as :class:`TuningLoop` writes
    them); a line cut short by a writer still running is left out.

    Raises:
        ValueError: the file holds no decision.
    """
    records = []
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "obs" in record:
                records.append(record)
            elif isinstance(record, dict) and "event" in record:
                events.append(record)
    if not records:
        why = f": {events[-1].get('message', events[-1]['event'])}" if events else ""
        raise ValueError(f"read_log(): {os.fspath(path)} holds no tuning decision{why}")
    return records


def write_event(path: str | os.PathLike, event: str, message: str) -> None:
    """Append an event that is not a decision to a tuning log (``{"event", "message", "wall"}``;
    :func:`read_log` skips it, and names the last one when the log has no decision)."""
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps({"event": event, "message": message, "wall": time.time()}) + "\n")


def note_event(path: str | os.PathLike | None, event: str, message: str) -> None:
    """:func:`write_event` where there is a tuning log (``path`` not None), a warning where it
    cannot be written (the tuning loop names the path when it starts)."""
    if not path:
        return
    try:
        write_event(path, event, message)
    except OSError as e:
        log.warning("cannot write to tuning_log %r: %s", str(path), e)


def observation(record: dict) -> Observation:
    """The :class:`~.base.Observation` a tuning-log record was decided on (stages unnamed
    ``stage0``, ``stage1``... in logs written before records carried their stages), to show it
    or replay it through a tuner or the planner (``tuning.planner.plan``)."""
    o = record["obs"]
    stages = o.get("stages") or [
        {"name": f"stage{i}", "workers": w, "buffer_bytes": b, "busy": u}
        for i, (w, b, u) in enumerate(zip(o["workers"], o["buffer_bytes"], o["busy"], strict=False))
    ]
    # Logs written before held only some of the fields: the others keep their defaults.
    fields = {f: o[f] for f in _OBS_FIELDS if f in o}
    fields.update(
        throughput=float(o["throughput"]),
        cpus=float(o["cpus"]),
        memory_limit_bytes=int(o["memory_limit_bytes"]),
        memory_used_bytes=int(o["memory_used_bytes"]),
        consumer_step_s=float(o.get("consumer_step_s", 0.0)),
        oom=bool(o.get("oom", False)),
    )
    return Observation(
        stages=tuple(StageStats(**s) for s in stages), t=float(record.get("t", 0.0)), **fields
    )


class TuningLoop:
    """A daemon thread that observes, tunes, clamps and applies every ``interval_s``.

    An exception from the tunable or the tuner is logged, ends the loop, and is raised again
    by :meth:`stop`; it is never swallowed.

    Args:
        tunable: the pipeline (or simulator) to steer; decisions reach it through
            :class:`~.safety.Guarded`.
        tuner: the tuner deciding allocations.
        interval_s: seconds between tuning steps.
        log_path: file to append one JSON line per decision to (None: no decision log).
        limits_fn: hard limits for an observation (default: those the observation implies).
        labels: fields every logged decision carries besides its own, naming who wrote it
            (the loader's: ``unit``, what one item the consumer takes is, and ``rank`` under
            ``torch.distributed``), for ``watch`` and ``report``.

    Example:
        >>> with TuningLoop(pipeline, make_tuner("heuristic"), interval_s=1.0) as loop:
        ...     train()
        >>> loop.cpu_fraction
    """

    def __init__(
        self,
        tunable: Tunable,
        tuner: Tuner,
        interval_s: float = 1.0,
        log_path: str | None = None,
        limits_fn: LimitsFn | None = None,
        reset: bool = True,
        hold_first: bool = False,
        labels: Mapping[str, Any] | None = None,
        carried: Callable[[], Observation | None] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"TuningLoop: interval_s must be positive, got {interval_s}")
        self.tunable = Guarded(tunable, limits_fn)
        self.tuner = tuner
        self.interval_s = float(interval_s)
        self.log_path = log_path
        self.limits_fn = limits_fn
        self.labels = dict(labels or {})
        # False continues a tuner that already ran (e.g. the next epoch of the same pipeline):
        # its first decision is a step, not a reset, so what it learned is kept.
        self.reset = bool(reset)
        # True for a tuner continued from an epoch whose loop stepped after its first tick:
        # the interval since that last step is the epoch's drained end (its source idle, its
        # stages emptying) and the pause between epochs, which says nothing of the allocation
        # in force. (After a shorter epoch it spans the whole epoch, and is stepped on.)
        self.hold_first = bool(hold_first) and not self.reset
        # For a tuner continued on a pipeline started anew (the next epoch's workers): the
        # last observation of the one before it, which the first tick steps on. The new
        # pipeline's first tick has measured a few milliseconds of workers starting, which
        # say nothing of the allocation; the last pipeline's measured it since its last tick
        # (a whole epoch shorter than the interval). None from it: the first tick is held.
        self.carried = None if self.reset else carried
        # A continued loop's pipeline was started anew (its workers fork and start): until it
        # delivers its first item, what a tick measures is that start, not the allocation, and
        # such ticks are held (logged, not stepped on), however long the start takes.
        self._starting = not self.reset
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._reported = False
        self._steps = 0
        self._cpu_s = 0.0
        self._started_at = 0.0
        self._ended_at: float | None = None
        self._applied: Allocation | None = None
        self._observed_at = 0.0  # perf_counter() when the last tick's observation returned

    # -- public state ------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Decisions made so far (the reset counts as one)."""
        return self._steps

    @property
    def last_allocation(self) -> Allocation | None:
        """The allocation applied most recently."""
        return self._applied

    @property
    def error(self) -> BaseException | None:
        """The exception that ended the loop, if any."""
        return self._error

    @property
    def running(self) -> bool:
        """True while the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def cpu_s(self) -> float:
        """CPU seconds the loop thread spent on its own work."""
        return self._cpu_s

    @property
    def cpu_fraction(self) -> float:
        """The loop's CPU time as a fraction of one core over its wall time so far."""
        if not self._started_at:
            return 0.0
        end = self._ended_at if self._ended_at is not None else time.perf_counter()
        return self._cpu_s / max(end - self._started_at, 1e-9)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> TuningLoop:
        """Start the thread (the first decision is ``tuner.reset``). Returns self."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(f"TuningLoop({_tuner_name(self.tuner)}): already started")
            self._thread = threading.Thread(
                target=self._run, name=f"tuning-loop-{_tuner_name(self.tuner)}", daemon=True
            )
            self._started_at = time.perf_counter()
            self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None, raise_error: bool = True) -> None:
        """Ask the thread to end, join it, and raise the exception that ended it, if any.

        Args:
            timeout_s: how long to wait for the current step (default: 10 intervals, >= 10 s).
            raise_error: re-raise the loop's exception (once); False only logs it.

        Raises:
            RuntimeError: the thread did not end in time (a tuner or apply call is stuck).
            BaseException: whatever the tuner or tunable raised inside the loop.
        """
        self._stop.set()
        if self._thread is not None:
            wait_s = timeout_s if timeout_s is not None else max(10.0, 10 * self.interval_s)
            self._thread.join(wait_s)
            if self._thread.is_alive():
                raise RuntimeError(
                    f"TuningLoop({_tuner_name(self.tuner)}): thread still busy after "
                    f"{wait_s:.1f}s; a tuner.step or tunable.apply call is stuck"
                )
        if self._error is not None and raise_error and not self._reported:
            self._reported = True
            raise self._error

    def __enter__(self) -> TuningLoop:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # With an exception already propagating, report the loop's own error through the log
        # instead of replacing the caller's exception.
        self.stop(raise_error=exc_type is None)

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        out: IO[str] | None = None
        try:
            if self.log_path is not None:
                out = open(self.log_path, "a", encoding="utf-8")
            deadline = time.perf_counter()
            self._tick(out, first=self.reset)
            while True:
                # Every interval_s on a fixed schedule; an observation that ended late (a busy
                # machine, a slow memory reading) moves the schedule rather than having the
                # next tick catch up, which would measure an interval of a few milliseconds.
                deadline = max(deadline, self._observed_at) + self.interval_s
                if self._stop.wait(max(0.0, deadline - time.perf_counter())):
                    break
                self._tick(out, first=False)
        except ExecutorClosedError as exc:
            if not self._steps:  # handed a closed pipeline: whoever started the loop erred
                self._failed(exc, out)
            else:
                # Closed under the loop: its epoch ended (an error, a break, Ctrl-C), which is
                # reported where it happened; the loop has nothing left to steer.
                log.debug("tuning loop (%s) ended: %s", _tuner_name(self.tuner), exc)
        except BaseException as exc:
            self._failed(exc, out)
        finally:
            self._ended_at = time.perf_counter()
            if out is not None:
                out.close()

    def _failed(self, exc: BaseException, out: IO[str] | None) -> None:
        """Record what ended the loop: reported by :meth:`stop`, never swallowed."""
        self._error = exc
        log.error("tuning loop (%s) stopped by an error", _tuner_name(self.tuner), exc_info=exc)
        if out is not None:
            self._write(out, {"error": f"{type(exc).__name__}: {exc}", "step": self._steps})

    def _tick(self, out: IO[str] | None, first: bool) -> None:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        try:
            obs = self.tunable.observe()
            self._observed_at = time.perf_counter()
            starting, stepped_on_last = self._starting and obs.throughput <= 0, False
            if obs.throughput > 0:
                self._starting = False
            if self.carried is not None and not first and self._steps == 0:
                last = self.carried()
                if last is not None and last.throughput > 0:
                    obs, stepped_on_last = last, True
                else:
                    self.hold_first = True
            held = (self.hold_first and self._steps == 0) or (starting and not stepped_on_last)
            if held and not first:
                # See __init__: logged, the pipeline keeps running as it was, and the tuner
                # steps on a later interval.
                self._steps += 1
                if out is not None:
                    self._write(out, self._record(obs, obs.allocation(), False, 0.0))
                return
            decision = self.tuner.reset(obs) if first else self.tuner.step(obs)
            # Applied every tick, changed or not: the limits are fitted to this tick's memory,
            # and the pipeline sets what the tuner leaves open (calls in flight per worker).
            self.tunable.apply(decision)
            alloc = self.tunable.applied
            assert alloc is not None
            changed = alloc != self._applied
            self._applied = alloc
            self._steps += 1
            if out is not None:
                self._write(out, self._record(obs, alloc, changed, time.perf_counter() - wall0))
        finally:
            self._cpu_s += time.thread_time() - cpu0

    def _record(self, obs: Observation, alloc: Allocation, applied: bool, step_s: float) -> dict:
        return {
            **self.labels,
            "t": obs.t,
            "wall_s": round(time.perf_counter() - self._started_at, 6),
            "tuner": _tuner_name(self.tuner),
            "step": self._steps,
            "obs": {
                **{f: getattr(obs, f) for f in _OBS_FIELDS},
                "workers": list(obs.workers),
                "buffer_bytes": list(obs.buffer_bytes),
                "busy": [round(s.busy, 4) for s in obs.stages],
                "stages": [_stage_record(s) for s in obs.stages],
            },
            "allocation": {
                "workers": list(alloc.workers),
                "buffer_bytes": list(alloc.buffer_bytes),
                "concurrency": list(alloc.concurrency),  # [] : left to the pipeline
                "fused": list(alloc.fused),  # [] : stages stay as they run
                "remote": list(alloc.remote),  # [] : each stage keeps its placement
                "threads": list(alloc.threads),  # [] : left to the pipeline's kind rule
            },
            "applied": applied,
            "step_s": step_s,
        }

    @staticmethod
    def _write(out: IO[str], record: dict) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()
