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

Memory (:func:`fit_memory`): an allocation's worst case is every buffer full and every worker
holding what its stage's workers hold now, measured (``StageStats.memory_bytes``), plus the
memory no worker holds (:func:`~.base.memory_parts`). It must stay within
``MEMORY_SAFE_SHARE`` of the limit: growth (buffers, then workers) that would pass it is
refused, and when the pipeline nears the limit anyway (a UDF cache that grows, bigger items)
it sheds buffers first, then workers, before the kernel acts. The live pipeline applies it to
every tuner's decision; the simulator leaves it to the tuners, so that its studies measure
what a tuner does alone (AUTOTUNE's prefetch growing into an OOM).
"""

from __future__ import annotations

from .base import Allocation, Limits, MiB, Observation, StageStats, clamp, limits_of, memory_parts

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
# Worst-case memory an allocation may reach, as a share of the limit (headroom for noise and
# for memory that grows between two tuning steps).
MEMORY_SAFE_SHARE = 0.95
# Buffers shed down to this before any worker goes (small buffers make neighbouring stages
# wait on each other); past the workers' minimum they go down to the stage minimum.
SHED_BUFFER_FLOOR_BYTES = 4 * MiB


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


def _check_stages(alloc: Allocation, obs: Observation, where: str) -> None:
    if len(alloc.workers) != len(obs.stages):
        raise ValueError(
            f"{where}allocation has {len(alloc.workers)} stages but the pipeline has "
            f"{len(obs.stages)} ({', '.join(s.name for s in obs.stages)})"
        )


def safe(alloc: Allocation, obs: Observation, limits: Limits | None = None) -> Allocation:
    """Clamp ``alloc`` to the hard limits of ``obs`` (or ``limits``) with the I/O policy above.

    Raises:
        ValueError: when ``alloc`` does not have one entry per observed stage.
    """
    _check_stages(alloc, obs, "")
    return clamp(alloc, limits or limits_of(obs), oversubscribe_factor(obs, alloc))


def fit_memory(
    alloc: Allocation,
    obs: Observation,
    share: float = MEMORY_SAFE_SHARE,
    min_buffer_bytes: int = 64 * 1024,
) -> Allocation:
    """Keep ``alloc``'s worst-case memory within ``share`` of ``obs``'s limit (module docstring).

    In order, until the worst case fits: refuse buffer growth past what runs now, then worker
    growth; halve the largest buffer down to ``SHED_BUFFER_FLOOR_BYTES``; remove a worker from
    the stage whose workers hold the most (never below its ``min_workers``); halve buffers down
    to ``min_buffer_bytes``. An allocation that fits is returned unchanged.

    Raises:
        ValueError: when ``alloc`` does not have one entry per observed stage.
    """
    _check_stages(alloc, obs, "fit_memory(): ")
    parts = memory_parts(obs)
    limit = share * obs.memory_limit_bytes
    if limit <= 0 or parts.worst_case_bytes(alloc) <= limit:
        return alloc
    now = obs.allocation()
    workers, buffers = list(alloc.workers), list(alloc.buffer_bytes)

    def over() -> bool:
        return parts.worst_case_bytes(Allocation(tuple(workers), tuple(buffers))) > limit

    buffers = [min(b, c) for b, c in zip(buffers, now.buffer_bytes, strict=True)]
    if over():
        workers = [min(w, c) for w, c in zip(workers, now.workers, strict=True)]
    floors = [max(1, s.min_workers) for s in obs.stages]
    for floor in (SHED_BUFFER_FLOOR_BYTES, None):
        while over():
            i = max(range(len(buffers)), key=buffers.__getitem__)
            if floor is not None and buffers[i] > max(floor, min_buffer_bytes):
                buffers[i] = max(floor, min_buffer_bytes, buffers[i] // 2)
                continue
            if floor is None and buffers[i] > min_buffer_bytes:
                buffers[i] = max(min_buffer_bytes, buffers[i] // 2)
                continue
            break
        if floor is None:
            break
        while over():
            costly = [j for j in range(len(workers)) if workers[j] > floors[j]]
            if not costly:
                break
            j = max(costly, key=lambda k: (parts.per_worker_bytes[k], workers[k]))
            workers[j] -= 1
    return Allocation(tuple(workers), tuple(buffers))
