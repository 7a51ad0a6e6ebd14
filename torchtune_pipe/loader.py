"""The Loader: iterates a running pipeline, epoch after epoch, and lets a tuner steer it.

A :class:`Loader` owns one executor (kept across epochs), an optional tuning loop (a daemon
thread stepping a tuner through :class:`RunningPipeline`, the pipeline's
:class:`~torchtune_pipe.tuning.base.Tunable`), an optional prefetch thread (pinning and device
transfer, :mod:`torchtune_pipe.prefetch`), and the bookkeeping that makes ``state_dict()`` exact.

Resume rule: the state records *which* items were delivered, by ``(unit, position in unit)``
(units numbered in the epoch's deterministic unit order), never how many workers ran, so a
state saved under one allocation or tuner loads under any other. Loading it re-issues the
units not finished and skips the delivered items of the partial ones. The rest of the epoch
is then exactly the items not delivered, in every mode. In ordered mode without a shuffle
stage it is also in the same order, with the same batch boundaries, as an uninterrupted run;
with a shuffle stage (or unordered) the order of the remaining items differs.

Example:
    >>> with pipe.loader(tuner="heuristic", ordered=True) as loader:   # doctest: +SKIP
    ...     for epoch in range(3):
    ...         loader.set_epoch(epoch)
    ...         for batch in loader: ...
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import threading
import weakref
from collections.abc import Generator, Iterator, Mapping
from typing import Any

from multiproc import Executor

from . import _ranks, _state, telemetry
from ._faststart import FastStart, ShapeProbe
from .errors import LoaderTimeoutError, StateError
from .memory import MemoryProbe
from .pipeline import Pipeline, Work, run_inline
from .prefetch import END as _END
from .prefetch import Prefetcher, Transfer, accelerator_available
from .tuning.base import Allocation, Observation

log = logging.getLogger(__name__)

_STATE_VERSION = 1


# ---------------------------------------------------------------------------- bookkeeping
class _Progress:
    """Which items of the epoch reached the consumer, by ``(unit, k)``."""

    def __init__(self, epoch: int, state: Mapping | None = None):
        self.epoch = epoch
        self.finished = False
        self.done: set[int] = set()
        self.seen: dict[int, set[int]] = {}
        self.totals: dict[int, int] = {}
        self.delivered = 0
        self.last_unit = -1
        if state is not None:
            self.done = set(state["done"])
            self.seen = {int(u): set(ks) for u, ks in state["partial"].items()}
            self.delivered = int(state["delivered"])
            self.last_unit = int(state["last_unit"])

    def took(self, u: int, k: Any) -> None:
        if u < 0:  # a batch: k holds its items' ids
            for uu, kk in k:
                self._one(uu, kk)
        else:
            self._one(u, k)
        self.delivered += 1

    def _one(self, u: int, k: int) -> None:
        self.seen.setdefault(u, set()).add(k)
        self.last_unit = u
        self._check(u)

    def end(self, u: int, n: int) -> None:
        self.totals[u] = n
        self._check(u)

    def _check(self, u: int) -> None:
        n = self.totals.get(u)
        if n is not None and len(self.seen.get(u, ())) >= n:
            self.done.add(u)
            self.seen.pop(u, None)
            del self.totals[u]

    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "finished": self.finished,
            "done": sorted(self.done),
            "partial": {u: sorted(ks) for u, ks in sorted(self.seen.items())},
            "delivered": self.delivered,
            "last_unit": self.last_unit,
        }


def _interleave(
    stream: Iterator[tuple], starts: dict[int, int], start_after: int
) -> Iterator[tuple]:
    """Round-robin over units, one item each, skipping finished units: the order torch's
    DataLoader gives an IterableDataset read by one worker per shard.

    ``starts`` maps each unit to read (in order) to its first undelivered position;
    ``start_after`` is the unit whose item was delivered last (-1: none).
    """
    active = list(starts)
    nxt = dict(starts)
    pending: dict = {}
    totals: dict = {}
    cur = next((i for i, u in enumerate(active) if u > start_after), 0)
    for t in stream:
        u, k, _ = t
        if k < 0:
            totals[u] = -1 - k
        else:
            pending[(u, k)] = t
        while active:
            cu = active[cur]
            item = pending.pop((cu, nxt[cu]), None)
            if item is not None:
                yield item
                nxt[cu] += 1
                cur = (cur + 1) % len(active)
                continue
            if totals.get(cu) is not None and totals[cu] <= nxt[cu]:
                yield (cu, -1 - totals[cu], None)
                active.pop(cur)
                cur = cur % len(active) if active else 0
                continue
            break


def _skip_prefix(skip: set[int]) -> int:
    n = 0
    while n in skip:
        n += 1
    return n


def _prefetched_bytes(slot: list[weakref.ref]) -> int:
    """What the prefetcher in ``slot`` holds in this process for the pipeline."""
    pre = slot[0]() if slot else None
    return pre.held_bytes() if pre is not None else 0


# ---------------------------------------------------------------------------- the Tunable
class RunningPipeline:
    """A running pipeline as a :class:`~torchtune_pipe.tuning.base.Tunable`.

    ``observe()`` reports the interval since the previous call; ``apply()`` calls
    ``executor.resize`` / ``executor.set_budget`` for the stages that change. It applies what
    it is given: the tuning loop wraps it in :class:`~torchtune_pipe.tuning.safety.Guarded`,
    which applies the hard limits (CPU budget, memory) once per decision.
    """

    def __init__(self, executor: Executor, meter: telemetry.Meter):
        self.executor = executor
        self.meter = meter
        self._last: Observation | None = None

    def observe(self) -> Observation:
        """Rates since the previous observation, plus machine facts."""
        self._last = self.meter.observe()
        return self._last

    def apply(self, allocation: Allocation) -> None:
        """Resize stages and buffers to ``allocation`` (budgets within each stage's
        ``max_buffer_bytes``); calls in flight per worker where the allocation leaves them open
        follow the measured rule (:func:`~torchtune_pipe.tuning.concurrency.plan_concurrency`).
        """
        from .tuning.concurrency import plan_concurrency

        obs = self._last or self.observe()
        a = plan_concurrency(obs, allocation)
        ex = self.executor
        for i, st in enumerate(ex.spec.stages):
            if a.workers[i] != ex.workers(i):
                ex.resize(i, a.workers[i])
            if a.concurrency[i] != ex.concurrency(i):
                ex.set_concurrency(i, a.concurrency[i])
            budget = a.buffer_bytes[i]
            if st.max_buffer_bytes is not None:
                budget = min(budget, st.max_buffer_bytes)
            if budget != ex.budget(i):
                ex.set_budget(i, budget)

    def allocation(self) -> Allocation:
        """The allocation the executor runs with now."""
        ex = self.executor
        n = len(ex.spec.stages)
        return Allocation(
            tuple(ex.workers(i) for i in range(n)), tuple(ex.budget(i) for i in range(n))
        )


class _MachineFacts:
    """Machine facts for a Meter: the slow probe once, free CPUs and memory at every call.

    An object of its own, not a bound method of the Loader: a Meter holding the Loader would
    put the Loader in a reference cycle, and an unreferenced Loader would keep its workers
    until the garbage collector happens to run.
    """

    def __init__(self) -> None:
        self._probed: telemetry.Machine | None = None

    def __call__(self) -> telemetry.Machine:
        if self._probed is None:
            self._probed = telemetry.Machine.probe()
        m = self._probed
        return telemetry.Machine(
            telemetry.cpus_available(), telemetry.memory_available_bytes(), m.dram_gbps, m.cpu_ghz
        )


class EpochIterator:
    """What ``iter(loader)`` returns: one epoch's items, for one consumer thread.

    As torch's DataLoader, a new ``iter()`` on the loader starts a new epoch; this iterator
    then raises ``RuntimeError`` if used again (never a silent stop). Two threads calling
    ``next()`` on it at once get ``RuntimeError`` as well.
    """

    def __init__(self, gen: Generator[Any, None, None], epoch: int):
        self._gen = gen
        self._epoch = epoch
        self._busy = threading.Lock()
        self._ended: str | None = None

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._ended is not None:
            raise RuntimeError(f"Loader: this iterator of epoch {self._epoch} {self._ended}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "Loader: two threads iterate the same loader at once; one loader feeds one "
                "consumer thread (create a loader per thread, or hand items over a queue)"
            )
        try:
            return next(self._gen)
        finally:
            self._busy.release()

    def close(self) -> None:
        """End the epoch early (as ``break`` does)."""
        self._gen.close()

    def _end(self, why: str) -> None:
        """Ended from outside (a new ``iter()``, ``load_state_dict``, ``close``)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"Loader: {why.split(';')[0]} while another thread is inside next() of the "
                "current epoch; one loader feeds one consumer thread"
            )
        try:
            self._ended = why
            self._gen.close()
        finally:
            self._busy.release()


def _make_tuner(tuner: Any) -> Any:
    if tuner is None or tuner == "static":
        return None  # the stages' own knobs, unchanged
    if isinstance(tuner, str):
        from .tuning.registry import make_tuner

        return make_tuner(tuner)
    if not (hasattr(tuner, "reset") and hasattr(tuner, "step")):
        raise ValueError(f"Loader: tuner must be None, a tuner name or a Tuner, got {tuner!r}")
    return tuner


# ---------------------------------------------------------------------------- the Loader
class Loader:
    """Iterates a :class:`~torchtune_pipe.pipeline.Pipeline`, one epoch per ``iter()``.

    Args:
        pipeline: the pipeline.
        tuner: None or ``"static"`` (keep the stages' knobs), a tuner name
            (``"unoptimized"``, ``"heuristic"``, ``"autotune"``, ``"plumber"``, ``"intune"``...)
            or a :class:`~torchtune_pipe.tuning.base.Tuner`.
        ordered: deliver items in source order (deterministic given the seeds); shuffle and
            batch stages then run one worker each.
        inline: run every stage in the calling thread (no worker processes).
        epoch: the first epoch.
        progress: show a live per-stage table while iterating.
        tuning_interval_s: seconds between tuning steps.
        tuning_log: file to append the tuner's decisions to (JSON lines).
        memory_limit_bytes: memory the whole pipeline (buffers, worker processes, prefetched
            copies) may use; default: the cgroup's limit, else the machine's, less what the
            rest of the cgroup or machine uses (``Observation.memory_limit_bytes``).
        timeout_s: raise :class:`~torchtune_pipe.errors.LoaderTimeoutError` when no item
            arrives for this long (0: wait forever).
        length: items per epoch for ``len()`` when the source cannot say.
        interleave: deliver round-robin across units (torch's order for iterable datasets
            read by one worker per shard); needs a pipeline without shuffle or batch stages.
        max_restarts: worker deaths tolerated per stage.
        even_ranks: under ``torch.distributed``, end every rank's epoch at the step where the
            first rank runs out of items (one integer all-reduced per item), so DDP never waits
            on a rank that left the epoch; the other ranks drop what they have left, count it
            in :attr:`last_epoch_dropped` and log it. None: on when the source is sharded
            (``world_size``) for the process group's world size; ``len()`` is then the
            shortest rank's length where the source can tell it.
        fast_start: read the first units of the first epoch in the calling thread while the
            workers start, so the first items come at once (see
            :mod:`torchtune_pipe._faststart`); only for pipelines without shuffle or batch
            stages, prefetch thread or timeout, whose items do not depend on where they are
            read (no ``init`` that a read needs).
        choose_shape: with ``fast_start``, compare the tuned workers with reading in the
            calling thread and keep whichever delivers faster (rows cheaper than a hop
            between processes are read inline, as torch's ``num_workers=0``); logged at INFO.

    Example:
        >>> loader = pipe.loader(tuner="heuristic", ordered=True)   # doctest: +SKIP
        >>> state = loader.state_dict(); loader.load_state_dict(state)
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        tuner: Any = None,
        ordered: bool = False,
        inline: bool = False,
        epoch: int = 0,
        progress: bool = False,
        tuning_interval_s: float = 1.0,
        tuning_log: str | None = None,
        memory_limit_bytes: int | None = None,
        timeout_s: float = 0.0,
        length: int | None = None,
        interleave: bool = False,
        max_restarts: int = 16,
        even_ranks: bool | None = None,
        fast_start: bool = False,
        choose_shape: bool = False,
    ):
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"Loader: pipeline must be a Pipeline, got {type(pipeline).__name__}")
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"Loader: epoch must be an int >= 0, got {epoch!r}")
        if timeout_s < 0:
            raise ValueError(f"Loader: timeout_s must be >= 0, got {timeout_s}")
        if interleave and any(s.stateful for s in pipeline.stages):
            raise ValueError(
                "Loader: interleave=True needs a pipeline without shuffle or batch stages"
            )
        self.pipeline = pipeline
        self.tuner = _make_tuner(tuner)
        self.ordered = ordered
        self.inline = inline
        self.progress = progress
        self.tuning_interval_s = tuning_interval_s
        self.tuning_log = tuning_log
        self.memory_limit_bytes = memory_limit_bytes
        self.timeout_s = timeout_s
        self.interleave = interleave
        self.max_restarts = max_restarts
        self.even_ranks = even_ranks
        self.fast_start = fast_start
        self.choose_shape = choose_shape
        self._shape_probe = ShapeProbe()  # what the shape choice measured (choose_shape)
        self.last_epoch_dropped = 0  # items the last epoch dropped to keep ranks in step
        self._length = length
        self._epoch = epoch
        self._pending: Mapping | None = None
        self._progress = _Progress(epoch)
        self._units_state: Any = None
        self._executor: Executor | None = None
        self._tunable: RunningPipeline | None = None
        self._tuner_started = False  # the tuner has made its first (reset) decision
        self._tuning: Any = None  # the tuning loop of the epoch being iterated
        self._watcher: Any = None  # the progress display of the epoch being iterated
        self._active: weakref.ref | None = None
        self._closed = False
        self._clock = telemetry.ConsumerClock()
        self._machine = _MachineFacts()
        self._pid = os.getpid()  # the owner: a forked child must not stop its workers
        self._last_error: BaseException | None = None  # what ended the last epoch early
        self._prefetch: list[weakref.ref] = []  # the epoch's prefetcher, for its memory
        self._held: dict = {}  # what the finalizer closes when the loader is collected
        self._finalizer = weakref.finalize(self, Loader._cleanup, self._held, self._pid)

    # ------------------------------------------------------------------------ public API
    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("Loader: iterated after close(); create a new loader")
        # One epoch at a time: a new iter() ends the previous one, which says so if used again.
        self._end_active("was ended by a new iter() on the loader, which starts a new epoch")
        it = EpochIterator(self._iterate(), self._epoch)
        # Held weakly: an iterator the caller drops (``break``) is collected at once, and its
        # cleanup stops the workers, as when torch's DataLoader iterator goes away.
        self._active = weakref.ref(it)
        return it

    def __len__(self) -> int:
        if self._length is not None:
            return self._length
        source = self.pipeline.source
        try:
            n = len(source)
        except TypeError:
            raise TypeError("Loader: the source does not know its length; pass length=") from None
        if hasattr(source, "rank_lengths") and _ranks.active(self.even_ranks, source):
            return min(self._items_out(k) for k in source.rank_lengths())
        return self._items_out(n)

    def _items_out(self, n: int) -> int:
        """Items delivered for ``n`` source items (batch stages regroup them)."""
        for st in self.pipeline.stages:
            if st.kind == "batch":
                n = n // st.size if st.drop_last else math.ceil(n / st.size)
        return n

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run ``epoch`` (seeds unit order and shuffling)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"Loader.set_epoch(): epoch must be an int >= 0, got {epoch!r}")
        self._epoch = epoch
        self._pending = None

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration runs."""
        return self._epoch

    def state_dict(self) -> dict:
        """What was delivered in the current epoch; independent of worker counts."""
        if self._pending is not None:
            return dict(self._pending)
        state = self._progress.state()
        state["version"] = _STATE_VERSION
        state["units_state"] = self._units_state
        state["fingerprint"] = _state.fingerprint(self.pipeline)
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Resume from ``state`` at the next ``iter()``: exactly the undelivered items.

        Raises:
            StateError: ``state`` is not a loader state of this version, a field has the
                wrong type or range (the message names it), or it was saved by another
                pipeline or source (its fingerprint differs).
        """
        state = _state.check(state, _STATE_VERSION, _state.fingerprint(self.pipeline))
        self._end_active("was ended by load_state_dict(); iterate the loader again to resume")
        self._pending = dict(state)

    def release_tuner(self) -> Any:
        """Stop tuning this loader and hand its tuner over (e.g. to a training callback).

        The tuning loop of the current epoch, if any, is stopped; later epochs run with the
        allocation the tuner left. Returns the tuner (None if the loader had none).

        Raises:
            BaseException: what the loader's tuning loop raised, if it ended with an error.
        """
        tuner, self.tuner = self.tuner, None
        loop, self._tuning = self._tuning, None
        if loop is not None:
            loop.stop(raise_error=True)
        return tuner

    @property
    def tunable(self) -> RunningPipeline | None:
        """The running pipeline as a Tunable (None until the first ``iter()``)."""
        return self._tunable

    def observe(self) -> Observation | None:
        """An observation of the running pipeline now (None when no executor runs yet).

        Raises:
            RuntimeError: the loader is closed, or its last epoch ended early (an error, a
                ``break``) and stopped the workers; the error is chained.
        """
        if self._closed:
            raise RuntimeError("Loader.observe(): the loader is closed; create a new one")
        if self._tunable is None:
            return None
        if self._executor is None:
            raise RuntimeError(
                "Loader.observe(): no pipeline runs: the last epoch ended early"
                + (
                    f" with {type(self._last_error).__name__}: {self._last_error}"
                    if self._last_error
                    else ""
                )
                + " and stopped its workers; iterate the loader again to start them"
            ) from self._last_error
        return self._tunable.observe()

    def close(self) -> None:
        """Stop the iteration, the tuner, the workers; remove shared memory. Idempotent."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        self._end_active("was ended by close()")
        self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------ internals
    def _end_active(self, why: str) -> None:
        it = self._active() if self._active is not None else None
        if it is not None:
            it._end(why)
        self._active = None

    @staticmethod
    def _cleanup(held: dict, pid: int) -> None:
        if os.getpid() != pid:
            return  # a forked child: the workers and memory are the parent's
        ex = held.pop("executor", None)
        if ex is not None:
            ex.close()

    def _ensure_executor(self) -> Executor:
        if self._executor is None:
            spec = self.pipeline.spec(self.ordered)
            spec = type(spec)(spec.stages, ordered=spec.ordered, max_restarts=self.max_restarts)
            ex = Executor(spec)
            self._executor = ex
            self._held["executor"] = ex
            bounds = [
                telemetry.Bounds(s.min_workers, s.max_workers, s.max_concurrency)
                for s in spec.stages
            ]
            # Through a list, not a bound method: the probe must not keep the loader alive.
            probe = MemoryProbe(functools.partial(_prefetched_bytes, self._prefetch))
            meter = telemetry.Meter(
                lambda: ex.snapshot(per_worker=True),
                self._machine,
                bounds,
                self._clock,
                self.memory_limit_bytes,
                probe,
            )
            self._tunable = RunningPipeline(ex, meter)
        return self._executor

    def _drop_executor(self) -> None:
        ex, self._executor = self._executor, None
        self._held.pop("executor", None)
        if ex is not None:
            ex.close()

    def _plan(self) -> tuple[int, _Progress, list[Work]]:
        """The epoch to run, its bookkeeping, and the work (minus what was delivered)."""
        state, self._pending = self._pending, None
        source = self.pipeline.source
        epoch = self._epoch
        progress = _Progress(epoch)
        if state is not None:
            epoch = int(state["epoch"]) + (1 if state["finished"] else 0)
            progress = _Progress(epoch, None if state["finished"] else state)
            if not state["finished"] and hasattr(source, "load_units_state"):
                source.load_units_state(state.get("units_state"))
        self._epoch = epoch
        units = source.units(epoch)
        self._units_state = source.units_state() if hasattr(source, "units_state") else None
        for field, named in (("done", progress.done), ("partial", progress.seen)):
            bad = sorted(u for u in named if not 0 <= u < len(units))
            if bad:
                raise StateError(
                    f"Loader: state[{field!r}] names units {bad[:5]} but epoch {epoch} has "
                    f"{len(units)} units: the state was saved by another pipeline or source"
                )
        works = [
            Work(pos, u, frozenset(progress.seen.get(pos, ())))
            for pos, u in enumerate(units)
            if pos not in progress.done
        ]
        return epoch, progress, works

    def _iterate(self) -> Generator[Any, None, None]:
        sync = _ranks.RankSync() if _ranks.active(self.even_ranks, self.pipeline.source) else None
        epoch, progress, works = self._plan()
        self._progress = progress
        faststart = None
        if self.inline:
            stream = run_inline(self.pipeline, works, epoch)
        elif self._fast_start_applies():
            faststart = FastStart(
                self.pipeline, works, epoch, self._ensure_executor, self._on_started,
                choose_shape=self.choose_shape, may_go_inline=lambda: self.tuner is not None,
                on_inline=self._go_inline, delivered=lambda: (progress.done, progress.seen),
                interval_s=self.tuning_interval_s, probe=self._shape_probe,
                on_built=self._on_built, inline_context=self._inline_context(),
            )  # fmt: skip
            stream = faststart.stream()
        else:
            stream = self._ensure_executor().run(works, epoch)
        if self.interleave:
            starts = {w.pos: _skip_prefix(set(w.skip)) for w in works}
            stream = _interleave(stream, starts, progress.last_unit)
        self.last_epoch_dropped = 0
        pre = self._prefetcher(stream)
        self._tuning = self._start_tuning()  # None until the executor runs (fast start)
        self._watcher = self._start_watch()
        complete = False
        closed_by_consumer = False
        try:
            while True:
                self._clock.asked()
                t = self._next(pre, stream)
                if t is not _END and t[0] >= 0 and t[1] < 0:
                    progress.end(t[0], -1 - t[1])
                    continue
                if sync is not None and not sync.all_have(t is not _END):
                    if t is not _END:  # another rank ran out: drop what is left here
                        self.last_epoch_dropped = 1
                        self._drain_tail(pre, stream, progress, drop_items=True)
                        self._report_dropped(sync, epoch)
                    break
                if t is _END:
                    break
                u, k, x = t
                progress.took(u, k)
                self._clock.took()
                yield x
            complete = True
            progress.finished = True
            self._epoch = epoch + 1
        except GeneratorExit:
            closed_by_consumer = True
            raise
        except BaseException as e:
            self._last_error = e
            raise
        finally:
            # Collected in a forked child, nothing here is the child's to stop (and the
            # executor's locks may be held by threads that do not exist there).
            if os.getpid() == self._pid:
                self._clock.pause()
                if closed_by_consumer and not self.inline and self._took_everything(progress):
                    # Consumers that stop at len() (Lightning) never ask for the end of the
                    # stream: read what is left (end-of-unit markers) so the epoch counts as
                    # complete and the workers are kept for the next one.
                    complete = self._drain_tail(pre, stream, progress, drop_items=sync is not None)
                    if sync is not None and self.last_epoch_dropped:
                        self._report_dropped(sync, epoch)
                    if complete:
                        progress.finished = True
                        self._epoch = epoch + 1
                loop_error = None
                if faststart is not None:
                    faststart.join()  # an executor still being built is closed, not leaked
                loop, self._tuning = self._tuning, None
                watcher, self._watcher = self._watcher, None
                if loop is not None:
                    # Before the executor goes: a tick must not resize a closed executor.
                    try:
                        loop.stop(raise_error=complete)
                    except BaseException as e:
                        loop_error = e
                    loop = None
                if not complete and not self.inline:
                    self._drop_executor()  # wakes a prefetch thread waiting on the executor
                if pre is not None:
                    # After a timeout the thread is stuck in a stage: do not wait for it.
                    pre.stop(
                        timeout_s=0.1 if isinstance(sys.exc_info()[1], LoaderTimeoutError) else 10.0
                    )
                    if pre.alive:
                        log.warning(
                            "Loader: the prefetch thread is still busy in a stage; left behind"
                        )
                if hasattr(stream, "close") and (pre is None or not pre.alive):
                    stream.close()
                if watcher is not None:
                    watcher.stop()
                if loop_error is not None:
                    raise loop_error

    def _fast_start_applies(self) -> bool:
        """Whether this epoch's first units may run inline while the workers start (until the
        first epoch with workers, or until the shape is chosen), for a loader that asked for
        it, with no shuffle or batch stage (they group items across units), no interleaving
        and no prefetch thread (inline reads reseed the global generators, which only the
        consumer's own thread may touch)."""
        init = self.pipeline.stages[0].init
        return (
            self.fast_start
            and (
                self._executor is None or (self.choose_shape and self._shape_probe.decided is None)
            )
            and (init is None or hasattr(init, "inline"))  # an init a read may need
            and not self.interleave
            and self.pipeline.prefetch_spec is None
            and not self.timeout_s
            and not any(st.stateful for st in self.pipeline.stages)
        )

    def _go_inline(self, why: str) -> None:
        """Read inline from now on (this epoch's rest and every later one): stop tuning,
        close the workers."""
        log.info("Loader: reading in the calling thread from now on: %s", why)
        loop, self._tuning = self._tuning, None
        if loop is not None:
            loop.stop(raise_error=False)
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
        self._drop_executor()
        self._tunable = None
        self.inline = True

    def _on_built(self) -> None:
        """The executor of a fast start is built (background thread): show its progress."""
        if self._watcher is None:
            self._watcher = self._start_watch()

    def _on_started(self) -> None:
        """The executor took over from a fast start: tune it from now on."""
        if self._tuning is None:
            self._tuning = self._start_tuning()

    def _inline_context(self) -> Any:
        """What makes the calling thread stand in for a source worker during a fast start:
        the source stage's ``init.inline`` where its init has one (the DataLoader's sets
        torch's worker info), else nothing."""
        init = self.pipeline.stages[0].init
        return getattr(init, "inline", contextlib.nullcontext)

    def _took_everything(self, progress: _Progress) -> bool:
        try:
            return progress.delivered >= len(self)
        except TypeError:
            return False

    def _drain_tail(
        self,
        pre: Prefetcher | None,
        stream: Iterator[tuple],
        progress: _Progress,
        drop_items: bool = False,
    ) -> bool:
        """Consume end-of-unit markers after the last item; False if another item comes
        (``drop_items``: read to the end, counting items in ``last_epoch_dropped``)."""
        while True:
            t = self._next(pre, stream)
            if t is _END:
                return True
            u, k, _ = t
            if u >= 0 and k < 0:
                progress.end(u, -1 - k)
            elif drop_items:
                self.last_epoch_dropped += 1
            else:
                return False

    def _report_dropped(self, sync: _ranks.RankSync, epoch: int) -> None:
        log.warning(
            "Loader: rank %d of %d dropped the last %d item(s) of epoch %d: another rank ran "
            "out first (even_ranks keeps DDP ranks in step)",
            sync.rank, sync.world_size, self.last_epoch_dropped, epoch,
        )  # fmt: skip

    def _next(self, pre: Prefetcher | None, stream: Iterator[tuple]) -> Any:
        if pre is None:
            return next(stream, _END)
        try:
            return pre.get()
        except TimeoutError:
            busy = self._stuck()
            if busy:
                where = "; ".join(str(b) for b in busy[:3])
            elif self.inline:
                where = "the pipeline runs inline, in the loader's prefetch thread"
            else:
                where = "no worker is inside its stage function (see progress=True)"
            e = LoaderTimeoutError(
                f"Loader: no item arrived within timeout_s={self.timeout_s} s: {where}"
            )
            e.stuck = tuple(busy)
            raise e from None

    def _stuck(self) -> list:
        ex = self._executor
        if ex is None:
            return []
        try:
            return ex.busy()
        except Exception:  # closed under us: the timeout is still the error to report
            return []

    def _prefetcher(self, stream: Iterator[tuple]) -> Prefetcher | None:
        spec = self.pipeline.prefetch_spec
        if spec is None and not self.timeout_s:
            return None
        convert = None
        depth = 2
        if spec is not None:
            depth = spec.depth
            pin = spec.pin_memory and accelerator_available()
            if pin or spec.device is not None:
                convert = Transfer(pin, spec.device, spec.non_blocking)
        pre = Prefetcher(stream, depth, convert, self.timeout_s)
        self._prefetch[:] = [weakref.ref(pre)]
        return pre

    def _start_tuning(self) -> Any:
        if self.tuner is None or self._tunable is None or self.inline:
            return None
        from .tuning.loop import TuningLoop

        # One tuner per Loader: later epochs continue it (no reset), so allocations and what
        # the agent learned carry over from epoch to epoch.
        first = not self._tuner_started
        self._tuner_started = True
        return TuningLoop(
            self._tunable, self.tuner, self.tuning_interval_s, self.tuning_log, reset=first
        ).start()

    def _start_watch(self) -> Any:
        if not self.progress or self._tunable is None or self.inline:
            return None
        from .watch import Watcher

        meter = self._tunable.meter
        own = telemetry.Meter(
            meter._snapshot, self._machine, meter.bounds, self._clock,
            self.memory_limit_bytes, meter.memory,
        )  # fmt: skip
        return Watcher(own.observe).start()
