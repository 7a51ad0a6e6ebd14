"""Declarative specs of stages and executors (frozen, validated at construction)."""

from __future__ import annotations

import pickle
import pickletools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

import cloudpickle

from .errors import SpecError
from .offload import Offload

if TYPE_CHECKING:
    from .buffers import BufferFile

MiB = 1 << 20

# The one vocabulary of stage kinds, at two levels. multiproc is the bottom layer, so both live
# here: torchtune_pipe's Pipeline, its telemetry and its simulator import them.

# How the executor runs a stage's function (StageSpec.kind).
StageKind = Literal["source", "map", "flat_map", "batch_map", "stateful"]
KINDS: tuple[StageKind, ...] = get_args(StageKind)

# What a stage of a data pipeline does, in its user's words (torchtune_pipe's Stage.kind, the
# simulator's StageModel.kind). "prefetch" is the consumer-side thread: a stage for the
# simulator, the Pipeline's Prefetch spec rather than a Stage for the real pipeline.
PipelineKind = Literal["source", "map", "shuffle", "batch", "prefetch"]
PIPELINE_KINDS: tuple[PipelineKind, ...] = get_args(PipelineKind)

# How the executor runs each pipeline kind: shuffle and batch hold items across calls.
EXECUTOR_KIND: dict[PipelineKind, StageKind] = {
    "source": "source",
    "map": "map",
    "shuffle": "stateful",
    "batch": "stateful",
}


class Reducer(Protocol):
    """State of a stateful stage worker (batching, shuffling): tagged items in, items out.

    ``push(tag, item)`` takes one item and returns ``[(tags, out), ...]``: the outputs ready to
    go downstream (often none), each with the tags of the inputs folded into it (the executor
    uses them to know which inputs are fully consumed, and so what to deliver again if the
    worker dies). ``flush()`` returns the same shape at the end of the stream (an ``out`` of
    ``multiproc.reducers.DROPPED`` consumes items without output); ``drain()`` returns
    ``[(tag, item), ...]`` still held, so another worker can take them over when this one
    retires. See ``multiproc.reducers`` for ``Batcher`` and ``Shuffler``.
    """

    def push(self, tag: Any, item: Any) -> list[tuple[list, Any]]: ...

    def flush(self) -> list[tuple[list, Any]]: ...

    def drain(self) -> list[tuple[Any, Any]]: ...


@dataclass(frozen=True)
class Skipped:
    """Yielded by a source function in place of an item it could not produce but got past
    (the source recovered, e.g. by reading on after a bad record). The worker counts it as
    a skipped error (``on_error='skip'``) or reports ``error`` (``'raise'``).

    Attributes:
        error: what went wrong.
        where: the item, in words (``"item 17"``).
    """

    error: BaseException
    where: str


MAX_ERRORS_ARE = "must be None, an int >= 0 or a float share in (0, 1]"


def valid_max_errors(m: Any) -> bool:
    """Whether ``m`` is a bound :func:`too_many_errors` understands."""
    return (
        m is None
        or (isinstance(m, int) and not isinstance(m, bool) and m >= 0)
        or (isinstance(m, float) and 0 < m <= 1)
    )


def too_many_errors(errors: int, items_in: int, max_errors: int | float | None) -> bool:
    """Whether ``errors`` skipped out of ``items_in`` taken in exceed ``max_errors``: an int is
    a count, a float a share of the items taken in, of at least 100 (so that the first few
    items failing is not read as a 100% failure rate)."""
    if max_errors is None:
        return False
    if isinstance(max_errors, float):
        return errors > max_errors * max(items_in, 100)
    return errors > max_errors


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage.

    Args:
        name: unique stage name (used in errors, stats and knobs).
        kind: ``source`` (``fn(unit) -> iterable of items``, fed work units), ``map``
            (``fn(item) -> item``), ``flat_map`` (``fn(item) -> iterable``), ``batch_map``
            (``fn(list_of_items) -> list_of_items``, one call per frame), ``stateful``
            (``fn(epoch, worker) -> Reducer``: a factory a worker calls with the epoch and its
            own index when it takes its first frame of each epoch, so a shuffle can seed by
            both).
        fn: the stage function; must pickle (cloudpickle is used, so lambdas and closures work
            with process workers). Every worker runs its own copy; a copy with an
            ``on_worker_exit()`` method has it called when its worker ends.
        workers: initial worker count; min_workers/max_workers bound ``resize``.
        buffer_bytes: byte budget of the stage's outbound channel (split across its workers).
        max_buffer_bytes: the largest budget ``set_budget`` may set (address space reserved,
            memory is used only when written).
        frame_items: items grouped per frame (the unit of transfer and of recovery) by
            source and stateful stages; map stages keep their input's framing.
        worker_type: the kind of the stage's local workers at the start: ``process``,
            ``thread`` (threads of the executor's process) or ``auto`` (processes, or threads
            with ``start_threads``; a tuner may move them to the other kind). ``Executor.resize(stage, n, threads=t)`` moves any
            stage's local workers between the kinds while running. A thread stage's thread
            workers each unpickle their own copy of the stage; the thread workers of a
            ``process`` or ``auto`` stage all call this process's own ``fn`` (as torchdata's
            thread workers do: nothing is pickled, an open file works as in a forked worker;
            ``fn`` must then be safe to call from several threads, and its
            ``on_worker_exit()`` is not called, the function being no worker's own).
        thread_copies: whether a thread stage's thread workers each unpickle their own copy
            of the stage (True), or all call this process's own ``fn`` as an ``auto`` stage's
            do (False: what torch's thread workers do with the dataset).
        start_threads: an ``auto`` stage's local workers start as threads, not processes
            (what a measurement chose before the executor started; a stage of another
            ``worker_type`` may not set it).
        on_error: ``raise`` (the consumer gets the exception) or ``skip`` (drop, count, log
            the first; a source that raises loses the rest of its unit, see :class:`Skipped`).
        max_errors: the most items ``skip`` may drop before the executor raises
            :class:`~multiproc.errors.TooManyErrorsError` with the counts and last errors: an
            int is a count, a float in (0, 1] a share (see :func:`too_many_errors`), None no
            bound.
        timeout_s: raise :class:`~multiproc.errors.StageTimeoutError` when a worker stays in
            the stage function longer than this on one frame or unit (None: no limit).
        init: optional ``init(stage_name, worker_index)`` run once in every new worker.
        torch_threads: torch intra-op threads per worker process (as torch's DataLoader,
            default 1: N workers each running N-thread kernels oversubscribe the cores).
        concurrency: calls of the stage function in flight per worker (threads of the worker
            running one frame's items, or a source's reads through
            :func:`multiproc.concurrency.current`); ``set_concurrency`` changes it while
            running, up to ``max_concurrency``. For calls that wait (I/O), not compute.
        fused: start with this stage's function running in the previous stage's workers
            (``Executor.set_fused`` changes it while running; see :mod:`multiproc.fusion`).
        placement: where the function does its work: ``"local"`` (in the worker), or the name
            of a runtime it forwards each call to (``"ray"``); the executor runs the stage
            alike and reports it in :class:`~multiproc.stats.StageSnapshot`.
        offload: let some of the stage's workers forward its frames to a remote runtime
            (:mod:`multiproc.offload`): ``Executor.resize(stage, n, remote=m)`` runs ``m`` of
            its ``n`` workers as offload threads. A stateless stage (map, flat_map or
            batch_map) that is never fused; ``workers`` counts both kinds.
    """

    name: str
    kind: StageKind
    fn: Callable[..., Any]
    workers: int = 1
    min_workers: int = 1
    max_workers: int = 64
    buffer_bytes: int = 64 * MiB
    max_buffer_bytes: int | None = None
    frame_items: int = 64
    worker_type: Literal["process", "thread", "auto"] = "process"
    on_error: Literal["raise", "skip"] = "raise"
    init: Callable[[str, int], None] | None = None
    torch_threads: int = 1
    max_errors: int | float | None = 0.1
    timeout_s: float | None = None
    concurrency: int = 1
    max_concurrency: int = 64
    fused: bool = False
    placement: str = "local"
    offload: Offload | None = None
    thread_copies: bool = True
    start_threads: bool = False

    def __post_init__(self) -> None:
        where = f"stage {self.name!r}"
        if not isinstance(self.placement, str) or not self.placement:
            raise SpecError(f"{where}: placement must be a non-empty str, got {self.placement!r}")
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"StageSpec: name must be a non-empty str, got {self.name!r}")
        if self.kind not in KINDS:
            raise SpecError(f"{where}: kind must be one of {KINDS}, got {self.kind!r}")
        if not callable(self.fn):
            raise SpecError(f"{where}: fn must be callable, got {type(self.fn).__name__}")
        for arg in (
            "workers", "min_workers", "max_workers", "frame_items", "torch_threads",
            "concurrency", "max_concurrency",
        ):  # fmt: skip
            v = getattr(self, arg)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"{where}: {arg} must be a positive int, got {v!r}")
        if self.concurrency > self.max_concurrency:
            raise SpecError(
                f"{where}: concurrency ({self.concurrency}) > max_concurrency "
                f"({self.max_concurrency})"
            )
        if not self.min_workers <= self.workers <= self.max_workers:
            raise SpecError(
                f"{where}: need min_workers <= workers <= max_workers, got "
                f"{self.min_workers} <= {self.workers} <= {self.max_workers}"
            )
        if not isinstance(self.buffer_bytes, int) or self.buffer_bytes < 64 * 1024:
            raise SpecError(
                f"{where}: buffer_bytes must be an int >= 64 KiB, got {self.buffer_bytes!r}"
            )
        if self.max_buffer_bytes is None:
            object.__setattr__(self, "max_buffer_bytes", max(self.buffer_bytes * 4, 256 * MiB))
        assert self.max_buffer_bytes is not None
        if self.max_buffer_bytes < self.buffer_bytes:
            raise SpecError(
                f"{where}: max_buffer_bytes ({self.max_buffer_bytes}) < buffer_bytes ({self.buffer_bytes})"
            )
        if self.worker_type not in ("process", "thread", "auto"):
            raise SpecError(
                f"{where}: worker_type must be 'process', 'thread' or 'auto', got "
                f"{self.worker_type!r}"
            )
        if self.start_threads and self.worker_type != "auto":
            raise SpecError(
                f"{where}: start_threads is for worker_type='auto' stages, got "
                f"worker_type={self.worker_type!r}"
            )
        if self.on_error not in ("raise", "skip"):
            raise SpecError(f"{where}: on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if not valid_max_errors(self.max_errors):
            raise SpecError(f"{where}: max_errors {MAX_ERRORS_ARE}, got {self.max_errors!r}")
        if self.offload is not None:
            self._check_offload(where)
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise SpecError(f"{where}: timeout_s must be None or a number > 0, got {t!r}")

    def _check_offload(self, where: str) -> None:
        off = self.offload
        if not isinstance(off, Offload):
            raise SpecError(f"{where}: offload must be an Offload or None, got {off!r}")
        why = off.problem()
        if why is not None:
            raise SpecError(f"{where}: {why}")
        if self.kind not in FUSABLE_INTO:
            raise SpecError(f"{where}: only map, flat_map and batch_map stages offload workers")
        if self.fused:
            raise SpecError(f"{where}: a fused stage runs no workers of its own to offload")
        if off.workers > self.workers:
            raise SpecError(
                f"{where}: offload.workers ({off.workers}) > workers ({self.workers}): the "
                "offload workers are some of the stage's workers"
            )

    @property
    def stateful(self) -> bool:
        return self.kind == "stateful"

    @property
    def starts_as_threads(self) -> bool:
        """Whether it is a ``thread`` stage (its workers start as threads, each with its own
        copy of the stage where ``thread_copies``); an ``auto`` stage's start is
        :attr:`starts_on_threads`."""
        return self.worker_type == "thread"

    @property
    def starts_on_threads(self) -> bool:
        """Whether its local workers start as threads (else as processes)."""
        return self.worker_type == "thread" or self.start_threads


@dataclass(frozen=True)
class ExecutorSpec:
    """A chain of stages; the first is the source.

    Args:
        stages: stage specs in data-flow order; exactly the first has kind ``source``.
        ordered: deliver items in source order (stateful stages then run one worker each).
        max_restarts: worker deaths tolerated (replaced and their work re-delivered) before
            the executor fails with WorkerDiedError.
        credits: frames in flight per worker (dispatched but not finished).
        name: a tag for shared-memory names and logs.
        start_method: how process workers start. ``"fork"``: from a snapshot of this
            process (:mod:`multiproc.snapshot`): they see it as it was when the executor was
            built (or when the snapshot it was given was taken) and inherit what does not
            pickle, as forked torch DataLoader workers do. ``"spawn"``: from
            multiprocessing's spawned server, stage functions by pickle (also with
            ``MULTIPROC_FORKSERVER=spawn``, and in a process that imported Ray).
    """

    stages: tuple[StageSpec, ...]
    ordered: bool = False
    max_restarts: int = 16
    credits: int = 2
    name: str = "pipe"
    extra: dict = field(default_factory=dict)
    start_method: Literal["fork", "spawn"] = "fork"

    def __post_init__(self) -> None:
        if self.start_method not in ("fork", "spawn"):
            raise SpecError(
                f"ExecutorSpec: start_method must be 'fork' or 'spawn', got {self.start_method!r}"
            )
        stages = tuple(self.stages)
        object.__setattr__(self, "stages", stages)
        if not stages:
            raise SpecError("ExecutorSpec: stages is empty; the first stage must be a source")
        if stages[0].kind != "source":
            raise SpecError(
                f"stage {stages[0].name!r}: the first stage must have kind 'source', got {stages[0].kind!r}"
            )
        names = set()
        for s in stages:
            if not isinstance(s, StageSpec):
                raise SpecError(f"ExecutorSpec: stages must be StageSpec, got {type(s).__name__}")
            if s.name in names:
                raise SpecError(f"stage {s.name!r}: duplicate stage name")
            names.add(s.name)
        for s in stages[1:]:
            if s.kind == "source":
                raise SpecError(f"stage {s.name!r}: only the first stage may be a source")
        for j, s in enumerate(stages):
            if not isinstance(s.fused, bool):
                raise SpecError(f"stage {s.name!r}: fused must be a bool, got {s.fused!r}")
            if s.fused:
                why = fuse_blocker(stages[j - 1], s) if j else "it is the first stage"
                if why is not None:
                    raise SpecError(f"stage {s.name!r}: fused=True, but {why}")
        if self.ordered:
            for s in stages:
                if s.stateful and s.max_workers != 1:
                    raise SpecError(
                        f"stage {s.name!r}: ordered=True needs stateful stages with max_workers=1 "
                        f"(got {s.max_workers}); set ordered=False or max_workers=1"
                    )
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise SpecError(
                f"ExecutorSpec: max_restarts must be an int >= 0, got {self.max_restarts!r}"
            )
        if not isinstance(self.credits, int) or self.credits < 1:
            raise SpecError(f"ExecutorSpec: credits must be a positive int, got {self.credits!r}")


# Stages that may run in the previous stage's workers (StageSpec.kind of both sides).
FUSABLE_INTO: tuple[StageKind, ...] = ("map", "flat_map", "batch_map")
FUSION_HOSTS: tuple[StageKind, ...] = ("source", "map", "flat_map", "batch_map")


def fuse_blocker(host: StageSpec, stage: StageSpec) -> str | None:
    """Why ``stage`` cannot run in the workers of ``host`` (the stage before it), or None.

    A fused stage's function runs in the host's worker on the host's outputs, one call at a
    time, with no channel hop; it must hold nothing across calls, and start as the host's
    workers do (``auto`` counting as ``process``): it then runs in the host's workers, of
    whatever kind they are moved to.
    """
    if host.kind not in FUSION_HOSTS:
        return f"stage {host.name!r} is {host.kind}: only stateless stages host others"
    if stage.kind not in FUSABLE_INTO:
        return f"stage {stage.name!r} is {stage.kind}: only stateless stages fuse"
    for s in (host, stage):
        if s.offload is not None:
            return f"stage {s.name!r} offloads workers (a fused group runs on the host)"
    if host.starts_as_threads != stage.starts_as_threads:
        return (
            f"stages {host.name!r} and {stage.name!r} run in different worker types "
            f"({host.worker_type}, {stage.worker_type})"
        )
    if host.timeout_s != stage.timeout_s:
        return f"stages {host.name!r} and {stage.name!r} have different timeout_s"
    return None


def fusion_host(fused: Sequence[bool], j: int) -> int:
    """The stage whose workers run stage ``j`` when the stages marked in ``fused`` run in the
    stage before them (``j`` itself unless it is fused)."""
    while j > 0 and j < len(fused) and fused[j]:
        j -= 1
    return j


def fused_depth(fused: Sequence[bool], i: int) -> int:
    """How many stages after ``i`` run in stage ``i``'s workers when the stages marked in
    ``fused`` run in the stage before them (0 when ``i`` is fused itself)."""
    if fused[i]:
        return 0
    d = 0
    while i + d + 1 < len(fused) and fused[i + d + 1]:
        d += 1
    return d


def check_picklable(
    stage: StageSpec,
    buffers: BufferFile | None = None,
    dumps: Callable[[Any], bytes] | None = None,
) -> bytes:
    """Pickle a stage for its workers, or raise SpecError naming the stage and the attribute
    that does not pickle: with ``dumps`` (a snapshot's, :mod:`multiproc.snapshot`), else
    with ``buffers`` (its large arrays in a shared file, :mod:`multiproc.buffers`), else
    cloudpickle."""
    try:
        if dumps is not None:
            return dumps(stage)
        return buffers.dumps(stage) if buffers is not None else cloudpickle.dumps(stage)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        where = unpicklable_path(stage.fn, "fn")
        at = f" at {where}" if where else ""
        raise SpecError(
            f"stage {stage.name!r}: its function does not pickle{at} ({e}); workers started "
            "by spawn get it by pickle: make it picklable (e.g. open files in the worker, "
            "lazily), or start workers by fork (the default)"
        ) from e


def unpicklable_path(obj: Any, path: str, depth: int = 6, _seen: set | None = None) -> str:
    """The attribute path below ``obj`` (named ``path``) of the first value that does not
    pickle, with its type (e.g. ``fn.source.dataset.f (_io.BufferedReader)``); ``""`` when
    none is found within ``depth`` levels."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen or depth < 0:
        return ""
    seen.add(id(obj))
    children: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            children = [(f"{path}.{k}", v) for k, v in state.items()]
        for k in getattr(type(obj), "__slots__", ()):
            if isinstance(k, str) and hasattr(obj, k):
                children.append((f"{path}.{k}", getattr(obj, k)))
        closure = getattr(obj, "__closure__", None)
        code = getattr(obj, "__code__", None)
        if closure and code is not None:
            children += [
                (f"{path}.<closure {n}>", c.cell_contents)
                for n, c in zip(code.co_freevars, closure, strict=False)
                if _filled(c)
            ]
    for name, child in children:
        found = unpicklable_path(child, name, depth - 1, seen)
        if found:
            return found
    if _seen is None:
        return ""
    try:
        cloudpickle.dumps(obj)
    except Exception:
        return f"{path} ({type(obj).__module__}.{type(obj).__qualname__})"
    return ""


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def imported_modules(pickled: bytes) -> list[str]:
    """The modules unpickling ``pickled`` imports: those it names (``GLOBAL`` and
    ``STACK_GLOBAL`` opcodes, through the memo) that this process has imported, ``__main__``
    excepted (workers never import it)."""
    memo: dict[int, Any] = {}
    last: list[Any] = [None, None]  # the two values pushed last (strings, or None)
    found: dict[str, None] = {}
    for op, arg, _ in pickletools.genops(pickled):
        name = op.name
        if name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            last = [last[1], arg]
        elif name == "MEMOIZE":
            memo[len(memo)] = last[1]
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = last[1]  # type: ignore[arg-type]  # PUT ops carry an int
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            last = [last[1], memo.get(int(arg))]  # type: ignore[arg-type]  # as PUT
        elif name == "STACK_GLOBAL":
            if isinstance(last[0], str):
                found[last[0]] = None
            last = [None, None]
        elif name == "GLOBAL":
            found[str(arg).split(" ", 1)[0]] = None
            last = [None, None]
        elif name not in ("FRAME", "PROTO"):
            last = [last[1], None]
    return [m for m in found if m != "__main__" and m in sys.modules]
