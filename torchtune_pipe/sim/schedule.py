"""A simulated machine's value over time: CPUs, memory limit, cluster CPUs.

A :data:`Schedule` is the start times (seconds, ascending) and the value from each on;
:func:`schedule` builds one from a number or ``[(t_start_s, value), ...]``, :func:`value_at` reads
it at a time.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

Schedule = tuple[tuple[float, ...], tuple[float, ...]]


def schedule(
    value: float | Sequence[tuple[float, float]], what: str, zero: bool = False
) -> Schedule:
    """The schedule of ``value``: a number from time 0 on, or ``(t_start_s, value)`` steps.

    Raises:
        ValueError: on an empty schedule, or a value below 0 (or at 0 unless ``zero``),
            naming ``what``.
    """
    if isinstance(value, int | float):
        steps = [(0.0, float(value))]
    else:
        steps = sorted((float(t), float(v)) for t, v in value)
        if not steps:
            raise ValueError(f"SimPipeline: {what} schedule is empty")
    if any(v < 0 or (v == 0 and not zero) for _, v in steps):
        raise ValueError(f"SimPipeline: {what} must be {'>=' if zero else '>'} 0, got {steps}")
    return tuple(t for t, _ in steps), tuple(v for _, v in steps)


def value_at(sched: Schedule, t: float) -> float:
    """The value of ``sched`` at time ``t`` (its first value before its first start)."""
    return sched[1][max(0, bisect.bisect_right(sched[0], t) - 1)]
