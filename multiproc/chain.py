"""The worker side of fusion: a worker that runs the next stages' functions too.

:class:`Chain` holds the specs of the stages that may be fused into a worker's own, unpickles
and initializes each on first use, and runs them over the worker's outputs, one call at a
time, counting each stage's time, items and errors in that stage's own columns
(``stats.fused_col``). The router side is :mod:`multiproc.fusion`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import concurrency, inherit, stats

_ns = time.perf_counter_ns
_cpu_ns = time.thread_time_ns


def call_stage(
    st: Any,
    items: list[Any],
    error: Callable[[int | None, Exception], bool],
    cell: memoryview | None = None,
) -> list[Any] | None:
    """Run a stateless stage's function over a frame's items, one call at a time:
    ``batch_map`` once on the list, ``flat_map`` and ``map`` per item. A raising call goes to
    ``error(i, exc)`` (``i`` None for a whole-frame call), which returns whether to go on
    (``on_error='skip'``); None when it says stop. ``cell`` gets each item's position (the
    worker's ``WORK_ITEM`` counter)."""
    if st.kind == "batch_map":
        try:
            return list(st.fn(items))
        except Exception as e:
            return [] if error(None, e) else None
    out: list = []
    fn, flat = st.fn, st.kind == "flat_map"
    for i, x in enumerate(items):
        if cell is not None:
            cell[stats.WORK_ITEM] = i + 1
        try:
            if flat:
                out.extend(fn(x))
            else:
                out.append(fn(x))
        except Exception as e:
            if not error(i, e):
                return None
    return out


def _at(i: int | None) -> str:
    return "" if i is None else f", item {i}"


class Chain:
    """The stages fused into a worker's own (see the module docstring).

    Args:
        specs: the specs of the next stages, in order, that the worker may run too: each
            pickled, or the spec itself (:func:`multiproc.inherit.resolve`).
        index: the worker's index in its stage, passed to each stage's ``init``.
        row: the worker's counter row; each fused stage counts in its own columns.
        calls: the worker's call pool; its not-an-item marks are not counted as items.
        on_error: reports ``(work_id, exc, where, depth)`` as the worker does; True when the
            stage goes on (``on_error='skip'``).

    Attributes:
        stages: the specs unpickled and initialized so far (the first ``len(stages)``).
        depth: how many of them the worker runs now (:meth:`set_depth`).
    """

    def __init__(
        self,
        specs: tuple[Any, ...],
        index: int,
        row: np.ndarray,
        calls: concurrency.CallPool,
        on_error: Callable[[Any, BaseException, str, int], bool],
    ) -> None:
        self.specs = specs
        self.index = index
        self.row = row
        self.calls = calls
        self.on_error = on_error
        self.stages: list[Any] = []
        self._owned: list[bool] = []  # per stage in ``stages``: the worker's own copy
        self.depth = 0
        self._ns = self._cpu_ns = 0  # time in their functions since take_time()

    def set_depth(self, depth: int) -> None:
        """Run the next ``depth`` stages from now on (at most as many as there are)."""
        self.depth = min(depth, len(self.specs))

    def take_time(self) -> tuple[int, int]:
        """Wall and CPU nanoseconds spent in the fused stages' functions since the last call."""
        out = self._ns, self._cpu_ns
        self._ns = self._cpu_ns = 0
        return out

    def stage(self, d: int) -> Any:
        """The spec of the stage ``d`` after the worker's own, ready to run here."""
        while len(self.stages) < d:
            st, own = inherit.resolve(self.specs[len(self.stages)])
            if st.init is not None:
                st.init(st.name, self.index)
            self.stages.append(st)
            self._owned.append(own)
        return self.stages[d - 1]

    def owned(self) -> list[Any]:
        """The stages used so far whose specs are the worker's own copies (unpickled)."""
        return [st for st, own in zip(self.stages, self._owned, strict=True) if own]

    def run(self, work_id: Any, items: list[Any], depth: int, where: str) -> list[Any] | None:
        """Run the next ``depth`` stages' functions over ``items`` (one call at a time), each
        stage's time, items and errors in its own columns; None when an error stops the run."""
        row = self.row
        self.calls.take_not_items()  # the host's are counted already
        for d in range(1, depth + 1):
            st = self.stage(d)
            t0, c0 = _ns(), _cpu_ns()
            row[stats.fused_col(d, stats.F_ITEMS_IN)] += len(items)
            try:
                out = call_stage(st, items, self._reporter(work_id, where, st.name, d))
                if out is None:
                    return None
            finally:
                ns, cpu = _ns() - t0, _cpu_ns() - c0
                row[stats.fused_col(d, stats.F_BUSY_NS)] += ns
                row[stats.fused_col(d, stats.F_CPU_NS)] += cpu
                self._ns += ns
                self._cpu_ns += cpu
            marks = self.calls.take_not_items()  # concurrency.not_an_item: not items
            row[stats.fused_col(d, stats.F_ITEMS_IN)] -= marks
            row[stats.fused_col(d, stats.F_ITEMS_OUT)] += len(out) - marks
            items = out
        return items

    def _reporter(
        self, work_id: Any, where: str, name: str, d: int
    ) -> Callable[[int | None, Exception], bool]:
        """``call_stage``'s ``error`` for the stage ``d`` after the worker's own, ``name``."""
        return lambda i, e: self.on_error(work_id, e, f"{where}, stage {name!r}" + _at(i), d)
