"""A tiny analytic :class:`~.base.Tunable` for tests and examples of tuners.

:class:`LinearTunable` is a chain of CPU-bound stages where stage ``i`` with ``w_i`` workers
emits ``w_i / cost_s[i] x ratio`` items per second and the chain runs at its slowest stage.
It knows nothing of queues or noise; use the simulator (``torchtune_pipe.sim``) for studies.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats


class LinearTunable:
    """Stage rates ``workers / cost``; throughput is the slowest stage's rate.

    Args:
        cost_s: CPU seconds per *root* item spent in each stage (pipeline order).
        cpus: CPUs reported by :meth:`observe` (assign ``.cpus`` to change it).
        memory_limit_bytes: memory limit reported by :meth:`observe`.
        interval_s: how far ``t`` advances at each :meth:`observe`.
        items_per_root: items each stage emits per root item (e.g. a batch size upstream).
        io_bound: per stage, whether to report it as I/O-bound.
        max_workers: per-stage worker bound reported in the stats.

    Example:
        >>> pipe = LinearTunable(cost_s=(0.01, 0.02), cpus=4)
        >>> pipe.apply(Allocation((1, 2), (MiB, MiB))); pipe.observe().throughput
        100.0
    """

    def __init__(
        self,
        cost_s: Sequence[float],
        cpus: float,
        memory_limit_bytes: int = 1 << 30,
        interval_s: float = 1.0,
        items_per_root: Sequence[float] | None = None,
        io_bound: Sequence[bool] | None = None,
        max_workers: int = 1 << 16,
    ) -> None:
        n = len(cost_s)
        self.cost_s = tuple(float(c) for c in cost_s)
        self.cpus = cpus
        self.memory_limit_bytes = int(memory_limit_bytes)
        self.interval_s = float(interval_s)
        self.items_per_root = tuple(items_per_root or (1.0,) * n)
        self.io_bound = tuple(io_bound or (False,) * n)
        self.max_workers = int(max_workers)
        self.t = 0.0
        self.allocation = Allocation((1,) * n, (MiB,) * n)
        self.applied: list[Allocation] = []

    def rate(self, allocation: Allocation) -> float:
        """Root items per second the chain delivers under ``allocation``."""
        return min(w / c for w, c in zip(allocation.workers, self.cost_s, strict=True))

    def observe(self) -> Observation:
        """Advance ``t`` by one interval and report the steady state of the current allocation."""
        self.t += self.interval_s
        a = self.allocation
        root = self.rate(a)
        stages = []
        for i, (w, c) in enumerate(zip(a.workers, self.cost_s, strict=True)):
            items = root * self.items_per_root[i]
            busy = root * c / w
            stages.append(
                StageStats(
                    name=f"stage{i}",
                    workers=w,
                    max_workers=self.max_workers,
                    items_per_s=items,
                    busy=busy,
                    blocked_in=0.0 if i == 0 else 1.0 - busy,
                    buffer_bytes=a.buffer_bytes[i],
                    buffer_fill=0.5,
                    cpu_s_per_item=c / self.items_per_root[i],
                    io_bound=self.io_bound[i],
                )
            )
        used = sum(a.buffer_bytes) // 2
        return Observation(
            stages=tuple(stages),
            throughput=root,
            cpus=self.cpus,
            memory_limit_bytes=self.memory_limit_bytes,
            memory_used_bytes=used,
            t=self.t,
            oom=used > self.memory_limit_bytes,
        )

    def apply(self, allocation: Allocation) -> None:
        """Switch to ``allocation`` (recorded in :attr:`applied`)."""
        self.allocation = allocation
        self.applied.append(allocation)
