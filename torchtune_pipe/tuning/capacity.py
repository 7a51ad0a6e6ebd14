"""How many items per second workers deliver, and how many workers a rate needs: the one rate
model of the planner (:mod:`~.planner`) and of its split between host and cluster
(:mod:`~.placement`).

A *station* is a stage, or a fused group planned as one stage, with its costs per delivered
item (:class:`Station`): ``u`` worker seconds of a local worker, ``v`` of a remote one. For a
target rate ``T`` it needs ``n = max(ceil(T * u * (1 - NEED_SLACK)), round(headroom * T * u))``
workers (:func:`workers_for`): the headroom (1.2 for the planner's workers) absorbs noise and
heavy-tailed items, its margin rounded to the nearest worker; the need itself is always covered
but for ``NEED_SLACK`` (2%): a CPU-bound stage on 2 cores needs 2 workers, and a third, 1.2 x 2
rounded up or a need measured at 2.03, only time-slices the same cores. :func:`capacity` is
its inverse, the highest rate ``n`` workers cover.

A station's local workers are planned with its own ``headroom``, its remote ones with
:func:`remote_headroom` of it (at most ``REMOTE_HEADROOM``, 1.05: remote CPUs are paid); the two
kinds' capacities add (:func:`station_capacity`), and they split the station's items by how
fast each makes them (:func:`served_share`: a free worker takes the next item). The rate a
pipeline's workers deliver (:func:`rate_of`) is the slowest busy station's capacity, the
host's CPU over what its stations cost it per item, and the consumer's rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# A need at most this share above a whole number of workers is met by that number: the next
# process would buy at most this much (a CPU-bound group on 2 cores measured at 2.03 workers'
# need would start a third process that time-slices the same cores, for its memory).
NEED_SLACK = 0.02
# Remote workers planned per unit of measured need, at most (module docstring).
REMOTE_HEADROOM = 1.05


def workers_for(rate: float, u: float, headroom: float) -> int:
    """Workers a stage of ``u`` worker seconds per item needs for ``rate`` items/s: the need
    ``rate * u`` rounded up (less ``NEED_SLACK`` of it first), and the headroom's margin over
    it rounded to the nearest worker."""
    need = rate * u
    return max(math.ceil(need * (1 - NEED_SLACK) - 1e-9), math.floor(headroom * need + 0.5 - 1e-9))


def capacity(workers: int, u: float, headroom: float) -> float:
    """The highest rate ``workers`` cover in :func:`workers_for` (its inverse)."""
    return min(workers / ((1 - NEED_SLACK) * u), (workers + 0.5) / (headroom * u))


def remote_headroom(headroom: float) -> float:
    """The headroom remote workers are planned with: at most ``REMOTE_HEADROOM``."""
    return min(headroom, max(1.0, REMOTE_HEADROOM))


@dataclass(frozen=True)
class Station:
    """One planned stage or fused group (per delivered item).

    Attributes:
        stage: its host stage's index.
        g: host CPU seconds when made locally.
        u: local worker seconds.
        floor: the least share of a core a local worker is charged.
        lo: the fewest workers it runs; hi: the most.
        idle: it had no work (its workers are kept).
        h: host CPU seconds when made remotely (the hop); v: remote worker seconds; b: bytes
            on the link. ``v`` is 0 for a station that cannot run remote.
        headroom: workers per unit of need its local workers are planned with (its remote
            ones: :func:`remote_headroom` of it).
    """

    stage: int
    g: float
    u: float
    floor: float
    lo: int
    hi: int
    idle: bool
    h: float = 0.0
    v: float = 0.0
    b: float = 0.0
    headroom: float = 1.0


def station_capacity(s: Station, local: int, remote: int) -> float:
    """Delivered items per second ``local`` and ``remote`` workers of ``s`` plan for: each
    kind's :func:`capacity`, added."""
    near = capacity(local, s.u, s.headroom) if s.u > 0 else math.inf
    far = capacity(remote, s.v, remote_headroom(s.headroom)) if remote and s.v > 0 else 0.0
    return near + far


def served_share(s: Station, local: int, remote: int) -> float:
    """The share of ``s``'s items its ``remote`` workers make next to ``local`` ones: the
    kinds split items by their capacities (a free worker takes the next item)."""
    far = remote / s.v if remote and s.v > 0 else 0.0
    near = local / s.u if s.u > 0 else math.inf
    return far / (far + near) if far > 0 else 0.0


def rate_of(
    stations: Sequence[Station],
    local: Sequence[int],
    remote: Sequence[int],
    cpus: float,
    consumer: float = math.inf,
) -> float:
    """The rate the model gives workers as they run: the slowest busy station, the host's
    ``cpus`` (items split between a station's kinds by their capacities) and the consumer."""
    rate, host = consumer, 0.0
    for s, n, m in zip(stations, local, remote, strict=True):
        f = served_share(s, n, m) if n > 0 else (1.0 if m > 0 else 0.0)
        host += (1 - f) * s.g + f * s.h
        if not s.idle:
            rate = min(rate, station_capacity(s, n, m))
    return min(rate, cpus / host) if host > 0 else rate
