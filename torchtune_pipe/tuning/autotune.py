"""A faithful re-implementation of tf.data AUTOTUNE as a :class:`~.base.Tuner`.

What it keeps from tf.data, weaknesses included (they are what the baseline is for):

* per-stage self time is the *cumulative* average busy time per element since start, so it
  follows drifting UDF costs slowly;
* the analytic M/M/1/K output-time model of :mod:`.tfdata_model`;
* MAX_PARALLELISM (the default): a greedy +1 climb from the minimum each round that keeps
  climbing on ties, so every stage's parallelism heads to the cap; HILL_CLIMB and STAGE_BASED
  are options;
* a round at 10 ms, then periods doubling to 60 s (``kOptimizationPeriodMinMs/MaxMs``), mapped
  onto observation times ``obs.t``: a step runs a round when ``obs.t`` has reached the due time;
* parallelism capped by the CPU count seen at start (the runner thread pool is sized once);
* RAM budget ``0.5 x (available + buffered)`` (``kRamBudgetShare``) counted from *modelled*
  buffer bytes only; a result is applied only when it fits what the prefetch left over;
* the legacy prefetch autotuner: the last stage's buffer starts at one element, doubles (then
  grows by 2048) each time it drains empty after having been full, and never shrinks;
* no cluster: tf.data's AUTOTUNE sizes one host's thread pools, so its allocations leave
  ``Allocation.remote`` empty (each stage keeps its placement; ``Observation.cluster_cpus`` is
  not read);
* map fusion as a static graph rewrite: tf.data's ``map_fusion`` option (off by default in
  every tf.data release's ``OptimizationOptions``) fuses adjacent stateless maps once, before
  the model runs; ``AutotuneConfig(map_fusion=True)`` fuses every stage that may be fused at
  reset and never changes it. A fused group is one node of the model, as tf.data's fused map
  is one op: its host's self time covers every stage in it.

``AutotuneTuner(adaptive=True)`` (registry name ``autotune-adaptive``) re-launches from scratch
when the CPU count changes, which is what a user of tf.data must do by hand.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

from torchtune_pipe.tuning.base import Allocation, MiB, Observation, fuse_fusable, fusion_host
from torchtune_pipe.tuning.tfdata_model import ChainModel, hill_climb, stage_based

log = logging.getLogger(__name__)

ALGORITHMS = ("max_parallelism", "hill_climb", "stage_based")
PERIOD_MIN_S = 0.010  # tf.data kOptimizationPeriodMinMs
PERIOD_MAX_S = 60.0  # tf.data kOptimizationPeriodMaxMs
RAM_BUDGET_SHARE = 0.5  # tf.data kRamBudgetShare
PREFETCH_LINEAR_STEP = 2048  # tf.data kBufferLimitThreshold: doubling stops here
STAGE_BASED_WINDOW = 100  # tf.data keeps the last 100 iterator gaps


@dataclass(frozen=True)
class AutotuneConfig:
    """Options of the AUTOTUNE baseline.

    Attributes:
        algorithm: "max_parallelism" (tf.data's default), "hill_climb" or "stage_based".
        element_bytes: bytes of one element emitted by each stage (an int for all stages).
            tf.data measures this; the pipeline telemetry does not report it per stage.
        initial_parallelism: parallelism before the first round (tf.data's default 16).
        ram_budget_bytes: fixed RAM budget; None for ``0.5 x (available + buffered)``.
        legacy_prefetch: size the last buffer with the legacy autotuner (tf.data's default);
            False lets the model tune it as a ``buffer_size`` parameter.
        prefetch_ram_check: legacy growth asks the RAM budget first (current tf.data); older
            versions grew without any check.
        full_fill, empty_fill: buffer fill fractions read as "full" and "drained empty".
        adaptive: re-launch from scratch when the CPU count changes.
        min_stage_based_gaps: consumer-gap samples STAGE_BASED needs before its target is
            non-zero (each observation is already a mean over many gaps).
        map_fusion: fuse every stage that may be fused, once, at reset (tf.data's
            ``OptimizationOptions.map_fusion``, False by default there too).
    """

    algorithm: str = "max_parallelism"
    element_bytes: int | tuple[int, ...] = 1 * MiB
    initial_parallelism: int = 16
    ram_budget_bytes: int | None = None
    legacy_prefetch: bool = True
    prefetch_ram_check: bool = True
    full_fill: float = 0.9
    empty_fill: float = 0.05
    adaptive: bool = False
    min_stage_based_gaps: int = 1
    map_fusion: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"AutotuneConfig: algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}"
            )
        if self.initial_parallelism < 1:
            raise ValueError(
                f"AutotuneConfig: initial_parallelism must be >= 1, got {self.initial_parallelism}"
            )


class LegacyPrefetch:
    """tf.data's legacy prefetch autotuner (``prefetch_autotuner.cc``): grows, never shrinks."""

    def __init__(self, start: int = 1) -> None:
        self.limit = max(1, int(start))
        self.upswing = True

    def record(self, fill: float, full_fill: float, empty_fill: float, grant) -> bool:
        """Feed one buffer-fill reading; returns True when the limit grew.

        Args:
            fill: fraction of the buffer in use.
            full_fill, empty_fill: thresholds for "full" and "empty".
            grant: ``grant(new_limit) -> bool`` asks the RAM budget for the growth.
        """
        if self.upswing:
            if fill >= full_fill:
                self.upswing = False
            return False
        if fill > empty_fill:
            return False
        if self.limit >= PREFETCH_LINEAR_STEP:
            new = self.limit + PREFETCH_LINEAR_STEP
        else:
            new = self.limit * 2
        if not grant(new):
            return False  # stays in downswing and asks again at the next drain
        self.limit = new
        self.upswing = True
        return True


class AutotuneTuner:
    """tf.data AUTOTUNE's per-stage parallelism and prefetch tuning on our pipelines.

    Args:
        config: an :class:`AutotuneConfig`; keyword arguments override its fields.

    Example:
        >>> tuner = AutotuneTuner(algorithm="hill_climb", element_bytes=512 * 1024)
    """

    def __init__(self, config: AutotuneConfig | None = None, **overrides) -> None:
        base = config or AutotuneConfig()
        self.config = AutotuneConfig(**{**base.__dict__, **overrides})
        self.name = "autotune-adaptive" if self.config.adaptive else "autotune"
        self.rounds = 0

    # -- lifecycle -----------------------------------------------------------------------
    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        """Start (or re-launch) AUTOTUNE: fresh statistics, schedule, caps and prefetch.

        ``start`` is returned first when given; AUTOTUNE's own parallelism takes over at the
        next step (its model starts from ``initial_parallelism``, as tf.data's does)."""
        n = len(obs.stages)
        eb = self.config.element_bytes
        self._eb = tuple(float(x) for x in ((eb,) * n if isinstance(eb, int) else eb))
        if len(self._eb) != n:
            raise ValueError(f"AutotuneConfig: element_bytes has {len(self._eb)} entries, {n=}")
        self._cpus_at_start = obs.cpus
        cap = max(1, int(obs.cpus))  # runner thread pool size, fixed at iterator creation
        self._lo = [max(1, s.min_workers) for s in obs.stages]
        self._hi = [max(self._lo[i], min(s.max_workers, cap)) for i, s in enumerate(obs.stages)]
        self._busy_s = [0.0] * n
        self._elements = [0.0] * n
        self._ema = [0.0] * n
        self._gaps: deque[float] = deque(maxlen=STAGE_BASED_WINDOW)
        self._last_t = obs.t
        self._period = PERIOD_MIN_S
        self._due_t = obs.t + PERIOD_MIN_S
        self._prefetch = LegacyPrefetch(1)
        self._prefetch_model = 1
        self._legacy_bytes = self._eb[-1]
        init = self.config.initial_parallelism
        self._values = [min(self._hi[i], max(self._lo[i], init)) for i in range(n)]
        self._model_bytes = 0.0
        self.rounds = 0
        self._fused: tuple[bool, ...] = ()
        if self.config.map_fusion:
            self._fused = fuse_fusable(obs)
        if start is not None:
            return start.replace(fused=self._fused) if self._fused else start
        return self._allocation(obs)

    def step(self, obs: Observation) -> Allocation:
        """Account the interval, run the legacy prefetch rule, optimise when a round is due."""
        if self.config.adaptive and obs.cpus != self._cpus_at_start:
            log.info("autotune: CPUs %s -> %s, re-launching", self._cpus_at_start, obs.cpus)
            return self.reset(obs)
        self._account(obs)
        if self.config.legacy_prefetch:
            self._prefetch.record(
                obs.stages[-1].buffer_fill,
                self.config.full_fill,
                self.config.empty_fill,
                lambda new: self._grant_prefetch(obs, new),
            )
            self._legacy_bytes = self._prefetch.limit * self._eb[-1]
        if obs.t >= self._due_t:
            self._optimize(obs)
            self._period = min(PERIOD_MAX_S, self._period * 2.0)
            self._due_t = obs.t + self._period
        return self._allocation(obs)

    # -- model inputs --------------------------------------------------------------------
    def _account(self, obs: Observation) -> None:
        dt = obs.t - self._last_t
        if dt <= 0.0:
            dt = 1.0  # a Tunable without a clock: count each observation as one unit of time
        self._last_t = obs.t
        fused = [s.fused for s in obs.stages]
        busy = [0.0] * len(obs.stages)
        for i, s in enumerate(obs.stages):
            workers = obs.stages[fusion_host(fused, i)].workers
            # A fused group is one node: its stages' time is its host's self time.
            busy[fusion_host(fused, i)] += (
                s.cpu_s_per_item * s.items_per_s * dt
                if s.cpu_s_per_item > 0
                else workers * s.busy * dt
            )
        for i, s in enumerate(obs.stages):
            items = s.items_per_s * dt
            self._busy_s[i] += busy[i]
            self._elements[i] += items
            if items > 0:
                self._ema[i] = busy[i] / items  # ~ an EMA over elements with weight 0.1
        if obs.consumer_step_s > 0:
            self._gaps.append(obs.consumer_step_s)

    def model(self) -> ChainModel | None:
        """The chain model built from the statistics so far (None before any element)."""
        n = len(self._elements)
        if not all(e > 0 for e in self._elements):
            return None
        selfs = tuple(self._busy_s[i] / self._elements[i] for i in range(n))
        ratios = (0.0,) + tuple(self._elements[i - 1] / self._elements[i] for i in range(1, n))
        return ChainModel(selfs, ratios, self._eb)

    def ram_budget(self, obs: Observation) -> float:
        """Bytes for model plus legacy prefetch: ``0.5 x (available + buffered)``."""
        if self.config.ram_budget_bytes is not None:
            return float(self.config.ram_budget_bytes)
        available = max(0, obs.memory_limit_bytes - obs.memory_used_bytes)
        return RAM_BUDGET_SHARE * (available + obs.memory_used_bytes)

    def _grant_prefetch(self, obs: Observation, new_limit: int) -> bool:
        if not self.config.prefetch_ram_check:
            return True
        delta = (new_limit - self._prefetch.limit) * self._eb[-1]
        return self._legacy_bytes + self._model_bytes + delta <= self.ram_budget(obs)

    def _target_time(self) -> float:
        if len(self._gaps) < max(1, self.config.min_stage_based_gaps):
            return 0.0
        gaps = list(self._gaps)
        mean = statistics.fmean(gaps)
        sd = statistics.pstdev(gaps) if len(gaps) > 1 else 0.0
        kept = [g for g in gaps if g <= mean + 2.0 * sd]
        return statistics.fmean(kept) if kept else mean

    # -- one optimisation round ------------------------------------------------------------
    def _optimize(self, obs: Observation) -> None:
        model = self.model()
        if model is None:
            return  # tf.data only tunes nodes that have produced an element
        legacy = self._legacy_bytes if self.config.legacy_prefetch else 0.0
        available_model = self.ram_budget(obs) - legacy
        alg = self.config.algorithm
        buf = self._prefetch_model
        if alg == "stage_based":
            found = stage_based(
                model, self._ema, self._lo, self._hi, available_model, self._target_time()
            )
            if found is None:
                log.debug("autotune: stage_based round abandoned at the RAM budget")
                return
            values, mem = found
        else:
            values, buf, mem = hill_climb(
                model,
                self._lo,
                self._hi,
                available_model,
                cpu_budget=obs.cpus if alg == "hill_climb" else None,
                prefetch_buffer=self._prefetch.limit,
                tune_prefetch=not self.config.legacy_prefetch,
            )
        self.rounds += 1
        if mem > available_model:  # RamBudgetManager::RequestModelAllocation refused
            log.debug("autotune: result needs %.0f bytes > %.0f, not applied", mem, available_model)
            return
        self._values, self._model_bytes = values, mem
        if not self.config.legacy_prefetch:
            self._prefetch_model = buf

    def _allocation(self, obs: Observation) -> Allocation:
        n = len(self._values)
        model = ChainModel((0.0,) * n, self._ratios(), self._eb)
        buffers = [max(self._eb[i], model.stage_bytes(i, self._values[i])) for i in range(n)]
        last = self._prefetch.limit if self.config.legacy_prefetch else self._prefetch_model
        buffers[-1] += last * self._eb[-1]
        return Allocation(
            tuple(self._values), tuple(math.ceil(b) for b in buffers), fused=self._fused
        )

    def _ratios(self) -> tuple[float, ...]:
        e = self._elements
        return (0.0,) + tuple(
            e[i - 1] / e[i] if e[i] > 0 and e[i - 1] > 0 else 1.0 for i in range(1, len(e))
        )
