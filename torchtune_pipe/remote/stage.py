"""Map stages whose work runs on a Ray cluster (``Pipeline.map(fn, placement="ray")``).

A remote stage runs locally as a stage of *thread* workers, one per Ray actor: each worker's
copy of :class:`RayMap` owns one actor and forwards every frame's items to it in one remote
call; the outputs come back through Ray's object store into the worker, which writes them to
its shared-memory channel like any other stage's. So the executor's guarantees hold unchanged:
order, exactly-once delivery (a frame's outputs are committed once, after the call returned),
``state_dict`` resume, resizing (a new worker starts an actor, a retired one kills its own),
the error contract and the per-stage counters (the actor's CPU time is added to its worker's
``cpu_ns``).

A dead actor (``RayActorError``: its process or node died, or ``ray.kill``) costs its frame
one more run on a new actor; a second death on the same frame raises
:class:`~torchtune_pipe.errors.RemoteStageError` naming the frame's items. An exception the
function raises on the actor reaches the consumer as itself (Ray's ``RayTaskError`` unwrapped),
with the stage, the worker and the actor's traceback chained.

``ray`` is imported only here, and only when a remote stage runs (``pip install
torchtune-pipe[ray]``). A worker connects to the cluster the process is connected to
(``ray.init(address=...)`` first); without one, it calls ``ray.init()`` (``RAY_ADDRESS``, a
running local cluster, or a new one).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle
import numpy as np

from multiproc import RemoteTraceback, concurrency, serialize
from torchtune_pipe.errors import PipelineError, RemoteStageError

log = logging.getLogger(__name__)

PLACEMENTS = ("local", "ray", "auto")
INSTALL_HINT = "pip install torchtune-pipe[ray]"
ACTOR_PREFIX = "ttp:"  # names of the actors remote stages start: ttp:<stage>:<id>
# Ray reserves a CPU per actor unless told otherwise: one actor does one worker's work.
DEFAULT_RAY_OPTIONS: Mapping[str, Any] = {"num_cpus": 1}
# How long a new actor may take to start before its stage gives up (Ray keeps an actor the
# cluster has no room for pending, without an error).
ACTOR_START_TIMEOUT_S = 120.0
# ray.init from several starting worker threads at once would race.
_INIT_LOCK = threading.Lock()


def ray_installed() -> bool:
    """Whether ``ray`` can be imported (without importing it)."""
    return importlib.util.find_spec("ray") is not None


def connected() -> bool:
    """Whether this process is connected to a Ray cluster, without importing ``ray`` (a
    process that never imported it is not connected): where a ``placement="auto"`` stage may
    place workers."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def cluster_cpus() -> float:
    """CPUs the Ray cluster this process is connected to has in total (Ray's
    ``cluster_resources()["CPU"]``, the host's own included); 0 when it is not connected or
    Ray is not installed: what ``Observation.cluster_cpus`` reports while a remote stage
    runs. Like :func:`connected`, it does not import ``ray``: importing it would make this
    process unfit to fork (:func:`multiproc.servers.fork_unsafe`)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return 0.0
    return float(ray.cluster_resources().get("CPU", 0.0))


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RemoteStageError(
            f"a stage with placement='ray' needs Ray: {INSTALL_HINT} ({e})"
        ) from e
    return ray


def check_ray_options(method: str, options: Any) -> dict[str, Any]:
    """The actor options of a remote stage, checked at the builder (no ray import).

    Raises:
        PipelineError: not a mapping with str keys, or it sets what the stage decides itself
            (``name``: every actor is named after its stage; ``max_restarts``: a dead actor's
            frame is re-run by the stage, not by Ray).
    """
    if options is None:
        return dict(DEFAULT_RAY_OPTIONS)
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise PipelineError(f"{method}: ray_options must be a mapping of str, got {options!r}")
    for key in ("name", "max_restarts", "lifetime"):
        if key in options:
            raise PipelineError(
                f"{method}: ray_options may not set {key!r}: the stage names its actors, "
                "re-runs a dead actor's frame itself and kills an actor with its worker"
            )
    return {**DEFAULT_RAY_OPTIONS, **options}


class _Runner:
    """The actor: runs the stage's ``init`` once, then its function over one frame's items at
    a time."""

    def __init__(self, fn_bytes: bytes, init_bytes: bytes | None, stage: str, index: int):
        self.fn = cloudpickle.loads(fn_bytes)
        if init_bytes is not None:
            cloudpickle.loads(init_bytes)(stage, index)

    def ready(self) -> str:
        """The node the actor runs on (answers once the actor has started)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def run(self, packed: tuple) -> tuple[tuple, int, int]:
        """``fn`` over the packed items, the outputs packed, the CPU time it took on the
        actor (ns) and the wall time of ``fn`` alone (ns: what the call cost beyond it is the
        network's, ``CallPool.add_remote_call``)."""
        c0 = time.thread_time_ns()
        fn = self.fn
        xs = _unpack(packed)
        t0 = time.perf_counter_ns()
        ys = [fn(x) for x in xs]
        fn_ns = time.perf_counter_ns() - t0
        return _pack(ys), time.thread_time_ns() - c0, fn_ns


class RayMap:
    """A remote map stage's function (``batch_map``): a frame's tagged items, mapped on the
    Ray actor of the worker running this copy. Unit ends pass through untouched.

    The executor runs :meth:`start` as the worker's ``init``, so an actor starts with its
    worker (a resize adds actors at once), and :meth:`on_worker_exit` when the worker ends.

    Args:
        fn: the user's function, run on the actor.
        stage: the stage's name (in actor names and errors).
        options: ``ActorClass.options(...)`` for every actor (``num_cpus``, ``resources``,
            ``scheduling_strategy``, ``runtime_env``...).
        init: the stage's ``init(stage_name, worker_index)``, run on each actor as it starts.
        ends_not_items: count the unit ends a frame carries as bookkeeping, not items
            (``concurrency.not_an_item``), as the stage's local workers do: for a stage whose
            workers are split between host and cluster (``placement="auto"``).

    Each call is reported to the worker (``CallPool.add_remote_call``): the bytes sent and
    received, and the call's wall time less the function's own on the actor.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        stage: str,
        options: Mapping[str, Any],
        init: Callable[[str, int], None] | None = None,
        ends_not_items: bool = False,
    ):
        self.fn = fn
        self.ends_not_items = ends_not_items
        self.stage = stage
        self.options = dict(options)
        # Pickled for the actor when this copy starts its first one: a copy travels to every
        # worker with ``fn`` (whose arrays, a dataset's, the executor shares), not twice.
        self._fn_bytes: bytes | None = None
        self._init_bytes = cloudpickle.dumps(init) if init is not None else None
        self._index = 0
        self._actor: Any = None
        self._ready: Any = None  # the actor's first answer, until it came
        self._name = ""

    def __getstate__(self) -> dict:
        # Each worker's copy starts its own actor: a handle never travels with the function.
        return {**self.__dict__, "_actor": None, "_ready": None, "_name": "", "_fn_bytes": None}

    def start(self, stage: str, index: int) -> None:
        """Start this worker's actor (without waiting for it): the worker's ``init``."""
        self._index = index
        self._start(_ray())

    def __call__(self, items: list) -> list:
        work = [i for i, (u, k, _) in enumerate(items) if not (u >= 0 and k < 0)]
        calls = concurrency.current()
        if self.ends_not_items and len(work) < len(items):
            calls.add_not_items(len(items) - len(work))
        if not work:
            return items
        xs = _pack([items[i][2] for i in work])
        (packed, cpu_ns, fn_ns), wall_ns = self._run(xs, items, work)
        calls.add_remote_call(_nbytes(xs) + _nbytes(packed), wall_ns - fn_ns)
        outs = _unpack(packed)
        calls.add_cpu_ns(cpu_ns)
        done = list(items)
        for i, y in zip(work, outs, strict=True):
            u, k, _ = items[i]
            done[i] = (u, k, y)
        return done

    def _run(self, xs: tuple, items: list, work: list[int]) -> tuple[Any, int]:
        ray = _ray()
        for attempt in (0, 1):
            if self._actor is None:
                self._start(ray)
            try:
                if self._ready is not None:
                    self._wait_ready(ray)
                # Blocks until the actor answers or Ray reports it dead (RayActorError).
                t0 = time.perf_counter_ns()
                out = ray.get(self._actor.run.remote(xs))
                return out, time.perf_counter_ns() - t0
            except ray.exceptions.RayTaskError as e:
                raise _unwrap(e, self._name)  # noqa: B904 (the actor's traceback is its cause)
            except ray.exceptions.RayActorError as e:
                name = self._name
                self._forget()
                frame = _describe(items, work)
                if attempt:
                    raise RemoteStageError(
                        f"stage {self.stage!r}: a second Ray actor ({name}) died running the "
                        f"frame of {frame}; the frame was re-run once after its first actor "
                        f"died and is not tried again. Check the actors' logs (out of memory? "
                        f"a node lost? init failed?) ({type(e).__name__}: {e})"
                    ) from e
                log.warning(
                    "stage %r: Ray actor %s died running the frame of %s; running it again "
                    "on a new actor (%s)", self.stage, name, frame, type(e).__name__,
                )  # fmt: skip
        raise AssertionError("unreachable")

    def _wait_ready(self, ray: Any) -> None:
        """Wait (at most ``ACTOR_START_TIMEOUT_S``) for the actor to start: one the cluster
        has no room for would otherwise hold its frame for ever."""
        try:
            node = ray.get(self._ready, timeout=ACTOR_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as e:
            raise RemoteStageError(
                f"stage {self.stage!r}: Ray did not start actor {self._name} within "
                f"{ACTOR_START_TIMEOUT_S:g} s; the cluster has no room for its options "
                f"{self.options} (available now: {ray.available_resources()}). Lower the "
                "stage's workers or its ray_options, or add nodes"
            ) from e
        self._ready = None
        log.debug("stage %r: actor %s runs on node %s", self.stage, self._name, node)

    def _start(self, ray: Any) -> None:
        with _INIT_LOCK:
            if not ray.is_initialized():
                ray.init()
        self._name = f"{ACTOR_PREFIX}{self.stage}:{uuid.uuid4().hex[:12]}"
        if self._fn_bytes is None:
            self._fn_bytes = cloudpickle.dumps(self.fn)
        cls = ray.remote(_Runner)
        self._actor = cls.options(name=self._name, max_restarts=0, **self.options).remote(
            self._fn_bytes, self._init_bytes, self.stage, self._index
        )
        self._ready = self._actor.ready.remote()

    def _forget(self) -> None:
        self._actor = self._ready = None
        self._name = ""

    def on_worker_exit(self) -> None:
        """Kill this worker's actor (its worker retired, was replaced or stopped)."""
        actor = self._actor
        self._forget()
        if actor is not None:
            _ray().kill(actor, no_restart=True)


def _pack(xs: list) -> tuple[bytes, tuple[int, ...], Any]:
    """Items for the trip through Ray: the executor's own pickling (tensors as raw bytes plus
    geometry) and their large buffers in one uint8 array, which Ray moves out of band. Ray's
    own pickling of torch tensors costs ~0.2 ms a tensor, and every out-of-band buffer some
    more (benchmarks/remote.py)."""
    header, buffers = serialize.dumps(xs)
    sizes = tuple(serialize.buffer_nbytes(buffers))
    if not buffers:
        return header, sizes, None
    blob = np.empty(sum(sizes), dtype=np.uint8)
    serialize.copy_into(memoryview(blob), buffers)
    return header, sizes, blob


def _nbytes(packed: tuple[bytes, tuple[int, ...], Any]) -> int:
    """Bytes a packed frame moves."""
    return len(packed[0]) + sum(packed[1])


def _unpack(packed: tuple[bytes, tuple[int, ...], Any]) -> list:
    # Ray hands arrays out of its object store read-only; the items get their own memory,
    # writable as a local stage's inputs are (one copy of the frame's buffers).
    header, sizes, blob = packed
    if blob is None:
        return serialize.loads(header, [])
    view = memoryview(bytearray(blob))
    buffers, at = [], 0
    for n in sizes:
        buffers.append(view[at : at + n])
        at += n
    return serialize.loads(header, buffers)


def _describe(items: list, work: list[int]) -> str:
    """The frame's items in words: ``64 items, unit 3 items 0..63``."""
    first, last = items[work[0]], items[work[-1]]
    if first[0] >= 0 and first[0] == last[0]:
        where = f"unit {first[0]} items {first[1]}..{last[1]}"
    else:
        where = f"from {first[:2]} to {last[:2]}"
    return f"{len(work)} items, {where}"


def _unwrap(e: Any, actor: str) -> BaseException:
    """The exception the function raised on the actor, with the actor's traceback chained
    (the executor then adds the stage and worker)."""
    cause = getattr(e, "cause", None)
    if not isinstance(cause, BaseException):
        return RemoteStageError(f"on Ray actor {actor}: {e}")
    # str(e) is Ray's account: the actor (pid, node) and its traceback.
    cause.__cause__ = RemoteTraceback(f'\n"""\n{e}"""')
    cause.add_note(f"raised on Ray actor {actor}")
    return cause
