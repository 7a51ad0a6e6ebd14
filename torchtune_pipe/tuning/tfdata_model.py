"""tf.data AUTOTUNE's analytic pipeline model and its search algorithms, for a linear chain.

The pipeline ``stage 0 (source) -> ... -> stage n-1 -> prefetch -> consumer`` is modelled the
way tf.data models ``source -> parallel_map ... -> prefetch``: every stage is an
``AsyncKnownRatio`` node with a ``parallelism`` parameter (the source with ratio 0), and the
root is a prefetch node (``AsyncKnownRatio(1)`` with a ``buffer_size`` parameter) whose buffer
is sized by the legacy prefetch autotuner, so it counts for no modelled memory. Formulas follow
``tensorflow/core/framework/model.cc`` (``AsyncRatio::InputTimeLocked/OutputTimeLocked``,
``Node::ComputeWaitTime``, ``TotalProcessingTime``, ``MaximumBufferedBytes``) and
``Model::OptimizeHillClimbHelper`` / ``OptimizeStageBased``. Times are seconds per element.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

# tf.data compares output times in nanoseconds: a candidate counts when it improves by more
# than -1 ns (``best_delta`` starts at -1), a buffer_size one only by more than 1 ns
# (``kBufferSizeMinDelta``).
_NS = 1e-9


def wait_time(producer: float, consumer: float, buffer_size: float) -> float:
    """Expected wait of a consumer on a buffer fed by a producer (M/M/1/K, ``ComputeWaitTime``).

    Args:
        producer: mean time for the producer to make one element (``y``).
        consumer: mean time between the consumer's requests (``x``).
        buffer_size: buffer capacity in elements (``n``).

    Returns:
        ``p_empty * producer``, where ``p_empty`` is the probability the buffer is empty.
    """
    if producer == 0.0:
        return 0.0
    if consumer == 0.0:
        return producer
    if consumer == producer:
        return producer / (buffer_size + 1.0)
    if consumer > producer:
        r = producer / consumer
        p = r**buffer_size * (1.0 - r) / (1.0 - r ** (buffer_size + 1.0))
    else:
        r = consumer / producer
        p = (1.0 - r) / (1.0 - r ** (buffer_size + 1.0))
    return p * producer


@dataclass(frozen=True)
class ChainModel:
    """What the model knows about each stage, in pipeline order (source first).

    Attributes:
        self_times: mean self processing time per emitted element, seconds (all workers).
        ratios: input elements consumed per emitted element; the source's is 0.
        element_bytes: mean size of one emitted element.
        prefetch_self_time: self time of the root prefetch node (normally 0).
    """

    self_times: tuple[float, ...]
    ratios: tuple[float, ...]
    element_bytes: tuple[float, ...]
    prefetch_self_time: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.self_times)
        if len(self.ratios) != n or len(self.element_bytes) != n:
            raise ValueError(
                f"ChainModel: self_times, ratios, element_bytes must have equal lengths, got "
                f"{n}, {len(self.ratios)}, {len(self.element_bytes)}"
            )

    @property
    def n(self) -> int:
        return len(self.self_times)

    def output_time(
        self, parallelism: Sequence[float], prefetch_buffer: float, model_input_time: float = 0.0
    ) -> float:
        """Modelled time for the root to return one element to the consumer (``OutputTime``)."""
        n = self.n
        # Input pass, root -> source: time between requests each node receives.
        inputs = [0.0] * n
        inherited = model_input_time + self.prefetch_self_time  # prefetch: ratio 1, p = 1
        for i in range(n - 1, -1, -1):
            r = self.ratios[i]
            t = inherited + self.self_times[i] / parallelism[i]
            inputs[i] = t if r == 0.0 else t / r
            inherited = inputs[i]
        # Output pass, source -> root.
        out_prev = 0.0
        for i in range(n):
            r, p = self.ratios[i], parallelism[i]
            if r == 0.0:
                consumer, producer, buf = inputs[i], 0.0, p
            else:
                consumer, producer, buf = inputs[i] * r, r * out_prev, p / r
            out_prev = self.self_times[i] / p + wait_time(producer, consumer, buf)
        root_in = model_input_time + self.prefetch_self_time
        return self.prefetch_self_time + wait_time(out_prev, root_in, prefetch_buffer)

    def total_processing_time(self) -> float:
        """CPU time spent per root element across the chain (``TotalProcessingTime``)."""
        total = 0.0
        for i in range(self.n):
            r = self.ratios[i]
            total = self.self_times[i] + (0.0 if r == 0.0 else r * total)
        return self.prefetch_self_time + total

    def stage_bytes(self, i: int, parallelism: float) -> float:
        """Modelled buffer bytes of stage ``i`` (``parallelism x size / memory_ratio``)."""
        r = self.ratios[i]
        return parallelism * self.element_bytes[i] / (r if r != 0.0 else 1.0)

    def max_buffered_bytes(self, parallelism: Sequence[float], prefetch_buffer: float = 0) -> float:
        """Modelled peak buffer bytes (``TotalMaximumBufferedBytes``).

        ``prefetch_buffer`` counts only when the prefetch node is tuned by the model; pass 0 for
        the legacy prefetch autotuner, whose bytes the model does not count.
        """
        total = sum(self.stage_bytes(i, parallelism[i]) for i in range(self.n))
        return total + prefetch_buffer * self.element_bytes[-1]

    def stage_costs(self, ema_self_times: Sequence[float], parallelism: Sequence[float]) -> list:
        """STAGE_BASED's per-stage cost in seconds per root element (``ModelTiming``)."""
        costs = [0.0] * self.n
        pipeline_ratio = 1.0  # root prefetch has ratio 1
        for i in range(self.n - 1, -1, -1):
            costs[i] = ema_self_times[i] / parallelism[i] * pipeline_ratio
            pipeline_ratio *= self.ratios[i]
        return costs


def hill_climb(
    model: ChainModel,
    lo: Sequence[int],
    hi: Sequence[int],
    ram_budget: float,
    cpu_budget: float | None = None,
    tunable: Sequence[bool] | None = None,
    prefetch_buffer: int = 1,
    tune_prefetch: bool = False,
) -> tuple[list[int], int, float]:
    """tf.data's greedy +1 climb from the minimum (``OptimizeHillClimbHelper``).

    With ``cpu_budget=None`` this is MAX_PARALLELISM (tf.data's default): it stops only when
    every parameter is at its maximum, when no +1 improves the output time by more than -1 ns
    (so ties keep climbing), or when the modelled bytes pass ``ram_budget`` (the last +1 is
    undone). With a ``cpu_budget`` it is HILL_CLIMB, which also stops once the output time beats
    ``total_processing_time / cpu_budget``.

    Args:
        model: the chain model.
        lo, hi: per-stage parallelism bounds.
        ram_budget: bytes the model may use.
        cpu_budget: CPUs for HILL_CLIMB's stop rule; None for MAX_PARALLELISM.
        tunable: per stage, whether its parallelism is tuned (False keeps it at ``lo``).
        prefetch_buffer: legacy prefetch buffer size (elements) when not tuned.
        tune_prefetch: let the model tune the prefetch ``buffer_size`` too (non-legacy).

    Returns:
        (parallelism per stage, prefetch buffer, modelled bytes of the result).
    """
    n = model.n
    tunable = tunable or (True,) * n
    values = [int(lo[i]) for i in range(n)]
    buf = 1 if tune_prefetch else prefetch_buffer
    budget_t = model.total_processing_time() / cpu_budget if cpu_budget else None
    params = [i for i in range(n) if tunable[i] and hi[i] > lo[i]]
    last: int | None = None  # index of the last increment; n means the prefetch buffer

    def memory(vals: list[int], b: int) -> float:
        return model.max_buffered_bytes(vals, b if tune_prefetch else 0)

    while True:
        t = model.output_time(values, buf)
        m = memory(values, buf)
        all_max = all(values[i] >= hi[i] for i in params) and not tune_prefetch
        if all_max or (budget_t is not None and t < budget_t) or m > ram_budget:
            if m > ram_budget and last is not None:
                if last == n:
                    buf -= 1
                else:
                    values[last] -= 1
            break
        best, best_delta = None, -_NS
        for i in params:
            if values[i] >= hi[i]:
                continue
            values[i] += 1
            delta = t - model.output_time(values, buf)
            values[i] -= 1
            if delta > best_delta:
                best, best_delta = i, delta
        if tune_prefetch:
            delta = t - model.output_time(values, buf + 1)
            if delta > best_delta and delta > _NS:
                best, best_delta = n, delta
        if best is None:
            break  # local maximum
        if best == n:
            buf += 1
        else:
            values[best] += 1
        last = best
    return values, buf, memory(values, buf)


def stage_based(
    model: ChainModel,
    ema_self_times: Sequence[float],
    lo: Sequence[int],
    hi: Sequence[int],
    ram_budget: float,
    target_time: float,
) -> tuple[list[int], float] | None:
    """tf.data's STAGE_BASED algorithm (``OptimizeStageBased``) on the chain.

    From the minimum, repeatedly give +1 to the slowest stage while its cost is above
    ``target_time``; stop at a stage that is at its maximum or did not improve (undoing that
    +1). Passing the RAM budget abandons the round.

    Returns:
        (parallelism per stage, modelled bytes), or None when the round is abandoned.
    """
    values = [int(x) for x in lo]
    costs = model.stage_costs(ema_self_times, values)
    heap = [(-c, i) for i, c in enumerate(costs)]
    heapq.heapify(heap)
    while heap:
        neg, i = heapq.heappop(heap)
        cost = -neg
        if cost <= target_time or values[i] >= hi[i]:
            break
        values[i] += 1
        if model.max_buffered_bytes(values) > ram_budget:
            return None
        new = model.stage_costs(ema_self_times, values)[i]
        if new >= cost:
            values[i] -= 1
            break
        heapq.heappush(heap, (-new, i))
    return values, model.max_buffered_bytes(values)
