"""The Loader: iterates a running pipeline, epoch after epoch, and lets a tuner steer it.

A :class:`Loader` owns an executor (one per epoch, or one kept across epochs with
``persistent_workers=True``), an optional tuning loop (a daemon thread stepping a tuner through
:class:`RunningPipeline`, the pipeline's :class:`~torchtune_pipe.tuning.base.Tunable`), an
optional prefetch thread (pinning and device transfer, :mod:`torchtune_pipe.loader.prefetch`),
and the bookkeeping that makes ``state_dict()`` exact.

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
import os
import sys
import weakref
from collections.abc import Generator, Iterator, Mapping
from typing import Any

from multiproc import Executor
from torchtune_pipe.errors import LoaderTimeoutError
from torchtune_pipe.loader import ranks as _ranks
from torchtune_pipe.loader import state as _state
from torchtune_pipe.loader.epoch import (
    EpochFeed,
    EpochIterator,
    interleave,
    make_prefetcher,
    skip_prefix,
)
from torchtune_pipe.loader.faststart import FastStart, fast_start_fits, inline_context
from torchtune_pipe.loader.inline import run_inline
from torchtune_pipe.loader.kindprobe import KindProbe
from torchtune_pipe.loader.kindstart import kind_probe
from torchtune_pipe.loader.prefetch import END
from torchtune_pipe.loader.progress import STATE_VERSION, Progress, plan_epoch
from torchtune_pipe.loader.pushdown import batched_at_source
from torchtune_pipe.loader.running import (
    KindLoop,
    MachineFacts,
    RunningPipeline,
    as_tuner,
    busy,
    close_held,
    consumer_labels,
    executor_spec,
    on_snapshot,
    start_executor,
    start_tuning,
    start_watch,
    stop_pipeline,
    take_snapshot,
    warm_workers,
)
from torchtune_pipe.loader.shape import ShapeProbe
from torchtune_pipe.options import Strategy, with_fields
from torchtune_pipe.sources.base import ShardedSource, left_early, new_view
from torchtune_pipe.stages import PipelineLike, items_out
from torchtune_pipe.telemetry import measure as telemetry
from torchtune_pipe.tuning.base import Allocation, Observation
from torchtune_pipe.tuning.loop import note_event
from torchtune_pipe.tuning.worker_kind import KindRule

__all__ = ["Loader"]

log = logging.getLogger(__name__)

DEFAULT_TUNING_INTERVAL_S = 1.0  # a tuning step a second: rates settle, the loop costs little
DEFAULT_MAX_RESTARTS = 16  # worker deaths tolerated per stage, as multiproc.ExecutorSpec's


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
        max_restarts: worker deaths tolerated per stage.
        even_ranks: under ``torch.distributed``, end every rank's epoch at the step where the
            first rank runs out of items (one integer all-reduced per item), so DDP never waits
            on a rank that left the epoch; the other ranks drop what they have left, count it
            in :attr:`last_epoch_dropped` and log it. None: on when the source is sharded
            (``world_size``) for the process group's world size; ``len()`` is then the
            shortest rank's length where the source can tell it.
        persistent_workers: what the workers see, as in torch's DataLoader. False: each
            ``iter()`` takes a snapshot of this process (:mod:`multiproc.snapshot`) and its
            epoch's workers, fork-started from it, see the process as it was then (a dataset
            attribute or a global set before the epoch, a ``set_epoch``); they stop at the
            epoch's end. True: every epoch's workers see the process as at the first
            ``iter()`` (they serve every epoch; those started after an epoch that ended
            early fork from its snapshot). A tuner's allocation carries over either way.
        start_method: ``"fork"`` (workers fork from the snapshot and inherit what does not
            pickle: open files, database handles) or ``"spawn"`` (stage functions reach
            workers by pickle, as under torch's ``multiprocessing_context="spawn"``).
        strategy: how an epoch is run (:class:`~torchtune_pipe.options.Strategy`: ``inline``,
            ``fast_start``, ``choose_shape``, ``batch_at_source``, ``interleave``); its fields
            may also be given as keyword arguments, which override ``strategy``'s.

    Example:
        >>> loader = pipe.loader(tuner="heuristic", ordered=True)   # doctest: +SKIP
        >>> state = loader.state_dict(); loader.load_state_dict(state)
    """

    def __init__(
        self,
        pipeline: PipelineLike,
        *,
        tuner: Any = None,
        ordered: bool = False,
        epoch: int = 0,
        progress: bool = False,
        tuning_interval_s: float = DEFAULT_TUNING_INTERVAL_S,
        tuning_log: str | None = None,
        memory_limit_bytes: int | None = None,
        timeout_s: float = 0.0,
        length: int | None = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        even_ranks: bool | None = None,
        persistent_workers: bool = False,
        start_method: str = "fork",
        strategy: Strategy | None = None,
        **switches: bool,
    ):
        if not isinstance(pipeline, PipelineLike):
            raise TypeError(f"Loader: pipeline must be a Pipeline, got {type(pipeline).__name__}")
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"Loader: epoch must be an int >= 0, got {epoch!r}")
        if timeout_s < 0:
            raise ValueError(f"Loader: timeout_s must be >= 0, got {timeout_s}")
        self.strategy = with_fields("Loader", Strategy, strategy, switches)
        if self.strategy.interleave and any(s.stateful for s in pipeline.stages):
            raise ValueError(
                "Loader: interleave=True needs a pipeline without shuffle or batch stages"
            )
        if start_method not in ("fork", "spawn"):
            raise ValueError(f"Loader: start_method is 'fork' or 'spawn', not {start_method!r}")
        at_source = self.strategy.batch_at_source and batched_at_source(pipeline)
        self.pipeline = at_source or pipeline
        self.tuner = as_tuner(tuner)
        self.ordered = ordered
        self.inline = self.strategy.inline  # True from the start, or once choose_shape says so
        self.progress = progress
        self.tuning_interval_s = tuning_interval_s
        self.tuning_log = tuning_log
        self.memory_limit_bytes = memory_limit_bytes
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.even_ranks = even_ranks
        self.persistent_workers = bool(persistent_workers)
        self.start_method = start_method
        self._shape_probe = ShapeProbe()  # what the shape choice measured (choose_shape)
        self._inline_epoch = False  # this epoch is read inline whole (_inline_sooner)
        self.last_epoch_dropped = 0  # items the last epoch dropped to keep ranks in step
        self._length = length
        self._epoch = epoch
        self._pending: Mapping | None = None
        self._progress = Progress(epoch)
        self._units_state: Any = None
        self._executor: Executor | None = None
        # The next executor's spec and the snapshot its workers fork from, taken at iter().
        self._next: tuple[Any, Any] | None = None
        self._allocation: Allocation | None = None  # what the last executor ran with
        self._kinds = KindRule()  # threads or processes per "auto" stage, kept across epochs
        self._final: dict = {}  # its last observation, as it stopped ("obs")
        self._tunable: RunningPipeline | None = None
        self._tuner_started = False  # the tuner has made its first (reset) decision
        self._last_tuning: Any = None  # the loop of the last epoch tuned
        self._tuning: Any = None  # the tuning loop of the epoch being iterated
        self._watcher: Any = None  # the progress display of the epoch being iterated
        self._active: weakref.ref | None = None
        self._closed = False
        self._clock = telemetry.ConsumerClock()
        self._machine = MachineFacts()
        self._pid = os.getpid()  # the owner: a forked child must not stop its workers
        self._last_error: BaseException | None = None  # what ended the last epoch early
        self._prefetch: list[weakref.ref] = []  # the epoch's prefetcher, for its memory
        self._held: dict = {}  # what the finalizer closes when the loader is collected
        self._kept_reused, self._kept_stages = False, list[tuple[Any, Any]]()  # persistent
        self._finalizer = weakref.finalize(self, close_held, self._held, self._pid)
        if not self.inline:
            warm_workers(pipeline, start_method)

    # ------------------------------------------------------------------------ public API
    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("Loader: iterated after close(); create a new loader")
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"Loader: iterated in process {os.getpid()}, forked from process {self._pid} "
                "that built it; its workers and shared memory are that process's: build a new "
                "loader in this one"
            )
        # One epoch at a time: a new iter() ends the previous one, which says so if used again.
        self._end_active("was ended by a new iter() on the loader, which starts a new epoch")
        self._inline_epoch = False
        if not self.inline and (self._executor is None or not self.persistent_workers):
            self._drop_executor()
            self._inline_epoch = self._inline_sooner()
            if self._inline_epoch:  # no executor: the reads stand in for workers of this iter()
                new_view(self.pipeline.source)
            else:
                self._snapshot_now()
        elif self.inline and not (self.strategy.inline or self.persistent_workers):
            new_view(self.pipeline.source)  # read in place of new workers: the dataset as now
        it = EpochIterator(self._iterate(), self._epoch)
        # Held weakly: a dropped iterator (``break``) is collected at once, stopping the workers.
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
        if isinstance(source, ShardedSource) and _ranks.active(self.even_ranks, source):
            return min(items_out(self.pipeline.stages, k) for k in source.rank_lengths())
        return items_out(self.pipeline.stages, n)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run ``epoch`` (seeds unit order and shuffling)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"Loader.set_epoch(): epoch must be an int >= 0, got {epoch!r}")
        self._epoch, self._pending = epoch, None

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration runs."""
        return self._epoch

    def state_dict(self) -> dict:
        """What was delivered in the current epoch; independent of worker counts."""
        if self._pending is not None:
            return dict(self._pending)
        state = self._progress.state()
        state["version"] = STATE_VERSION
        state["units_state"] = self._units_state
        state["fingerprint"] = _state.fingerprint(self.pipeline)
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Resume from ``state`` at the next ``iter()``: exactly the undelivered items.

        Raises:
            StateError: ``state`` is not a loader state of this version, a field's type or
                range is wrong (named), or another pipeline or source saved it (fingerprint).
        """
        state = _state.check(state, STATE_VERSION, _state.fingerprint(self.pipeline))
        self._end_active("was ended by load_state_dict(); iterate the loader again to resume")
        self._pending = dict(state)

    def release_tuner(self) -> Any:
        """Stop tuning this loader and hand its tuner over (e.g. to a training callback): the
        current epoch's tuning loop stops, later epochs run with the allocation the tuner
        left. Returns the tuner (None if the loader had none).

        Raises:
            BaseException: what the loader's tuning loop raised, if it ended with an error.
        """
        (tuner, self.tuner), (loop, self._tuning) = (self.tuner, None), (self._tuning, None)
        if loop is not None:
            loop.stop(raise_error=True)
        return tuner

    @property
    def tunable(self) -> RunningPipeline | None:
        """The running pipeline as a Tunable (None until the first ``iter()``)."""
        return self._tunable

    def observe(self) -> Observation | None:
        """An observation of the running pipeline now; between epochs (no workers run) the
        last one of the last epoch's pipeline, taken as it stopped; None before the first.

        Raises:
            RuntimeError: the loader is closed, or its last epoch ended early (an error, a
                ``break``: chained) and stopped the workers.
        """
        if self._closed:
            raise RuntimeError("Loader.observe(): the loader is closed; create a new one")
        if self._executor is None and self._last_error is not None:
            e = self._last_error
            how = f" with {type(e).__name__}: {e}" if e else ""
            raise RuntimeError(
                f"Loader.observe(): no pipeline runs: the last epoch ended early{how} and "
                "stopped its workers; iterate the loader again to start them"
            ) from e
        tunable = self._tunable
        if tunable is not None:
            return tunable.observe()
        for closing in self._held.get("closing", ()):
            closing.join()  # the last epoch's workers stop and say how they ran
        return self._final.get("obs")

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

    def _snapshot_now(self) -> None:
        """The next executor's spec and a snapshot of this process for its workers, taken now
        (at ``iter()``, in the calling thread, as torch forks its workers): what they see."""
        spec = executor_spec(
            self.pipeline, ordered=self.ordered, max_restarts=self.max_restarts,
            start_fused=bool(getattr(self.tuner, "starts_fused", False)),
            allocation=self._allocation, start_method=self.start_method,
        )  # fmt: skip
        kept = self._held.get("kept_snapshot")
        if kept is not None:  # persistent workers see the first iter(), also after an early end
            self._next = (on_snapshot(spec, kept, self._kept_stages), kept)
            self._kept_reused = True
            return
        snapshot = take_snapshot(spec, self.pipeline.source)
        self._next = (spec, snapshot)
        self._held["kept_snapshot" if self.persistent_workers else "snapshot"] = snapshot
        self._kept_stages = [(s.fn, s.init) for s in spec.stages]

    def _ensure_executor(self) -> Executor:
        if self._executor is None:
            if self._next is None:
                self._snapshot_now()
            assert self._next is not None
            (spec, snapshot), self._next = self._next, None
            self._held.pop("snapshot", None)  # the executor's from here on
            keep = snapshot is not None and snapshot is self._held.get("kept_snapshot")
            ex, self._tunable = start_executor(
                spec, snapshot=snapshot, machine=self._machine, clock=self._clock,
                memory_limit_bytes=self.memory_limit_bytes, prefetch_slot=self._prefetch,
                kinds=self._kinds, source=self.pipeline.source, keep_snapshot=keep,
            )  # fmt: skip
            self._executor = ex
            self._held["executor"] = ex
        return self._executor

    def _drop_executor(self, background: bool = False) -> None:
        """Close the executor (its allocation kept for the next) and a snapshot no executor
        took; ``background``: its workers stop on a thread of their own (an epoch that ended
        whole need not wait for them; :meth:`close` and the finalizer do)."""
        ex, self._executor = self._executor, None
        tunable, self._tunable = self._tunable, None
        self._held.pop("executor", None)
        self._held.pop("snapshot", None)
        nxt, self._next = self._next, None
        if nxt is not None and nxt[1] not in (None, self._held.get("kept_snapshot")):
            nxt[1].stop()
        if ex is None:
            return
        if tunable is not None:
            try:
                self._allocation = tunable.allocation()
            except Exception:  # closed by a failure: the last allocation stands
                pass
        final = self._final = {}
        stop_pipeline(ex, tunable, final, self._held if background else None)

    def _iterate(self) -> Generator[Any, None, None]:
        sync = _ranks.RankSync() if _ranks.active(self.even_ranks, self.pipeline.source) else None
        state, self._pending = self._pending, None
        epoch, progress, works, self._units_state = plan_epoch(
            self.pipeline.source, self._epoch, state
        )
        self._epoch, self._progress = epoch, progress
        faststart = None
        if self.inline:
            stream = run_inline(self.pipeline, works, epoch, not self.strategy.inline)
        elif self._fast_start_applies():
            faststart = FastStart(
                self.pipeline, works, epoch, self._ensure_executor, self._on_started,
                choose_shape=self.strategy.choose_shape, may_go_inline=lambda: self.tuner is not None,
                on_inline=self._go_inline, delivered=lambda: (progress.done, progress.seen),
                interval_s=self.tuning_interval_s, probe=self._shape_probe,
                on_built=self._on_built, inline_context=inline_context(self.pipeline),
                kind_probe=None if self._inline_epoch else self._kind_probe(),
                build=not self._inline_epoch,
            )  # fmt: skip
            stream = faststart.stream()
        else:
            stream = self._ensure_executor().run(works, epoch)
        if self.strategy.interleave:
            starts = {w.pos: skip_prefix(set(w.skip)) for w in works}
            stream = interleave(stream, starts, progress.last_unit)
        self.last_epoch_dropped = 0
        pre = make_prefetcher(self.pipeline.prefetch_spec, stream, self.timeout_s)
        if pre is not None:
            self._prefetch[:] = [weakref.ref(pre)]
        feed = EpochFeed(stream, pre, self.timeout_s, self.inline, lambda: busy(self._executor))
        self._tuning = self._start_tuning()  # None until the executor runs (fast start)
        self._watcher = self._start_watch()
        complete = False
        closed_by_consumer = False
        try:
            while True:
                self._clock.asked()
                t = feed.next()
                if t is not END and t[0] >= 0 and t[1] < 0:
                    progress.end(t[0], -1 - t[1])
                    continue
                if sync is not None and not sync.all_have(t is not END):
                    if t is not END:  # another rank ran out: drop what is left here
                        _, dropped = feed.drain_tail(progress, drop_items=True)
                        self.last_epoch_dropped = 1 + dropped
                        sync.report_dropped(self.last_epoch_dropped, epoch)
                    break
                if t is END:
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
        else:
            self._last_error = None
        finally:
            # Collected in a forked child, nothing here is the child's to stop (and the
            # executor's locks may be held by threads that do not exist there).
            if os.getpid() == self._pid:
                self._clock.pause()
                if closed_by_consumer and not self.inline and self._took_everything(progress):
                    # Consumers that stop at len() (Lightning) never ask for the end of the
                    # stream: read what is left (end-of-unit markers) so the epoch counts as
                    # complete and the workers are kept for the next one.
                    complete, dropped = feed.drain_tail(progress, drop_items=sync is not None)
                    self.last_epoch_dropped += dropped
                    if sync is not None and self.last_epoch_dropped:
                        sync.report_dropped(self.last_epoch_dropped, epoch)
                    if complete:
                        progress.finished = True
                        self._epoch = epoch + 1
                if closed_by_consumer and not sys.is_finalizing():  # generator as torch's leaves it
                    left_early(self.pipeline.source, progress.delivered)
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
                if (not complete or not self.persistent_workers) and not self.inline:
                    # Wakes a prefetch thread waiting on the executor, at once if it ended early.
                    self._drop_executor(background=complete)
                feed.close(timed_out=isinstance(sys.exc_info()[1], LoaderTimeoutError))
                if watcher is not None:
                    watcher.stop()
                if loop_error is not None:
                    raise loop_error

    def _inline_sooner(self) -> bool:
        """Whether a loader choosing its shape reads this epoch inline whole, building no
        executor: its units (``len()``, at least as many), read as fast as its inline reads
        alone so far, take less than workers would (a short epoch, a small validation set:
        :meth:`ShapeProbe.inline_sooner`)."""
        if self.persistent_workers or self.tuner is None or not self.strategy.choose_shape:
            return False
        with contextlib.suppress(TypeError):
            return self._fast_start_applies() and self._shape_probe.inline_sooner(len(self))
        return False

    def _fast_start_applies(self) -> bool:
        """Whether this epoch's first units may run inline while the workers start: until
        the first epoch with workers, or the shape is chosen; never after a persistent
        loader's first epoch (its workers see the first ``iter()``'s dataset, not this)."""
        return (
            self.strategy.fast_start
            and not self._kept_reused
            and (
                self._executor is None
                or (self.strategy.choose_shape and self._shape_probe.decided is None)
            )
            and fast_start_fits(self.pipeline, self.strategy.interleave, self.timeout_s)
        )

    def _kind_probe(self) -> KindProbe | None:
        """The kind the first executor's ``auto`` stages start on, measured (``kindstart``)."""
        if self._executor is not None:
            return None
        if self._next is None:
            self._snapshot_now()
        note = functools.partial(note_event, self.tuning_log)
        return kind_probe(self, self._kinds, self.pipeline, note)

    def _go_inline(self, why: str) -> None:
        """Read inline from now on (this epoch's rest, every later one): no tuner, no workers."""
        log.info("Loader: reading in the calling thread from now on: %s", why)
        loop, self._tuning = self._tuning, None
        if loop is not None:
            loop.stop(raise_error=False)  # before the event: the log ends with the switch
        note_event(self.tuning_log, "inline", f"the loader reads in the calling process: {why}")
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
        self._drop_executor()
        self.inline = True

    def _on_built(self) -> None:
        """The executor of a fast start is built (background thread): show its progress."""
        if self._watcher is None:
            self._watcher = self._start_watch()

    def _on_started(self) -> None:
        """The executor took over from a fast start: tune it from now on."""
        if self._tuning is None:
            self._tuning = self._start_tuning()

    def _took_everything(self, progress: Progress) -> bool:
        with contextlib.suppress(TypeError):
            return progress.delivered >= len(self)
        return False

    def _start_tuning(self) -> Any:
        if self._tunable is None or self.inline:
            return None
        if self.tuner is None:
            # No tuner: the stages keep their knobs, but an "auto" stage's kind is measured.
            if any(s.worker_type == "auto" for s in self._tunable.executor.spec.stages):
                return KindLoop(self._tunable, self.tuning_interval_s).start()
            return None
        # One tuner per Loader: later epochs continue it (no reset), so allocations and what
        # the agent learned carry over. After a last loop that stepped past its first tick,
        # what is left measured is the epoch's drained end: held; else a new pipeline's first
        # tick steps on the last one's final observation (the whole short epoch).
        prev = self._last_tuning
        if prev is not None and prev.steps >= 1:
            self._tuner_started = True  # its reset was made: later loops step on
        first, held = not self._tuner_started, prev is not None and prev.steps >= 2
        same, final = prev is not None and prev.tunable.tunable is self._tunable, self._final
        self._last_tuning = start_tuning(
            self._tunable, self.tuner, self.tuning_interval_s, self.tuning_log, reset=first,
            hold_first=held, labels=consumer_labels(self.pipeline),
            carried=None if same or held else lambda: final.get("obs"),
        )  # fmt: skip
        return self._last_tuning

    def _start_watch(self) -> Any:
        if not self.progress or self._tunable is None or self.inline:
            return None
        return start_watch(
            self._tunable, self._machine, self._clock, self.memory_limit_bytes,
            unit=consumer_labels(self.pipeline)["unit"],
        )  # fmt: skip
