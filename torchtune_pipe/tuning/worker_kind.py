"""Threads or processes for a stage's workers: a measured rule below every tuner.

A stage built with ``worker_type="auto"`` (:attr:`~.base.StageStats.threadable`) may run its
local workers as processes or as threads of the consumer's process. A thread worker holds no
process of its own (no interpreter, no copy of the dataset's pages it writes, no fork), and its
items skip nothing a process's would not; but its Python work shares one interpreter lock with
the consumer and the other thread workers. Which kind is faster for a stage is not known from
its code (a decode in C releases the lock, a tokenizer in Python holds it), so the rule tries
it: once a stage's allocation has held for ``SETTLE`` observations, it moves the stage's local
workers to the other kind for ``PROBE`` observations and compares what the pipeline delivered
(:attr:`~.base.Observation.throughput`, what the consumer took: it includes a consumer slowed
by the lock) with the ``PROBE`` observations before the move. The kind that holds less memory
(threads) stays when it delivered at least ``1 - TOLERANCE`` of the other; else the workers go
back. One stage is tried at a time, in pipeline order; a stage is tried again when the
machine's CPUs change. On an interpreter without a GIL (``sys._is_gil_enabled()`` false,
free-threaded CPython) threads are the first candidate: a threadable stage starts on threads
and processes are what is tried.

A loader can measure the kind before its executor starts (:func:`start_on_threads`, from a fast
start's reads of ``k`` units at once on threads of the consumer's process, against what ``k``
worker processes would take for them): the stages then
start on the kind measured (:meth:`KindRule.start`), and the trial above is left for when the
CPUs change, for machines with more CPUs than the ``k`` threads measured, and for a measure
that does not settle the kind (:func:`start_settled`).

The rule is the same object live (:class:`~torchtune_pipe.loader.running.RunningPipeline`) and
in the simulator (:class:`~torchtune_pipe.sim.model.SimPipeline`): it reads an
:class:`~.base.Observation` and fills ``Allocation.threads`` where a tuner left it empty.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field

from torchtune_pipe.tuning.base import Allocation, Observation, local_workers, threads_as_now
from torchtune_pipe.tuning.calls_in_flight import RAISE_ABOVE

SETTLE = 3  # observations an allocation holds before a stage's kind is tried
PROBE = 3  # observations each kind is measured over
TOLERANCE = 0.05  # threads stay at >= 95% of what processes delivered (noise of one interval)
# Threads start where k reads at once on threads ran at least this share of the rate k worker
# processes would read them at: the share at which the trial keeps threads. Without a GIL,
# where threads are the first candidate, from START_SCALING_THREADS_FIRST (the free-threaded
# zoo's tiny-rows and hf-arrow measure 0.76-0.92x and run as fast on threads as on processes,
# BENCHMARKS.md). The start measure settles the kind (no trial at these CPUs) from
# SETTLED_ABOVE up, or up to SETTLED_BELOW: in between, the rule tries the other kind.
START_SCALING = 1.0 - TOLERANCE
START_SCALING_THREADS_FIRST = 0.75
SETTLED_ABOVE = START_SCALING
SETTLED_BELOW = 0.6
# Reads that compute (wall within COMPUTE_WAIT_RATIO times their CPU, the ratio below which calls
# in flight are not raised) get no more CPU on threads than on processes: threads tie them at
# best, and the start measure, a few units read without the consumer's own work beside them,
# reads ~10% high (zoo `images`, PIL decode: 0.88-0.98x at the start, 0.86x running). For those,
# threads start, and the measure settles, only where they beat the processes by more than the
# trial's noise (an item's hop that threads skip: zoo `big-items`, 8 MB items, 1.4-1.5x).
COMPUTE_WAIT_RATIO = RAISE_ABOVE
START_SCALING_COMPUTE = 1.0 + TOLERANCE


def start_on_threads(
    threads_rate: float,
    processes_rate: float,
    threads_first: bool | None = None,
    wait_ratio: float | None = None,
) -> bool:
    """Whether a stage should start on threads: units read ``k`` at once on threads of one
    process (``threads_rate``, items/s) came at least :func:`start_share` times as fast as ``k``
    worker processes would read them (``processes_rate``: each unit's CPU and waits but its
    waits for the interpreter lock, plus its hop between processes). Reads that hold the lock
    (pure Python) run one at a time on threads, near ``1/k`` of the processes; reads that
    release it (decoding in C, torch and numpy kernels, waits on files or the network) or that
    the memory's bandwidth bounds run as fast on threads, and skip the hop. Unmeasured rates
    give False (processes: the kind that scales whatever the reads hold)."""
    if threads_rate <= 0.0 or processes_rate <= 0.0:
        return False
    return threads_rate >= start_share(threads_first, wait_ratio) * processes_rate


def start_share(threads_first: bool | None = None, wait_ratio: float | None = None) -> float:
    """The share of ``k`` processes' rate from which ``k`` threads start a stage:
    ``START_SCALING_THREADS_FIRST`` with ``threads_first`` (default: the interpreter has no
    GIL); ``START_SCALING_COMPUTE`` for reads that compute (``wait_ratio``, wall per CPU time of
    a read alone, at most ``COMPUTE_WAIT_RATIO``); else ``START_SCALING``."""
    if (not gil_enabled()) if threads_first is None else threads_first:
        return START_SCALING_THREADS_FIRST
    if wait_ratio is not None and wait_ratio <= COMPUTE_WAIT_RATIO:
        return START_SCALING_COMPUTE
    return START_SCALING


def start_settled(
    threads_rate: float, processes_rate: float, wait_ratio: float | None = None
) -> bool:
    """Whether the start measure of :func:`start_on_threads` settles the kind: threads as fast
    as the processes would be (``SETTLED_ABOVE``; for reads that compute, the share they start
    from, :func:`start_share`), or so much slower (``SETTLED_BELOW``) that processes are clearly
    faster. In between (a little slower by the measure, for less memory) the rule measures both
    kinds on the running pipeline."""
    if threads_rate <= 0.0 or processes_rate <= 0.0:
        return False
    ratio = threads_rate / processes_rate
    above = max(SETTLED_ABOVE, start_share(False, wait_ratio))
    return ratio >= above or ratio <= SETTLED_BELOW


def gil_enabled() -> bool:
    """Whether this interpreter has a GIL (every CPython but a free-threaded build)."""
    probe = getattr(sys, "_is_gil_enabled", None)
    return True if probe is None else bool(probe())


@dataclass
class _Trial:
    """A stage being tried on the other kind."""

    stage: int
    threads: bool  # the kind tried
    before: list[float]  # what the pipeline delivered on the kind it ran
    under: tuple  # the workers and CPUs both kinds are measured under
    after: list[float] = field(default_factory=list)  # on the kind tried, once all moved


class KindRule:
    """Chooses threads or processes for the threadable stages (module docstring).

    Args:
        threads_first: start threadable stages on threads (default: where the interpreter has
            no GIL).
    """

    def __init__(self, threads_first: bool | None = None) -> None:
        self.threads_first = (not gil_enabled()) if threads_first is None else threads_first
        self.kind: dict[int, bool] = {}  # stage -> runs on threads (decided or starting kind)
        self.tried: dict[int, float] = {}  # stage -> the CPUs it was last tried at
        self.barred: set[int] = set()  # stages kept on processes (reads failed on threads)
        self.trial: _Trial | None = None
        self._rates: list[float] = []  # what the pipeline delivered since the last change
        self._last: tuple | None = None  # the allocation those rates were measured under
        self.decisions: list[tuple[str, int, bool, float]] = []  # (what, stage, threads, ratio)

    def start(self, stages: list[int], threads: bool, cpus: float | None) -> None:
        """Start ``stages`` on threads (else processes), as measured before they ran; with
        ``cpus``, the measure stands for that many CPUs (no trial until they change)."""
        for i in stages:
            self.kind[i] = threads
            if cpus is not None:
                self.tried[i] = cpus
            self.decisions.append(("start", i, threads, 0.0))

    def bar(self, stages: list[int]) -> None:
        """Keep ``stages`` on processes for good: their reads failed on a thread."""
        for i in stages:
            self.kind[i] = False
            self.barred.add(i)
            self.decisions.append(("bar", i, False, 0.0))

    def plan(self, obs: Observation, alloc: Allocation) -> Allocation:
        """``alloc`` with ``threads`` decided for every stage, where the tuner left it empty:
        the rule's kind for threadable stages, the kind it runs now for the rest."""
        if alloc.threads:
            return alloc
        local = local_workers(alloc)
        self._measure(obs, alloc)
        for i, st in enumerate(obs.stages):
            if st.threadable and i not in self.kind:
                self.kind[i] = self.threads_first
        threads = []
        for i, st in enumerate(obs.stages):
            if not st.threadable or st.fused:
                threads.append(threads_as_now(st, local[i]))
            else:
                threads.append(local[i] if self.kind[i] else 0)
        return alloc.replace(threads=tuple(threads))

    def _measure(self, obs: Observation, alloc: Allocation) -> None:
        key = (alloc.workers, alloc.fused, tuple(s.threads for s in obs.stages), obs.cpus)
        trial = self.trial
        if trial is not None and (alloc.workers, obs.cpus) != trial.under:
            # The tuner moved workers or the machine changed mid-trial: the two kinds would
            # be measured under different allocations. Back to the kind it ran; tried later.
            self.kind[trial.stage] = not trial.threads
            self.tried.pop(trial.stage, None)
            self.decisions.append(("abort", trial.stage, trial.threads, 0.0))
            self.trial = trial = None
        if key != self._last:  # a change: the interval it lands in measures neither side
            self._last = key
            self._rates = []
            return
        self._rates.append(obs.throughput)
        if trial is not None:
            st = obs.stages[trial.stage]
            moved = (
                st.threads >= local_workers(alloc)[trial.stage]
                if trial.threads
                else (st.threads == 0)
            )
            if moved:
                trial.after.append(obs.throughput)
            if len(trial.after) >= PROBE:
                self._decide(trial)
            return
        if len(self._rates) < SETTLE + PROBE:
            return
        for i, st in enumerate(obs.stages):
            if not st.threadable or st.fused or i in self.barred or self.tried.get(i) == obs.cpus:
                continue
            self.tried[i] = obs.cpus
            self.trial = _Trial(
                i, not self.kind[i], self._rates[-PROBE:], (alloc.workers, obs.cpus)
            )
            self.kind[i] = self.trial.threads
            self.decisions.append(("try", i, self.trial.threads, 0.0))
            return

    def _decide(self, trial: _Trial) -> None:
        before = statistics.median(trial.before)
        after = statistics.median(trial.after)
        ratio = after / before if before > 0 else (1.0 if after <= 0 else float("inf"))
        # Threads are the kind that holds less: they stay unless clearly slower; processes
        # replace them only when clearly faster.
        if trial.threads:
            keep = ratio >= 1.0 - TOLERANCE
        else:
            keep = ratio > 1.0 + TOLERANCE
        self.kind[trial.stage] = trial.threads if keep else not trial.threads
        self.decisions.append(("keep" if keep else "undo", trial.stage, trial.threads, ratio))
        self.trial = None


__all__ = [
    "COMPUTE_WAIT_RATIO", "PROBE", "SETTLE", "SETTLED_ABOVE", "SETTLED_BELOW", "START_SCALING",
    "START_SCALING_COMPUTE", "START_SCALING_THREADS_FIRST", "TOLERANCE",
    "KindRule", "gil_enabled", "start_on_threads", "start_settled", "start_share",
]  # fmt: skip
