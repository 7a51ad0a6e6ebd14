"""The oversubscription policy that every tuner and the tuning loop apply through :func:`clamp`.

Policy: the CPU budget counts the cores workers use, not the workers. Each worker is charged
the share of a core it measurably uses (CPU time per item x items/s per worker; its busy
fraction when CPU time is not measured), floored by the kind of stage:

* a stage whose workers mostly wait on I/O (``StageStats.io_bound``, or low ``busy`` with low
  time blocked on the pipeline's own channels: the worker waits on something outside the
  pipeline such as a disk or the network) is charged at least ``IO_MIN_CHARGE``;
* a stage whose workers wait on their neighbours most of the time (for input from a slower
  upstream, or for output space a slower downstream holds), or
  that has no work at all in the interval (``StageStats.idle``: a source whose units for the
  epoch are all read while the stages after it work off their backlog), is charged at least
  ``IO_MIN_CHARGE`` too: waiting uses no core;
* any other stage is charged at least ``CPU_MIN_CHARGE`` (a full core before anything was
  measured): at most two CPU-bound workers share a core. Workers past one per core absorb
  the variance of heavy-tailed items (a free worker picks up the next item while another is
  stuck on a long one) and cost little: Linux time-slices them.

Once the pipeline has been measured the charged total may exceed the CPU count by
``SPARE_CORES``: charges are measured at the current allocation, so a worker added to a stage
whose one worker keeps a core busy is charged a full core, although it takes only the share
the pipeline leaves idle, or on a full machine a time-slice from stages that run ahead of
their consumers (a source filling its buffers at an epoch's start) until they block. Without
the spare core a CPU-bound pipeline on a small machine is refused the second worker of its
bottleneck whenever another stage keeps busy (the peers UDF-heavy scenario on 2 cores, where a
static second UDF worker runs 1.1x faster: BENCHMARKS.md). One core's worth is one more worker to try, whatever the machine's size;
the tuners keep it only where it measurably pays.

The total may reach ``MAX_OVERSUBSCRIBE`` times the CPU count; the worker cap is
``cpus * factor`` rounded to the nearest worker (the charges are estimates). The factor is
passed to :func:`clamp` as ``oversubscribe``.
"""

from __future__ import annotations

from .base import Allocation, Limits, Observation, StageStats, clamp, limits_of

# A stage counts as I/O-bound when it computes less than this fraction of the time...
IO_BUSY_MAX = 0.5
# ...and waits on its neighbours' channels less than this fraction.
IO_BLOCKED_MAX = 0.2
# An I/O worker is charged at least this share of a core (a stalled device is not free).
IO_MIN_CHARGE = 0.1
# A worker of any other stage is charged at least this share of a core...
CPU_MIN_CHARGE = 0.5
# ...unless it waits on its neighbours at least this share of the time (then IO_MIN_CHARGE).
WAITING_MIN_BLOCKED = 0.5
# Cores the charged total of a measured pipeline may exceed the CPU count by (docstring)...
SPARE_CORES = 1.0
# ...and the workers in total never more than this many per core.
MAX_OVERSUBSCRIBE = 4.0


def is_io_bound(stage: StageStats) -> bool:
    """True when the stage's workers mostly wait on I/O rather than compute or on channels."""
    if stage.io_bound:
        return True
    if stage.items_per_s <= 0.0:
        return False
    blocked = stage.blocked_in + stage.blocked_out
    return stage.busy < IO_BUSY_MAX and blocked < IO_BLOCKED_MAX


def _core_share(stage: StageStats) -> float:
    """The share of a core one worker of ``stage`` uses."""
    if stage.cpu_s_per_item > 0.0 and stage.items_per_s > 0.0 and stage.workers > 0:
        return stage.cpu_s_per_item * stage.items_per_s / stage.workers
    return stage.busy


def oversubscribe_factor(obs: Observation, alloc: Allocation | None = None) -> float:
    """How far past ``obs.cpus`` the total worker count may go for ``alloc`` (>= 1).

    Each worker frees ``1 - charge`` of a core, where ``charge`` is the core share it uses
    (floored by :func:`charge_floor`); the factor is ``1 + (freed + spare) / cpus``, capped at
    ``MAX_OVERSUBSCRIBE``, where ``spare`` is ``SPARE_CORES`` once any stage has been measured
    and 0 before. A worker sleeping on a remote read inside the stage function counts as busy
    (wall time) but uses almost no CPU: the charge must come from CPU time, not from busy time.

    Args:
        obs: the observation whose stage stats classify the stages.
        alloc: the allocation being checked (defaults to the observed one).
    """
    if obs.cpus <= 0:
        return 1.0
    workers = (alloc or obs.allocation()).workers
    freed = 0.0
    for stage, w in zip(obs.stages, workers, strict=False):
        freed += w * (1.0 - charge(stage))
    measured = any(s.items_per_s > 0.0 or s.idle for s in obs.stages)
    spare = SPARE_CORES if measured else 0.0
    return min(MAX_OVERSUBSCRIBE, 1.0 + (freed + spare) / obs.cpus)


def charge(stage: StageStats) -> float:
    """The share of a core one worker of ``stage`` is charged (module docstring)."""
    if stage.idle:
        return IO_MIN_CHARGE  # no work this interval: waiting uses no core
    if stage.items_per_s <= 0.0 and not stage.io_bound:
        return 1.0  # nothing measured yet: a full core
    return max(charge_floor(stage), min(1.0, _core_share(stage)))


def charge_floor(stage: StageStats) -> float:
    """The least share of a core a measured worker of ``stage`` is charged."""
    if stage.idle or is_io_bound(stage) or is_waiting(stage):
        return IO_MIN_CHARGE
    return CPU_MIN_CHARGE


def is_waiting(stage: StageStats) -> bool:
    """True when the stage's workers mostly wait on their neighbours (input, or output space):
    they use no core meanwhile."""
    blocked = stage.blocked_in + stage.blocked_out
    return stage.items_per_s > 0.0 and blocked >= WAITING_MIN_BLOCKED


def safe(alloc: Allocation, obs: Observation, limits: Limits | None = None) -> Allocation:
    """Clamp ``alloc`` to the hard limits of ``obs`` (or ``limits``) with the I/O policy above.

    Raises:
        ValueError: when ``alloc`` does not have one entry per observed stage.
    """
    if len(alloc.workers) != len(obs.stages):
        raise ValueError(
            f"allocation has {len(alloc.workers)} stages but the pipeline has "
            f"{len(obs.stages)} ({', '.join(s.name for s in obs.stages)})"
        )
    return clamp(alloc, limits or limits_of(obs), oversubscribe_factor(obs, alloc))
