"""The running pipeline: its executor, and the :class:`RunningPipeline` tuners steer.

:func:`start_executor` builds a pipeline's executor and the
:class:`~torchtune_pipe.telemetry.measure.Meter` that observes it; :class:`RunningPipeline` is the
:class:`~torchtune_pipe.tuning.base.Tunable` the tuning loop steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import weakref
from typing import Any

from multiproc import Executor, ExecutorSpec
from multiproc.errors import ExecutorClosedError
from multiproc.fusion import fuse_all
from multiproc.snapshot import Snapshot, forks
from torchtune_pipe.remote import stage as _remote
from torchtune_pipe.sources.base import frame_items, max_readers, new_view
from torchtune_pipe.stages import PipelineLike
from torchtune_pipe.telemetry import measure as telemetry
from torchtune_pipe.telemetry.memory import MemoryProbe
from torchtune_pipe.tuning.base import Allocation, Observation
from torchtune_pipe.tuning.worker_kind import KindRule

log = logging.getLogger(__name__)


class RunningPipeline:
    """A running pipeline as a :class:`~torchtune_pipe.tuning.base.Tunable`.

    ``observe()`` reports the interval since the previous call; ``apply()`` calls
    ``executor.resize`` / ``executor.set_budget`` for the stages that change. It applies what
    it is given: the tuning loop wraps it in :class:`~torchtune_pipe.tuning.safety.Guarded`,
    which applies the hard limits (CPU budget, memory) once per decision.
    """

    def __init__(
        self, executor: Executor, meter: telemetry.Meter, kinds: KindRule | None = None
    ) -> None:
        self.executor = executor
        self.meter = meter
        # Threads or processes for worker_type="auto" stages; a loader passes the one it keeps
        # from epoch to epoch, so a kind decided once is not tried again every epoch.
        self.kinds = kinds if kinds is not None else KindRule()
        self._last: Observation | None = None

    def observe(self, read_memory: bool = True) -> Observation:
        """Rates since the previous observation, plus machine facts (``read_memory``:
        :meth:`~torchtune_pipe.telemetry.measure.Meter.observe`)."""
        self._last = self.meter.observe(read_memory)
        return self._last

    def apply(self, allocation: Allocation) -> None:
        """Resize stages and buffers to ``allocation`` (budgets within each stage's
        ``max_buffer_bytes``); calls in flight per worker where the allocation leaves them open
        follow the measured rule (:func:`~torchtune_pipe.tuning.calls_in_flight.plan_concurrency`),
        and so does the kind of a ``worker_type="auto"`` stage's workers where it leaves
        ``threads`` open (:class:`~torchtune_pipe.tuning.worker_kind.KindRule`); a stage built
        with another worker type keeps its kind.

        ``allocation.remote`` is honoured as far as the executor places workers: a
        ``placement="auto"`` stage connected to Ray (``remotable``) runs ``remote[i]`` of its
        ``workers[i]`` on the cluster (at most its ``max_workers``), moving workers between
        host and cluster; a ``placement="ray"`` stage runs all its workers remote
        (``allocation.workers`` of it are Ray actors) and a local stage none.

        Raises:
            ValueError: when ``allocation.remote`` asks a stage that is not remotable for
                another placement than the one it was built with.
        """
        from torchtune_pipe.tuning.calls_in_flight import plan_concurrency

        obs = self._last or self.observe()
        a = self.kinds.plan(obs, plan_concurrency(obs, allocation))
        ex = self.executor
        for i, st in enumerate(ex.spec.stages):
            if st.offload is not None:
                continue  # remotable: any split
            want = a.workers[i] if st.placement != "local" else 0
            if a.remote and min(a.remote[i], a.workers[i]) != want:
                raise ValueError(
                    f"RunningPipeline.apply: stage {st.name!r} runs with placement="
                    f"{st.placement!r}: {want} of its {a.workers[i]} workers remote, not "
                    f"{a.remote[i]} (a live stage keeps the placement it was built with)"
                )
        if a.fused:
            now = ex.fused()
            for j, f in enumerate(a.fused):
                if f != now[j]:
                    ex.set_fused(j, f)  # SpecError names why a stage cannot fuse
        for i, st in enumerate(ex.spec.stages):
            remote = None  # a stage without an offload has no remote count to move
            if st.offload is not None:
                # Empty: each stage keeps its placement (all remote stays all remote, else
                # its remote count, at most its workers; base.Allocation).
                now = ex.remote_workers(i)
                want = a.remote[i] if a.remote else now
                if not a.remote and now and now == ex.workers(i):
                    want = a.workers[i]
                remote = min(want, a.workers[i], st.offload.max_workers)
            threads = self._threads(i, a, a.workers[i] - (remote or 0))
            if (
                a.workers[i] != ex.workers(i)
                or (remote is not None and remote != ex.remote_workers(i))
                or (threads is not None and threads != ex.threads(i))
            ):
                ex.resize(i, a.workers[i], remote=remote, threads=threads)
            if a.concurrency[i] != ex.concurrency(i):
                ex.set_concurrency(i, a.concurrency[i])
            budget = a.buffer_bytes[i]
            if st.max_buffer_bytes is not None:
                budget = min(budget, st.max_buffer_bytes)
            if budget != ex.budget(i):
                ex.set_budget(i, budget)

    def apply_kinds(self) -> None:
        """Observe, and move the ``worker_type="auto"`` stages' workers between processes and
        threads as the kind rule says, every other knob kept as it runs (what a loader without
        a tuner runs, :class:`KindLoop`)."""
        obs = self.observe()
        a = self.kinds.plan(obs, obs.allocation())
        ex = self.executor
        for i in range(len(ex.spec.stages)):
            threads = self._threads(i, a, ex.workers(i) - ex.remote_workers(i))
            if threads is not None and threads != ex.threads(i):
                ex.resize(i, ex.workers(i), threads=threads)

    def _threads(self, i: int, a: Allocation, local: int) -> int | None:
        """Thread workers stage ``i`` runs under ``a`` (None: the kind it was built with)."""
        if self.executor.spec.stages[i].worker_type != "auto" or not a.threads:
            return None
        return max(0, min(a.threads[i], local))

    def allocation(self) -> Allocation:
        """The allocation the executor runs with now."""
        ex = self.executor
        n = len(ex.spec.stages)
        fused = ex.fused()
        remote = tuple(
            ex.workers(i) if s.placement != "local" else ex.remote_workers(i)
            for i, s in enumerate(ex.spec.stages)
        )
        threads = tuple(ex.threads(i) for i in range(n))
        calls = tuple(ex.concurrency(i) for i in range(n))
        return Allocation(
            tuple(ex.workers(i) for i in range(n)),
            tuple(ex.budget(i) for i in range(n)),
            fused=fused if any(fused) else (),
            remote=remote if any(remote) else (),
            threads=threads if any(threads) else (),
            concurrency=calls if any(c > 1 for c in calls) else (),
        )


class MachineFacts:
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


def as_tuner(tuner: Any) -> Any:
    """The Loader's ``tuner`` argument as the tuner it runs, or None for no tuning loop.

    None and ``"static"`` keep the stages' own knobs (no tuner steps them, so nothing clamps
    them either); another name is :func:`torchtune_pipe.tuning.make_tuner`'s tuner of that
    name; an object with ``reset`` and ``step`` is the tuner itself.

    Raises:
        ValueError: for an unknown name or an object that is not a tuner.
    """
    if tuner is None or tuner == "static":
        return None
    if isinstance(tuner, str):
        from torchtune_pipe.tuning.registry import make_tuner

        return make_tuner(tuner)
    if not (hasattr(tuner, "reset") and hasattr(tuner, "step")):
        raise ValueError(f"Loader: tuner must be None, a tuner name or a Tuner, got {tuner!r}")
    return tuner


def _prefetched_bytes(slot: list[weakref.ref]) -> int:
    """What the prefetcher in ``slot`` holds in this process for the pipeline."""
    pre = slot[0]() if slot else None
    return pre.held_bytes() if pre is not None else 0


def warm_workers(pipeline: PipelineLike, start_method: str = "fork") -> None:
    """Where workers are spawned (not forked from a snapshot of this process: ``start_method``
    "spawn", ``MULTIPROC_FORKSERVER=spawn``, a process that imported Ray), start the spawned
    fork server now, importing what the stages' functions need (the modules their pickles
    name, and the source's), so the first ``iter()`` finds it warm: a training script builds
    its loader, then its model, then iterates. A snapshot is taken at ``iter()`` instead."""
    from multiproc import buffers, servers
    from multiproc.spec import imported_modules

    if start_method != "spawn" and not servers.spawn_requested() and servers.fork_unsafe() is None:
        return
    source = getattr(pipeline.source, "dataset", pipeline.source)
    modules = [type(source).__module__]
    for st in pipeline.stages:
        if st.fn is not None:
            try:
                modules += imported_modules(buffers.dumps_light(st.fn))
            except Exception:
                pass  # reported, naming the stage, when the executor pickles it
    servers.warm(tuple(dict.fromkeys(m for m in modules if m and m != "builtins")))


def executor_spec(
    pipeline: PipelineLike,
    *,
    ordered: bool,
    max_restarts: int,
    start_fused: bool = False,
    allocation: Allocation | None = None,
    start_method: str = "fork",
) -> ExecutorSpec:
    """The executor spec of ``pipeline``: its stages' own knobs, or ``allocation`` (what a
    tuner left an earlier executor of the same pipeline with: workers, buffers, fusion, calls
    in flight, and an ``auto`` stage's kind: it starts on threads where it ran on them), or,
    with ``start_fused``, every stage fused that may be (:func:`multiproc.fusion.fuse_all`),
    the shape of a tuner that ``starts_fused``. The source stage is bounded as its source
    declares (:func:`source_bounded`)."""
    spec = pipeline.spec(ordered)
    stages = source_bounded(pipeline.source, spec.stages)
    if allocation is not None and len(allocation.workers) == len(stages):
        fused = allocation.fused or (False,) * len(stages)
        threads = allocation.threads or (0,) * len(stages)
        calls = allocation.concurrency or tuple(s.concurrency for s in stages)
        stages = tuple(
            dataclasses.replace(
                s,
                workers=max(s.min_workers, min(s.max_workers, allocation.workers[i])),
                buffer_bytes=allocation.buffer_bytes[i],
                fused=fused[i],
                start_threads=s.worker_type == "auto" and threads[i] > 0,
                concurrency=max(1, min(s.max_concurrency, calls[i])),
            )
            if s.offload is None and s.placement == "local"
            else s
            for i, s in enumerate(stages)
        )
    elif start_fused:
        stages = tuple(
            dataclasses.replace(s, fused=f) for s, f in zip(stages, fuse_all(stages), strict=True)
        )
    return type(spec)(
        stages, ordered=spec.ordered, max_restarts=max_restarts, start_method=start_method
    )


def source_bounded(source: Any, stages: tuple) -> tuple:
    """``stages`` with the source stage (the first) as ``source`` declares it: at most
    :func:`~torchtune_pipe.sources.base.max_readers` workers, bounds included (the worker bounds
    every tuner sees and the guard applies, so none grows a shard-bound stage past its
    shards), and :func:`~torchtune_pipe.sources.base.frame_items` items per frame."""
    if not stages or stages[0].kind != "source":
        return stages
    s = stages[0]
    changes: dict[str, int] = {}
    bound = max_readers(source)
    if bound is not None and s.max_workers > bound:
        changes.update(max_workers=bound, workers=min(s.workers, bound),
                       min_workers=min(s.min_workers, bound))  # fmt: skip
    per_frame = frame_items(source)
    if per_frame is not None:
        changes["frame_items"] = per_frame
    return (dataclasses.replace(s, **changes), *stages[1:]) if changes else stages


def on_snapshot(spec: ExecutorSpec, snapshot: Snapshot, stages: list) -> ExecutorSpec:
    """``spec`` with the stage functions and inits ``stages`` (``(fn, init)`` per stage, of the
    spec ``snapshot`` was taken for) where ``snapshot`` holds them: a later executor's workers
    forked from it take them from its server, as the process was then (the spec's own are new
    objects, which would be pickled from this process as it is now)."""
    held = {id(r) for r in snapshot.roots}
    return dataclasses.replace(
        spec,
        stages=tuple(
            dataclasses.replace(s, fn=f, init=i) if id(f) in held else s
            for s, (f, i) in zip(spec.stages, stages, strict=True)
        ),
    )


def take_snapshot(spec: ExecutorSpec, source: Any = None) -> Snapshot | None:
    """A snapshot of this process for ``spec``'s workers (:mod:`multiproc.snapshot`), or None
    where they do not fork from one; ``source``'s reads that stand in for these workers in
    this process read new views of its dataset (``sources.base.new_view``)."""
    new_view(source)
    return Snapshot.take(spec.stages) if forks(spec) else None


def start_executor(
    spec: ExecutorSpec,
    *,
    snapshot: Snapshot | None,
    machine: MachineFacts,
    clock: telemetry.ConsumerClock,
    memory_limit_bytes: int | None,
    prefetch_slot: list[weakref.ref],
    kinds: KindRule | None = None,
    source: Any = None,
    keep_snapshot: bool = False,
) -> tuple[Executor, RunningPipeline]:
    """The executor of ``spec`` (its workers forked from ``snapshot``, which it then owns,
    unless ``keep_snapshot``: see :class:`multiproc.Executor`) and the
    :class:`RunningPipeline` observing it.

    ``prefetch_slot`` holds (weakly) the epoch's prefetcher, whose held bytes count towards
    the pipeline's memory; ``kinds`` is the kind rule the running pipeline applies (None: a
    new one). A ``worker_type="auto"`` source stage may move to threads only where ``source``
    allows it now (its ``may_run_on_threads()``, if it has one).
    """
    ex = Executor(spec, snapshot, keep_snapshot=keep_snapshot)
    bounds = [
        telemetry.Bounds(
            s.min_workers,
            s.max_workers,
            s.max_concurrency,
            threadable=s.worker_type == "auto"
            and (i > 0 or getattr(source, "may_run_on_threads", None) or True),
        )  # fmt: skip
        for i, s in enumerate(spec.stages)
    ]
    # Through a list, not a bound method: the probe must not keep the loader alive.
    probe = MemoryProbe(functools.partial(_prefetched_bytes, prefetch_slot))
    remote = any(s.placement != "local" or s.offload is not None for s in spec.stages)
    meter = telemetry.Meter(
        lambda: ex.snapshot(per_worker=True), machine, bounds, clock, memory_limit_bytes, probe,
        cluster=_remote.cluster_cpus if remote else None,
        in_process=[s.name for s in spec.stages if s.worker_type == "thread"],
    )  # fmt: skip
    return ex, RunningPipeline(ex, meter, kinds)


def consumer_labels(pipeline: PipelineLike) -> dict[str, Any]:
    """What a tuning log's decisions say of their consumer: ``unit``, what one item it takes
    is (``"batches"`` from a pipeline that batches: a batch stage, or a source that reads
    whole batches, as the DataLoader's do; else ``"items"``), and its ``rank`` under
    ``torch.distributed`` (each rank tunes its own pipeline)."""
    source = pipeline.source
    batched = any(st.kind == "batch" for st in pipeline.stages) or bool(
        getattr(source, "batched", False)
    )
    labels: dict[str, Any] = {"unit": "batches" if batched else "items"}
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        labels["rank"] = dist.get_rank()
    return labels


def start_tuning(
    tunable: RunningPipeline,
    tuner: Any,
    interval_s: float,
    log_path: str | None,
    reset: bool,
    hold_first: bool = False,
    labels: dict[str, Any] | None = None,
    carried: Any = None,
) -> Any:
    """A started :class:`~torchtune_pipe.tuning.loop.TuningLoop` stepping ``tuner`` on
    ``tunable`` every ``interval_s`` (``reset``: the tuner's first decision; ``hold_first``:
    its first interval is only logged, and ``carried``: the last pipeline's last observation,
    see the loop; ``labels``: what every logged decision says of its consumer,
    :func:`consumer_labels`)."""
    from torchtune_pipe.tuning.loop import TuningLoop

    loop = TuningLoop(
        tunable, tuner, interval_s, log_path, reset=reset, hold_first=hold_first,
        labels=labels, carried=carried,
    )  # fmt: skip
    return loop.start()


class KindLoop:
    """A thread running :meth:`RunningPipeline.apply_kinds` every ``interval_s``: the kind rule
    for a loader whose stages keep their own knobs (no tuner) but may run on threads."""

    def __init__(self, tunable: RunningPipeline, interval_s: float) -> None:
        self.tunable = tunable
        self.interval_s = interval_s
        self.steps = 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ttp-kinds", daemon=True)

    def start(self) -> KindLoop:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self.tunable.apply_kinds()
                self.steps += 1
        except ExecutorClosedError:
            pass  # the epoch ended under it: nothing left to move
        except BaseException as e:  # stop() raises it
            self._error = e

    def stop(self, timeout_s: float | None = None, raise_error: bool = True) -> None:
        """End the thread; re-raise what ended it (``raise_error``), else log it."""
        self._stop.set()
        self._thread.join(timeout_s if timeout_s is not None else max(10.0, 10 * self.interval_s))
        error, self._error = self._error, None
        if error is not None:
            if raise_error:
                raise error
            log.warning("the worker-kind loop ended: %r", error)


def start_watch(
    tunable: RunningPipeline,
    machine: MachineFacts,
    clock: telemetry.ConsumerClock,
    memory_limit_bytes: int | None,
    unit: str = "items",
) -> Any:
    """A started live table of ``tunable``'s stages, with a meter of its own (its intervals
    must not shorten the tuner's); ``unit``: what one item the consumer takes is."""
    from torchtune_pipe.tools.watch import Watcher

    meter = tunable.meter
    own = telemetry.Meter(
        meter._snapshot,
        machine,
        meter.bounds,
        clock,
        memory_limit_bytes,
        meter.memory,
        cluster=meter.cluster,
        in_process=meter.in_process,
    )
    return Watcher(own.observe, unit=unit).start()


def busy(executor: Executor | None) -> list:
    """What the executor's workers are busy with (for a timeout's message); empty when it is
    gone."""
    if executor is None:
        return []
    try:
        return executor.busy()
    except Exception:  # closed under us: the timeout is still the error to report
        return []


def stop_pipeline(
    ex: Executor, tunable: RunningPipeline | None, final: dict, held: dict | None = None
) -> None:
    """Observe a pipeline a last time (``final["obs"]``, memory as last read), then close it;
    where ``held`` (a loader's, :func:`close_held`) is given, on a thread of its own, listed
    there under ``"closing"``."""
    if held is not None:
        closing = threading.Thread(
            target=stop_pipeline, args=(ex, tunable, final), name="ttp-close", daemon=True
        )
        closing.start()
        pending = held.setdefault("closing", [])
        pending[:] = [t for t in pending if t.is_alive()] + [closing]
        return
    if tunable is not None:
        try:
            final["obs"] = tunable.observe(read_memory=False)
        except Exception:  # closed by a failure: no last observation
            pass
    ex.close()


def close_held(held: dict, pid: int) -> None:
    """Close the executor in ``held``, then end the snapshot no executor took and the one a
    persistent loader's executors share, after every worker forked from it (a loader's
    finalizer), in its owner process only: in a forked child the workers and memory are the
    parent's."""
    if os.getpid() != pid:
        return
    ex = held.pop("executor", None)
    if ex is not None:
        ex.close()
    for closing in held.pop("closing", []):
        closing.join()  # executors of earlier epochs, stopping on their own threads
    for key in ("snapshot", "kept_snapshot"):
        snapshot = held.pop(key, None)
        if snapshot is not None:
            snapshot.stop()
