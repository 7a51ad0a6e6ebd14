"""Calls in flight per worker for stages that wait: one measured rule below every tuner.

A worker whose calls spend most of their wall time waiting (remote reads, RPCs) uses little of
its core; running several of its calls at once on threads fills that core without another
process. The rule compares a stage's wall time in its function with the CPU time of its calls,
per item (:func:`wait_ratio`): near 1 the calls compute and threads cannot help (the GIL), far
above 1 they wait and the stage gets ``ratio / WAIT_RATIO_TARGET`` times the calls in flight,
at most ``MAX_STEP`` times more per decision. It reads only :class:`StageStats` fields that the
simulator reports with the same meaning, so the live pipeline and the simulator follow it
alike, whatever tuner decides the workers and buffers.
"""

from __future__ import annotations

import math

from torchtune_pipe.tuning.base import Allocation, Observation, StageStats

# Wall time per CPU time a worker settles at: a little waiting left over keeps its core busy
# when call times vary.
WAIT_RATIO_TARGET = 1.25
# Raise only past this ratio: below it a worker already keeps its core mostly busy.
RAISE_ABOVE = 2.0
# Halve when calls stop waiting (the threads then only contend for the GIL).
LOWER_BELOW = 1.1
MAX_STEP = 8
# A stage that mostly waits for input or for room downstream would not go faster.
MIN_BUSY = 0.3


def wait_ratio(st: StageStats) -> float | None:
    """Wall seconds in the stage function per CPU second of its calls, per item (1: the calls
    compute all the time; 5: they wait four fifths of it); None when not measured.

    Time runnable but waiting for a CPU (``runqueue``) is left out of the wall time: it is
    not a wait threads could fill, and on a busy machine it is most of it (a JPEG decode on
    2 cores measured 4.5 with it, 1.2 without, and had its calls in flight raised to 64)."""
    if st.items_per_s <= 0.0 or st.cpu_s_per_item <= 0.0 or st.workers <= 0:
        return None
    on_cpu_or_waiting = max(0.0, st.busy - (st.runqueue or 0.0))
    wall_s_per_item = on_cpu_or_waiting * st.workers / st.items_per_s
    return wall_s_per_item / st.cpu_s_per_item


def next_concurrency(st: StageStats) -> int:
    """The stage's calls in flight per worker for the next interval: a raise towards
    :func:`settled_concurrency` of at most ``MAX_STEP`` times, or half when calls stop
    waiting."""
    c = st.concurrency
    target = settled_concurrency(st)
    if target > c:
        return min(target, c * MAX_STEP)
    r = wait_ratio(st) if st.max_concurrency > 1 else None
    if r is not None and r < LOWER_BELOW and c > 1:
        return max(1, c // 2)
    return c


def settled_concurrency(st: StageStats) -> int:
    """The calls in flight per worker the rule is raising the stage towards (where
    :func:`next_concurrency` ends after its steps of at most ``MAX_STEP``), or the current
    count where it does not raise: ``ratio / WAIT_RATIO_TARGET`` times it, up to
    ``max_concurrency``, for a busy stage whose calls wait more than ``RAISE_ABOVE`` times
    their CPU."""
    c = st.concurrency
    r = wait_ratio(st) if st.max_concurrency > 1 else None
    if r is None or r <= RAISE_ABOVE or st.busy < MIN_BUSY:
        return c
    return max(c, min(st.max_concurrency, math.ceil(c * r / WAIT_RATIO_TARGET)))


def start_concurrency(ratio: float | None, max_concurrency: int) -> int:
    """Calls in flight per worker to start a stage with, from the wait ratio of its first calls
    (wall per CPU time, measured before any worker ran: a fast start's reads): where they wait
    more than ``RAISE_ABOVE`` times their CPU, where :func:`settled_concurrency` would take a
    worker of one call; else 1."""
    if ratio is None or ratio <= RAISE_ABOVE or max_concurrency <= 1:
        return 1
    return max(1, min(max_concurrency, math.ceil(ratio / WAIT_RATIO_TARGET)))


def plan_concurrency(obs: Observation, alloc: Allocation) -> Allocation:
    """``alloc`` with its concurrency decided: the tuner's where it set one, else the rule's
    for every stage, bounded by each stage's ``max_concurrency``."""
    if alloc.concurrency:
        cs = tuple(
            max(1, min(c, s.max_concurrency))
            for c, s in zip(alloc.concurrency, obs.stages, strict=True)
        )
    else:
        cs = tuple(next_concurrency(s) for s in obs.stages)
    return alloc.replace(concurrency=cs)


__all__ = [
    "next_concurrency", "plan_concurrency", "settled_concurrency", "start_concurrency",
    "wait_ratio",
    "WAIT_RATIO_TARGET",
]  # fmt: skip
