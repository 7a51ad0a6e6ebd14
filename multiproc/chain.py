"""The worker side of fusion: a worker that runs the next stages' functions too.

:class:`Chain` is the part of the worker (``worker._Worker``) that unpickles and initializes
the specs of the stages fused into its own (on first use) and runs them over its outputs, one
call at a time, counting each stage's time, items and errors in that stage's own columns
(``stats.fused_col``). The router side is :mod:`multiproc.fusion`.
"""

from __future__ import annotations

import time

from . import inherit, stats

_ns = time.perf_counter_ns
_cpu_ns = time.thread_time_ns


def call_stage(st, items: list, error, cell=None) -> list | None:
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
    """Fused stages run by a worker (see the module docstring). The worker provides
    ``chain_bytes``, ``chain``, ``index``, ``row``, ``calls``, ``chain_ns``, ``chain_cpu_ns`` and
    ``_error(work_id, exc, where, depth)``."""

    def _chained(self, d: int):
        """The spec of the stage ``d`` after this worker's own, ready to run here."""
        while len(self.chain) < d:
            st = inherit.loads(self.chain_bytes[len(self.chain)])
            if st.init is not None:
                st.init(st.name, self.index)
            self.chain.append(st)
        return self.chain[d - 1]

    def _run_chain(self, work_id, items: list, depth: int, where: str) -> list | None:
        """Run the next ``depth`` stages' functions over ``items`` (one call at a time), each
        stage's time, items and errors in its own columns; None when an error stops the run."""
        row = self.row
        self.calls.take_not_items()  # the host's are counted already
        for d in range(1, depth + 1):
            st = self._chained(d)
            t0, c0 = _ns(), _cpu_ns()
            row[stats.fused_col(d, stats.F_ITEMS_IN)] += len(items)
            try:
                out = call_stage(
                    st,
                    items,
                    lambda i, e, st=st, d=d: self._error(
                        work_id, e, f"{where}, stage {st.name!r}" + _at(i), d
                    ),
                )
                if out is None:
                    return None
            finally:
                ns, cpu = _ns() - t0, _cpu_ns() - c0
                row[stats.fused_col(d, stats.F_BUSY_NS)] += ns
                row[stats.fused_col(d, stats.F_CPU_NS)] += cpu
                self.chain_ns += ns
                self.chain_cpu_ns += cpu
            marks = self.calls.take_not_items()  # concurrency.not_an_item: not items
            row[stats.fused_col(d, stats.F_ITEMS_IN)] -= marks
            row[stats.fused_col(d, stats.F_ITEMS_OUT)] += len(out) - marks
            items = out
        return items
