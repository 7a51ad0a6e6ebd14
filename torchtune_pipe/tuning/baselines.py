"""Fixed-allocation baselines: ``unoptimized``, ``heuristic`` and ``static``.

None of them reacts to what it observes; each returns one allocation, re-clamped at every step
so that a machine that shrinks under a baseline still never runs past its CPU or memory budget.
None splits a stage between host and cluster: their allocations leave ``Allocation.remote``
empty, so each stage keeps its placement (a ``placement="ray"`` stage stays remote) and the
heuristic's even split is over the host's cores.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchtune_pipe.tuning.base import Allocation, MiB, Observation


def even_split(total: int, n: int) -> tuple[int, ...]:
    """Split ``total`` units over ``n`` parts as evenly as possible, at least one each.

    The remainder goes one unit each to the first stages (the source side), where a DLRM
    pipeline's read/parse work sits.

    >>> even_split(10, 3)
    (4, 3, 3)
    """
    if n <= 0:
        raise ValueError(f"even_split(): n must be a positive int, got {n}")
    base, rest = divmod(max(int(total), n), n)
    return tuple(base + (1 if i < rest else 0) for i in range(n))


class _FixedTuner:
    """Shared behaviour: compute one allocation at reset and keep proposing it."""

    name = "fixed"

    def __init__(self) -> None:
        self._alloc: Allocation | None = None

    def _choose(self, obs: Observation) -> Allocation:
        raise NotImplementedError

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        """Choose the allocation for this pipeline; return ``start`` first when given."""
        self._alloc = self._choose(obs)
        return start if start is not None else self._alloc

    def step(self, obs: Observation) -> Allocation:
        """Return the chosen allocation (the guard fits it to the limits seen now)."""
        if self._alloc is None:
            return self.reset(obs)
        return self._alloc


class UnoptimizedTuner(_FixedTuner):
    """One worker per stage (or the stage's minimum) and minimum buffers: the paper's baseline.

    Args:
        buffer_bytes: outbound buffer per stage (the safety minimum by default).
    """

    name = "unoptimized"

    def __init__(self, buffer_bytes: int = 1 * MiB) -> None:
        super().__init__()
        self.buffer_bytes = int(buffer_bytes)

    def _choose(self, obs: Observation) -> Allocation:
        n = len(obs.stages)
        workers = tuple(max(1, s.min_workers) for s in obs.stages)
        return Allocation(workers, (self.buffer_bytes,) * n)


class HeuristicTuner(_FixedTuner):
    """CPUs split evenly across stages, remainder to the first stages: InTune's starting point.

    Args:
        buffer_bytes: outbound buffer per stage; ``None`` splits ``memory_fraction`` of the
            memory limit evenly across stages.
        memory_fraction: share of ``obs.memory_limit_bytes`` given to buffers when
            ``buffer_bytes`` is None.
    """

    name = "heuristic"

    def __init__(self, buffer_bytes: int | None = 64 * MiB, memory_fraction: float = 0.5) -> None:
        super().__init__()
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(
                f"HeuristicTuner: memory_fraction must be in (0, 1], got {memory_fraction}"
            )
        self.buffer_bytes = buffer_bytes
        self.memory_fraction = memory_fraction

    def _choose(self, obs: Observation) -> Allocation:
        n = len(obs.stages)
        workers = even_split(int(obs.cpus), n)
        if self.buffer_bytes is None:
            per_stage = int(obs.memory_limit_bytes * self.memory_fraction) // n
        else:
            per_stage = int(self.buffer_bytes)
        return Allocation(workers, (per_stage,) * n)


class StaticTuner(_FixedTuner):
    """A fixed allocation given by the user.

    Args:
        workers: workers per stage, in pipeline order.
        buffer_bytes: outbound buffer bytes per stage; one int applies to every stage.

    Example:
        >>> tuner = StaticTuner(workers=(2, 4, 1), buffer_bytes=32 * MiB)
    """

    name = "static"

    def __init__(self, workers: Sequence[int], buffer_bytes: int | Sequence[int] = 64 * MiB):
        super().__init__()
        self.workers = tuple(int(w) for w in workers)
        if not self.workers or min(self.workers) < 1:
            raise ValueError(f"StaticTuner: workers must be positive ints, got {self.workers}")
        if isinstance(buffer_bytes, int):
            self.buffer_bytes = (buffer_bytes,) * len(self.workers)
        else:
            self.buffer_bytes = tuple(int(b) for b in buffer_bytes)
        self._given = Allocation(self.workers, self.buffer_bytes)

    def _choose(self, obs: Observation) -> Allocation:
        if len(self.workers) != len(obs.stages):
            raise ValueError(
                f"StaticTuner: workers has {len(self.workers)} entries but the pipeline has "
                f"{len(obs.stages)} stages ({', '.join(s.name for s in obs.stages)})"
            )
        return self._given
