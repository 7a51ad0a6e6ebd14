"""The kind an ``auto`` stage starts on, measured before its executor starts.

Forking worker processes takes about a second, and a run that starts on the wrong kind pays
for it twice: processes for reads that threads would serve in the consumer's process (their
memory, the hops, the fork), or threads for reads that hold the interpreter lock. So where a
pipeline has ``worker_type="auto"`` stages that no measurement has placed yet, its fast start
reads its first units both ways (:class:`~torchtune_pipe.loader.kindprobe.KindProbe`): one
unit alone, then ``k`` at once on threads of this process, against ``k`` processes each as
fast as a unit alone plus its hop between processes
(:func:`multiproc.serialize.hop_s`). Where the threads kept up with those processes
(:func:`~torchtune_pipe.tuning.worker_kind.start_on_threads`) the stages start on threads,
else on processes, and the kind rule starts from that measure
(:meth:`~torchtune_pipe.tuning.worker_kind.KindRule.start`). The same first reads give the
calls in flight a source stage whose reads wait starts with
(:func:`~torchtune_pipe.tuning.calls_in_flight.start_concurrency`).

Not measured (the stages start on processes, as before): a source bounded by its shards (a
unit is a whole shard), reads that draw from the global random generators, or fewer units
than the probe needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

from multiproc.spec import ExecutorSpec
from torchtune_pipe.loader.kindprobe import KindProbe
from torchtune_pipe.sources.base import max_readers
from torchtune_pipe.stages import PipelineLike
from torchtune_pipe.telemetry import measure as telemetry
from torchtune_pipe.tuning.calls_in_flight import start_concurrency
from torchtune_pipe.tuning.worker_kind import (
    SETTLED_BELOW,
    KindRule,
    start_on_threads,
    start_settled,
)

log = logging.getLogger(__name__)

KIND_THREADS_MAX = 4  # units read at once by the probe, at most (and at most the CPUs)


def auto_stages(spec: ExecutorSpec) -> list[int]:
    """The stages of ``spec`` whose kind is the rule's to choose."""
    return [i for i, s in enumerate(spec.stages) if s.worker_type == "auto" and not s.offload]


class NextExecutor(Protocol):
    """Where a loader keeps the spec of its next executor and the snapshot its workers fork
    from (None: it let them go, e.g. closed)."""

    _next: tuple[ExecutorSpec, Any] | None


def kind_probe(
    holder: NextExecutor,
    kinds: KindRule,
    pipeline: PipelineLike,
    note: Callable[[str, str], None] = lambda event, message: None,
) -> KindProbe | None:
    """The probe that places the ``auto`` stages of ``holder``'s next executor (its spec
    replaced once measured) and tells ``kinds``; None where nothing is to be measured.
    ``note(event, message)`` gets the decision in words (the loader's tuning log)."""

    def spec() -> ExecutorSpec | None:
        nxt = holder._next
        return None if nxt is None else nxt[0]

    first = spec()
    source = pipeline.source
    init = pipeline.stages[0].init
    # A source stage's init that makes the calling thread a worker (its ``inline``) does it
    # for that thread alone: the consumer's own thread goes on meanwhile.
    thread_context = contextlib.nullcontext if init is None else getattr(init, "inline", None)
    if first is None or thread_context is None or max_readers(source) is not None:
        return None
    stages = [i for i in auto_stages(first) if i not in kinds.kind]
    if not stages:
        return None
    cpus = telemetry.cpus_available()
    k = max(1, min(KIND_THREADS_MAX, int(cpus)))
    if k < 2:
        return None

    def may_run() -> bool:
        check = getattr(source, "may_run_on_threads", None)
        return True if check is None else bool(check())

    def decide(
        alone: float,
        together: float,
        processes: float,
        wait_ratio: float | None,
        error: Exception | None,
    ) -> None:
        threads = error is None and start_on_threads(together, processes, wait_ratio=wait_ratio)
        nxt = holder._next
        if nxt is None:
            return
        now = nxt[0]
        changed = list(now.stages)
        calls = start_concurrency(wait_ratio, now.stages[0].max_concurrency) if 0 in stages else 1
        for i in stages:
            s = changed[i]
            changed[i] = dataclasses.replace(
                s, start_threads=threads, concurrency=max(s.concurrency, calls if i == 0 else 1)
            )
        holder._next = (dataclasses.replace(now, stages=tuple(changed)), nxt[1])
        measured = min(alone, together, processes) > 0
        # One read alone that ended the probe: threads at k times its rate would not reach
        # the share they start from, which settles processes as a measure of both would
        # (a trial of threads would cost seconds at their rate to find them slower).
        capped = error is None and alone > 0 and processes > 0 and together == 0
        # The reads were measured one call at a time: where they wait, the run makes several
        # calls at once per worker, and their CPU, then the most of a unit's time, may hold
        # the interpreter lock the threads share. That measure settles nothing: the rule
        # compares the kinds on the running pipeline.
        settled = (
            (capped or start_settled(together, processes, wait_ratio)) and k >= cpus and calls <= 1
        )
        if error is not None:
            kinds.bar(stages)
        else:
            kinds.start(stages, threads, cpus if settled else None)
        if error is not None:
            why = (
                f"a read on a thread raised {type(error).__name__}: {error} (they stay on "
                "processes)"
            )
        elif measured:
            why = (
                f"{k} reads at once on threads ran {together / alone:.2f}x one alone and "
                f"{together / processes:.2f}x what {k} processes would "
                f"({together:.0f} against {alone:.0f} and {processes:.0f} items/s)"
            )
        elif alone > 0 and processes > 0:
            why = (
                f"{k} reads at once on threads would read at most {k * alone / processes:.2f}x "
                f"what {k} processes would (a read alone: {alone:.0f} items/s, its hop "
                f"{(k * alone / processes - 1) * 100:.0f}% of it), not measured further"
            )
        else:
            why = "the reads were not measured on threads"
        said = (
            f"stages {[now.stages[i].name for i in stages]} start on "
            f"{'threads' if threads else 'processes'}: {why}"
        )
        if wait_ratio is not None:
            said += (
                f"; {calls} call{'s' if calls > 1 else ''} in flight per worker (the reads wait "
                f"{wait_ratio:.1f}x their CPU)"
            )
        log.info("Loader: %s", said)
        note("kind", said)

    def clear(together: float, processes: float) -> bool:
        # Threads far slower than processes (reads that hold the interpreter lock): a round's
        # noise does not bring them to the share at which threads would start.
        return processes > 0 and together <= SETTLED_BELOW * processes

    last = first.stages[-1]  # hands the units to the consumer; k processes share its budget
    return KindProbe(
        k,
        may_run,
        decide,
        thread_context,
        first.stages[0].torch_threads,
        last.buffer_bytes // max(k, last.workers),
        clear,
    )


__all__ = ["KIND_THREADS_MAX", "auto_stages", "kind_probe"]
