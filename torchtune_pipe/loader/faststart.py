"""Fast start: an epoch's first units run in the calling thread while the workers start.

Starting worker processes costs about a second or more (the fork server imports torch, every
worker unpickles the dataset), and torch's DataLoader hands out its first batch long before
that. So the first units of an epoch are read inline, one at a time, in the consumer's thread,
while the executor starts in a background thread; once every worker has said hello, the units
not yet taken go to the executor. Units are taken in order and an inline unit is read whole
before it is delivered, so the order, the batch boundaries and the exactly-once bookkeeping are
those of a run on workers alone. Workers that are not persistent start again every epoch, in
tens of milliseconds once the first start has warmed up: where the last start served sooner
than a unit reads inline, the epoch's first units are left to them.

Per-unit seeds make an inline unit draw the numbers a worker would draw; the global generators
of the calling thread are saved around each inline read and restored, so the training loop's
own random draws are not disturbed.

Where the loader may choose its shape (``num_workers="auto"``), the inline phase doubles as a
measurement (:mod:`torchtune_pipe.loader.shape`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from multiproc import intraop
from multiproc.items import own_memory
from multiproc.serialize import hop_s
from multiproc.worker import act_as_thread_worker
from torchtune_pipe.loader.inline import run_inline
from torchtune_pipe.loader.kindprobe import Helper, KindProbe, Measured, read_or_error, runq_s
from torchtune_pipe.loader.shape import (
    INLINE_MAX_WAIT_RATIO,
    SETTLE_INTERVALS,
    SETTLE_MIN_S,
    WAIT_EVIDENCE_S,
    ShapeProbe,
    measured,
)
from torchtune_pipe.loader.switching import quick_switches
from torchtune_pipe.loader.tagging import Work
from torchtune_pipe.sources.rng import isolated_rng
from torchtune_pipe.sources.views import standing_in
from torchtune_pipe.stages import PipelineLike
from torchtune_pipe.tuning.worker_kind import start_share

log = logging.getLogger(__name__)

# How long a consumer that stops during the inline phase waits for the executor being built
# (so that it can be closed rather than leaked).
_JOIN_S = 120.0
# How often the build's thread asks a built executor whether it serves (_time_serving).
SERVING_POLL_S = 0.002
# Kind probe (KindProbe): rounds of one unit alone then k at once, at most; the measured read
# time after which it stops with KIND_ROUNDS_MIN rounds (with one, from twice that); and its
# own wall time after which it starts no more reads.
KIND_ROUNDS_MIN = 2
KIND_ROUNDS_MAX = 6
KIND_PROBE_S = 0.06
KIND_PROBE_MAX_S = 0.3


@contextlib.contextmanager
def _intraop_threads(n: int) -> Iterator[None]:
    """The calling thread's torch intra-op threads set to ``n`` (where the count is a
    thread's own: :func:`multiproc.intraop.set_here`), then put back."""
    before = intraop.of_this_thread()
    intraop.set_here(n)
    try:
        yield
    finally:
        intraop.set_here(before)


def _owned(items: list) -> list:
    """Tagged items read in this process for the workers, as the workers' would arrive: what
    views memory it does not own (a row of the dataset's tensor) copied
    (:func:`multiproc.items.own_memory`), so the consumer may write to its batches as it may
    to a worker's. Not once the loader reads inline for good (``num_workers=0``'s way)."""
    return [(u, k, own_memory(x)) for u, k, x in items]


def fast_start_fits(pipeline: PipelineLike, interleave: bool, timeout_s: float) -> bool:
    """Whether a pipeline's first units may be read in the calling thread: no shuffle or batch
    stage (they group items across units), no interleaving, no prefetch thread (inline reads
    reseed the global generators, which only the consumer's own thread may touch) and no
    timeout, no remote stage, and a source stage whose ``init`` (if any) can stand in
    inline."""
    init = pipeline.stages[0].init
    return (
        (init is None or hasattr(init, "inline"))  # an init a read may need
        and not interleave
        and pipeline.prefetch_spec is None
        and not timeout_s
        and not any(st.stateful for st in pipeline.stages)
        # Inline reads would run a remote stage's function here, not on its actors.
        and all(st.placement == "local" for st in pipeline.stages)
    )


def inline_context(pipeline: PipelineLike) -> Any:
    """What makes the calling thread stand in for a source worker during a fast start: the
    source stage's ``init.inline`` where its init has one (the DataLoader's sets torch's
    worker info), else nothing."""
    return getattr(pipeline.stages[0].init, "inline", contextlib.nullcontext)


class FastStart:
    """The stream of one epoch: inline units until the executor is ready, then the executor
    (and, where ``choose_shape``, back inline when that measures clearly faster).

    An executor that comes to serve while the consumer reads a unit inline is given the units
    after that one at once (its run starts on the build's thread), not when the read ends:
    its workers would idle meanwhile (after a kind probe, a whole unit's read). Not during
    the epoch's first unit: its batch is the first the consumer gets, and workers reading
    beside it take the cores it runs on.

    Args:
        pipeline: the pipeline (no shuffle or batch stages: those group items across units).
        works: the epoch's work, in order.
        epoch: the epoch.
        start: builds the executor (called once, on a background thread).
        on_started: called in the consumer's thread when the executor takes over (the loader
            starts its tuner there).
        choose_shape: compare the workers with inline reads and keep the faster.
        may_go_inline: asked before going inline (False: keep the workers, e.g. a training
            callback tunes them now).
        on_inline: called when inline was chosen, with the reason in words: the loader stops
            its tuner and closes the executor (the run is closed after it).
        delivered: the epoch's delivered positions by unit (``done`` units and ``seen``
            items of partial ones), to know what is left when going back inline.
        interval_s: the tuner's interval (measurement windows are this long).
        probe: the shape choice's measurements so far (updated in place).
        on_built: called on the background thread once the executor is built (the loader
            starts its progress display there).
        inline_context: a context manager factory entered around every inline read, to make
            the calling thread look like a worker to the source (``get_worker_info()``).
        kind_probe: measure the reads on threads first (:class:`KindProbe`); the executor
            starts after it.
        torch_threads: torch intra-op threads of an inline read: a worker process's
            (``StageSpec.torch_threads``, 1 in every spec the loader builds).
        build: build the executor (False: the epoch is read inline whole, none is built;
            :meth:`ShapeProbe.inline_sooner`).
    """

    def __init__(
        self,
        pipeline: PipelineLike,
        works: list[Work],
        epoch: int,
        start: Callable[[], Any],
        on_started: Callable[[], None],
        *,
        choose_shape: bool = False,
        may_go_inline: Callable[[], bool] = lambda: True,
        on_inline: Callable[[str], None] | None = None,
        delivered: Any = None,
        interval_s: float = 1.0,
        probe: ShapeProbe | None = None,
        on_built: Callable[[], None] | None = None,
        inline_context: Callable[[], Any] = contextlib.nullcontext,
        kind_probe: KindProbe | None = None,
        torch_threads: int = 1,
        build: bool = True,
    ):
        self.pipeline = pipeline
        self.works = works
        self.epoch = epoch
        self.on_started = on_started
        self.choose_shape = choose_shape and on_inline is not None and delivered is not None
        self.on_inline = on_inline
        self.may_go_inline = may_go_inline
        self.on_built = on_built
        self.inline_context = inline_context
        self.delivered = delivered
        self.interval_s = max(0.05, float(interval_s))
        self.inline_units = 0
        self._t0 = time.perf_counter()
        self._joined = threading.Event()
        self.probe = probe if probe is not None else ShapeProbe()
        self._executor: Any = None
        self._error: BaseException | None = None
        self._built = threading.Event()
        self._build_t0 = self._t0  # when the build began (after a kind probe, where one runs)
        self.kind_probe = kind_probe
        self.torch_threads = torch_threads
        self._units: queue.SimpleQueue = queue.SimpleQueue()  # the probe's units, in order
        self._stop_probe = threading.Event()
        self._probe_thread: threading.Thread | None = None
        self._first_s = 0.0  # the first unit's read time (a kind probe's warm-up)
        self._served = False  # the executor served while the epoch ran (_time_serving)
        self._warm = self.probe.serving_s is not None  # an executor was built before this one
        self._lock = threading.Lock()  # the counts the probe's thread adds to
        # The handover of the units after the one read inline now (class docstring): that
        # unit's index (None: no read that may be handed over from), and the run started
        # from the next one with the index it starts at, under their own lock.
        self._handover = threading.Lock()
        self._reading: int | None = None
        self._early: tuple[Iterator[tuple], int] | None = None
        self._thread = threading.Thread(
            target=self._build, args=(start,), name="torchtune_pipe-start", daemon=True
        )
        self.builds = build or kind_probe is not None
        if kind_probe is None and build:
            self._start_build()

    def _start_build(self) -> None:
        self._build_t0 = time.perf_counter()
        self._thread.start()

    def _build(self, start: Callable[[], Any]) -> None:
        try:
            with quick_switches():  # beside inline reads that hold the interpreter lock
                self._executor = start()
            if self.on_built is not None:
                self.on_built()
        except BaseException as e:  # raised in the consumer's thread by stream()
            self._error = e
        finally:
            self._built.set()
        self._time_serving()

    def _time_serving(self) -> None:
        """On the build's thread: note how long after its build began the executor serves
        (:attr:`ShapeProbe.serving_s`, what the next epoch's start expects of its own)."""
        ex = self._executor
        while ex is not None and not self._joined.is_set():
            try:
                if ex.serving():
                    self.probe.serving_s = time.perf_counter() - self._build_t0
                    self._served = True
                    self._hand_over(ex)
                    return
            except Exception:  # closed meanwhile: nothing to time
                return
            self._joined.wait(SERVING_POLL_S)

    def _hand_over(self, ex: Any) -> None:
        """On the build's thread, once ``ex`` serves: where the consumer reads a unit inline
        that may be handed over from, start the run of the units after it."""
        with self._handover:
            i = self._reading
            if i is None or i + 1 >= len(self.works) or self._joined.is_set():
                return
            self._early = (ex.run(self.works[i + 1 :], self.epoch), i + 1)
            log.debug("fast start: the workers take over from unit %d", i + 1)

    def _may_read_inline(self, i: int) -> bool:
        """Whether the consumer reads unit ``i`` inline (the executor not ready, nor expected
        sooner than the read), noting it as the unit the workers may take over after, unless
        it is the epoch's first to be delivered."""
        if not self.builds:
            return True
        with self._handover:
            if self._ready() or self._workers_sooner():
                return False
            self._reading = i if i > 0 else None
            return True

    def _workers_sooner(self) -> bool:
        """Whether the workers, as quick to serve as the last executor was, will serve before
        one more unit read inline would be (the mean of those read one at a time): then they
        read it, and the consumer waits for them rather than read inline while they idle
        (every epoch of non-persistent workers starts an executor)."""
        p = self.probe
        if p.serving_s is None or not p.units_read:
            return False
        left = p.serving_s - (time.perf_counter() - self._build_t0)
        return left < p.inline_s / p.units_read

    def _ready(self) -> bool:
        """Built, and serving (its first workers have started; the rest start while it
        runs), or building failed."""
        if not self._built.is_set():
            return False
        ex = self._executor
        if ex is None:
            return True
        return ex.serving()

    def _read_inline(self, work: Work) -> list:
        return self._read_timed(work, self._inline_read)[0]

    @contextlib.contextmanager
    def _inline_read(self) -> Iterator[None]:
        """Around a read in the consumer's thread: its generators kept, a worker's view and a
        worker's intra-op threads (the interpreter's default, all the cores, spins against
        the workers' kernels once they run: a 65 ms unit was measured at 0.5 s)."""
        with (
            isolated_rng(),
            standing_in(),
            self.inline_context(),
            _intraop_threads(self.torch_threads),
        ):
            yield

    def _read_timed(
        self, work: Work, context: Callable[[], Any] = contextlib.nullcontext, alone: bool = True
    ) -> tuple[list, float]:
        """Read ``work`` in this thread within ``context()``, its time counted in
        :attr:`probe` (the consumer's inline reads, and a kind probe's reads alone): its items
        and the seconds it took less those it waited for a CPU."""
        t0, q0, c0 = time.perf_counter(), runq_s(), time.thread_time()
        with context():
            items = self._read_unit(work)
        # Time spent waiting for a CPU is not the reads' cost: while the workers start, the
        # fork server and the workers' imports take the cores from this thread.
        took = max(0.0, time.perf_counter() - t0 - (runq_s() - q0))
        p = self.probe
        with self._lock:
            p.inline_s += took
            p.inline_cpu_s += time.thread_time() - c0
            p.inline_items += sum(1 for t in items if t[1] >= 0)
            p.units_read += 1
            if alone and self._thread.ident is None:  # no build started: nothing beside it
                p.alone_s += took
                p.alone_units += 1
            self.inline_units += 1
        return items, took

    def _read_unit(self, work: Work) -> list:
        return list(run_inline(self.pipeline, [work], self.epoch))

    def _read_together(
        self, works: list[Work], helpers: list[Helper]
    ) -> list[list | BaseException]:
        """Read ``works`` at once, the first on this thread and each other on one of
        ``helpers``: each unit's items, or what its read raised."""
        for h, w in zip(helpers, works[1:], strict=False):
            h.give(w)
        out = [read_or_error(self._read_unit, works[0])]
        out += [h.result() for h in helpers[: len(works) - 1]]
        with self._lock:
            self.inline_units += len(works)
        return out

    def _probe_kinds(self) -> None:
        """The probe's thread: rounds of one unit alone then ``k`` at once (:meth:`_rounds`),
        then the decision and the executor's build (none of those when the consumer
        stopped)."""
        kp = self.kind_probe
        assert kp is not None
        got = Measured()
        act_as_thread_worker()
        intraop.set_here(kp.torch_threads)  # as a worker's: not the interpreter's default
        try:
            if kp.threads >= 2 and kp.may_run():
                with kp.thread_context():
                    # Started before the rounds: a thread's start (a millisecond or more on
                    # some machines) is not a cost of reading on threads.
                    helpers = [Helper(self._read_unit, kp) for _ in range(kp.threads - 1)]
                    try:
                        got = self._rounds(helpers)
                    finally:
                        for h in helpers:
                            h.stop()  # inside this thread's context: see Helper.stop
            if self._stop_probe.is_set():
                return
            p = self.probe
            with self._lock:
                ratio = (
                    p.inline_s / p.inline_cpu_s if p.inline_cpu_s > 0 and p.inline_items else None
                )
            if got.error is not None:
                # The reads fail on a thread (a handle bound to the thread that opened it, or
                # bad data): the consumer reads the failing unit again, in its own thread.
                kp.decide(0.0, 0.0, 0.0, ratio, got.error)
            else:
                kp.decide(*got.rates(kp.threads), ratio, None)
            self._start_build()
        except BaseException as e:  # the consumer gets it in the unit's place
            self._units.put(e)
        finally:
            act_as_thread_worker(False)
            self._units.put(None)  # the probe's units end here

    def _rounds(self, helpers: list[Helper]) -> Measured:
        """Rounds of one unit alone then ``k`` at once, each unit's items put on
        :attr:`_units` in order; what the counted ones measured. A read that raises ends them:
        the units before it are delivered, it and the rest are the consumer's to read."""
        k, works, units = len(helpers) + 1, self.works, self._units
        kp = self.kind_probe
        assert kp is not None
        i = 1
        got = Measured()
        # A first round warms the helpers up (a new thread's first reads pay for its
        # allocator's first pages and its caches, as a new worker's do, once), where it and a
        # counted round fit in the probe's time.
        warm = 4 * self._first_s <= KIND_PROBE_MAX_S / 2
        start = time.perf_counter()
        while got.rounds < KIND_ROUNDS_MAX and i + 1 + k <= len(works):
            if self._stop_probe.is_set() or time.perf_counter() - start >= KIND_PROBE_MAX_S:
                break
            try:
                # Less its waits for a CPU: another process's load is not what one read costs
                # (it would make k reads at once look to scale where they do not).
                c0 = time.thread_time()
                items, one_s = self._read_timed(works[i])
                one_cpu = time.thread_time() - c0
            except Exception as e:
                got.error = e
                return got
            one_items = sum(1 for t in items if t[1] >= 0)
            units.put(items)
            i += 1
            hop = self._capped_hop(items, one_s, one_cpu, one_items, got) if i == 2 else None
            if got.capped:
                return got  # the first read alone: threads could not win (nothing more read)
            if time.perf_counter() - start >= KIND_PROBE_MAX_S:
                break  # its round would end past the bound: not counted
            t0 = time.perf_counter()
            reads = self._read_together(works[i : i + k], helpers)
            k_s = time.perf_counter() - t0
            k_items = 0
            for r in reads:
                if isinstance(r, Exception):
                    got.error = r
                    return got
                if isinstance(r, BaseException):
                    raise r
                units.put(r)
                i += 1
                k_items += sum(1 for t in r if t[1] >= 0)
            if warm:
                warm = False
                continue
            got.alone_s, got.alone_items = got.alone_s + one_s, got.alone_items + one_items
            got.together_s, got.together_items = got.together_s + k_s, got.together_items + k_items
            # what a worker process would add
            got.hop_s += hop_s(items, kp.arena_bytes) if hop is None else hop
            got.rounds += 1
            read_s = got.alone_s + got.together_s
            if read_s >= 2 * KIND_PROBE_S or (
                got.rounds >= KIND_ROUNDS_MIN and read_s >= KIND_PROBE_S
            ):
                break
            _, together, processes = got.rates(k)
            if got.rounds == 1 and processes > 0 and kp.clear(together, processes):
                break  # a second round would not change the kind: the workers start now
        return got

    def _capped_hop(
        self, items: list, one_s: float, cpu_s: float, n: int, got: Measured
    ) -> float | None:
        """The hop between processes of this read alone (``items``, ``n`` of them, in ``one_s``
        with ``cpu_s`` of CPU), measured where it decides whether ``k`` reads at once on
        threads, at most ``k`` times as fast as this one, would still fall short of the share
        of ``k`` processes' rate that threads start from
        (:func:`~torchtune_pipe.tuning.worker_kind.start_share`); None where not measured.
        They would for reads that compute and whose hop costs a few percent of them: then
        nothing more is read on threads (the stage starts on processes, settled as by a
        measure of both) and ``got`` holds this read, ``capped``."""
        share = start_share(None, one_s / cpu_s if cpu_s > 0 else None)
        if one_s <= 0 or not n or share <= 1.0:  # a tie or less may start threads: measure
            return None
        kp = self.kind_probe
        assert kp is not None
        hop = hop_s(items, kp.arena_bytes)
        if (one_s + hop) / one_s < share:
            got.alone_s, got.alone_items, got.hop_s, got.capped = one_s, n, hop, True
        return hop

    def _probed_start(self) -> Iterator[tuple]:
        """The first unit in the calling thread, then the probe's units in order (the number
        read in ``self._probed``)."""
        if not self.works:
            self._start_build()
            return
        t0 = time.perf_counter()
        # A warm-up (imports, first opens): not what a read alone costs.
        items = self._read_timed(self.works[0], self._inline_read, alone=False)[0]
        self._first_s = time.perf_counter() - t0
        self._probed = 1
        self._probe_thread = threading.Thread(
            target=self._probe_kinds, name="torchtune_pipe-kind-probe", daemon=True
        )
        self._probe_thread.start()
        yield from _owned(items)
        while (got := self._units.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            self._probed += 1
            yield from _owned(got)

    def stream(self) -> Iterator[tuple]:
        """The tagged items of the epoch (as ``Executor.run`` yields them); an epoch read
        whole by a warm executor (not after a kind probe, not gone inline) tells the probe
        how long the consumer waited (:attr:`ShapeProbe.workers_s`)."""
        waited, t = 0.0, time.perf_counter()
        for item in self._stream():
            waited += time.perf_counter() - t
            yield item
            t = time.perf_counter()
        waited += time.perf_counter() - t
        p = self.probe
        if self._warm and self.builds and self.kind_probe is None and p.decided != "inline":
            p.workers_s, p.workers_units = waited, len(self.works)

    def _stream(self) -> Iterator[tuple]:
        i = 0
        if self.kind_probe is not None:
            self._probed = 0
            try:
                yield from self._probed_start()
            finally:
                self._stop_probe.set()
            i = self._probed
        while i < len(self.works) and self._may_read_inline(i):
            try:
                items = self._read_inline(self.works[i])
            finally:
                with self._handover:
                    self._reading = None
            i += 1
            yield from _owned(items)
            if self._early is not None:
                break
        self._wait_built()
        if self._error is not None:
            raise self._error
        log.debug("fast start: %d unit(s) read inline", i)
        self.on_started()
        p = self.probe
        if self.choose_shape and p.decided is None and p.inline_items:
            if (
                p.inline_s >= WAIT_EVIDENCE_S
                and p.inline_s > INLINE_MAX_WAIT_RATIO * p.inline_cpu_s
            ):
                p.decided = "workers"  # the reads wait: only workers overlap their waits
        if self._early is not None:
            run, i = self._early
        elif i >= len(self.works):
            return
        else:
            run = self._executor.run(self.works[i:], self.epoch)
        if p.settle_until is None:  # the tuner's first moves are not the workers' measure
            p.settle_until = time.perf_counter() + max(
                SETTLE_MIN_S, SETTLE_INTERVALS * self.interval_s
            )
        if not self.choose_shape or p.decided is not None or not p.inline_items:
            yield from run
            return
        yield from measured(run, p, self.interval_s, self.may_go_inline, self.on_inline)
        if p.decided == "inline":
            for w in self._left():
                yield from self._read_inline(w)

    def _left(self) -> list[Work]:
        """The works not delivered yet, skipping the items of partial units already given."""
        done, seen = self.delivered()
        return [
            Work(w.pos, w.unit, frozenset(w.skip) | frozenset(seen.get(w.pos, ())))
            for w in self.works
            if w.pos not in done
        ]

    def join(self) -> None:
        """Wait until the executor is built (or failed), so that nothing is left half made;
        at once where its build never started (a kind probe that stopped). The epoch is over:
        its executor's start is no longer timed: one that did not serve yet serves no sooner
        than now (:attr:`ShapeProbe.serving_s`, where nothing later was measured)."""
        if self._thread.ident is not None and not self._served:
            waited = time.perf_counter() - self._build_t0
            self.probe.serving_s = max(self.probe.serving_s or 0.0, waited)
        self._joined.set()
        self._wait_built()

    def _wait_built(self) -> None:
        if self._probe_thread is not None:
            self._stop_probe.set()
            self._probe_thread.join()
        if self._thread.ident is None:
            return
        if not self._built.wait(_JOIN_S):
            log.warning("fast start: the executor did not start within %.0f s", _JOIN_S)
