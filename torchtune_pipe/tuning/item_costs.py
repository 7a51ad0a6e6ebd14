"""Costs per delivered item, measured in one interval: what the planner (:mod:`~.planner`)
reads from an observation.

From one interval with ``X`` items/s delivered, per stage ``i``:

* ``r_i``: items of stage ``i`` per delivered item, from the in/out ratios of the stages after
  it (a batch of 4 after ``i``: 4); not ``items_per_s_i / X``, which is inflated while stage
  ``i`` runs ahead of the others filling a buffer (the measured ratio stands in where the
  in/out counts are missing);
* ``g_i = cpu_s_per_item_i * r_i``: CPU seconds per delivered item;
* ``a_i = workers_i * busy_i / items_per_s_i * r_i``: worker (wall) seconds per delivered item;
* ``q_i = workers_i * runqueue_i / items_per_s_i * r_i``: seconds per delivered item its
  workers were runnable but waiting for a CPU; a contended machine stretches wall time by
  that much and the plan must not mistake it for work (or for I/O).

A channel between two stages costs a hop per item (:func:`channel_hops`): what the stages'
workers spent encoding and decoding frames (``StageStats.hop_s_per_item``), never below the
prior ``HOP_S_PER_ITEM``; a channel inside a fused group, which nothing measures, at what it cost
when last crossed (:func:`crossed_hops`, which InTune remembers).
"""

from __future__ import annotations

from collections.abc import Sequence

from torchtune_pipe.tuning.base import Observation, fusion_host

# CPU seconds an item costs to cross a channel between two stages, the planner's prior where no
# stage measures it (StageStats.hop_s_per_item) and the least it prices a hop at: ~2.5 us per
# row in the UDF-heavy peers scenario.
HOP_S_PER_ITEM = 2.5e-6


def per_delivered(obs: Observation) -> list[float]:
    """Items of each stage per item the last stage delivers (``r_i``, module docstring)."""
    stages = obs.stages
    x = stages[-1].items_per_s
    r = [1.0] * len(stages)
    for i in range(len(stages) - 2, -1, -1):
        nxt = stages[i + 1]
        if nxt.items_in_per_s > 0 and nxt.items_per_s > 0:
            r[i] = r[i + 1] * nxt.items_in_per_s / nxt.items_per_s
        else:
            r[i] = stages[i].items_per_s / x if x > 0 else 0.0
    return r


def cpu_and_idle(obs: Observation, r: list[float]) -> tuple[list[float], list[bool]]:
    """Each stage's CPU seconds per delivered item (``r``: :func:`per_delivered`), and whether
    it had no work this interval (idle and emitting nothing)."""
    g = [max(0.0, s.cpu_s_per_item) * r[i] for i, s in enumerate(obs.stages)]
    return g, [s.idle and s.items_per_s <= 0 for s in obs.stages]


def worker_seconds(obs: Observation, r: list[float]):
    """Worker seconds per delivered item that each stage's workers spent in a given share of
    their wall time (``r``: :func:`per_delivered`). A fused stage's share is of its host's
    workers' wall time."""
    now = tuple(s.fused for s in obs.stages)
    hosts = [obs.workers[fusion_host(now, i)] for i in range(len(obs.stages))]

    def per_item(share: list[float]) -> list[float]:
        return [
            w * share[i] / s.items_per_s * r[i] if s.items_per_s > 0 else 0.0
            for i, (w, s) in enumerate(zip(hosts, obs.stages, strict=True))
        ]

    return per_item


def channel_hops(obs: Observation, r: list[float], known: Sequence[float] = ()) -> list[float]:
    """CPU seconds per delivered item for stage ``i``'s output to cross the channel to stage
    ``i + 1`` (``hop[i]``), from the measured ``StageStats.hop_s_per_item`` of the two stages
    it joins (the producer encodes, the consumer decodes: the mean of the two sides' per-item
    hop time, each side's being about one crossing). A channel that no split stage measures (a
    stage fused now) takes what it measured when it was last crossed (``known``, per item of
    stage ``i``: items inside a group can cost far more to send than the group's output, e.g.
    rows before the collate that a fused group ends with), else the median hop per item of the
    measured stages whose items are its items (rows, not batches), else the prior
    ``HOP_S_PER_ITEM``. No hop is priced below that prior: the measured time is encoding and
    decoding only (a frame's dispatch by the router, the workers' wake-ups and the channel's
    bookkeeping are not in it)."""
    stages = obs.stages
    n = len(stages)
    own = [s.hop_s_per_item if not s.fused and s.hop_s_per_item > 0 else 0.0 for s in stages]
    hop = []
    for i in range(n):
        ends = []
        if own[i] > 0 and (i + 1 == n or not stages[i + 1].fused):  # encodes its own output
            ends.append(own[i] * r[i])
        if i + 1 < n and own[i + 1] > 0:
            ends.append(own[i + 1] * r[i + 1])
        if ends:
            cost = sum(ends) / len(ends)
        elif i < len(known) and known[i] > 0:
            cost = known[i] * r[i]
        else:
            cost = _typical_hop(own, r, i) * r[i]
        # The counters time encoding and decoding only: a frame's dispatch, its wake-ups and
        # its channel's bookkeeping are not in them, so a hop costs at least the prior.
        hop.append(max(cost, HOP_S_PER_ITEM * r[i]))
    return hop


def _typical_hop(own: Sequence[float], r: Sequence[float], i: int) -> float:
    """The median measured hop per item (``own``) of the stages whose items are stage ``i``'s
    (``r`` within a factor of ``2``: rows, not the batches a collate makes of them), else the
    prior. A batch of 4096 rows of 1 KiB costs ~200 us to copy; priced per row, the channels
    between the row stages of an I/O-heavy pipeline cost more than its CPU, and the plan kept
    its lookups fused into the reader, where every worker is charged the feature map's core
    (half the oracle's rate)."""
    measured = sorted(
        h for k, h in enumerate(own) if h > 0 and r[i] > 0 and 0.5 <= r[k] / r[i] <= 2.0
    )
    return measured[len(measured) // 2] if measured else HOP_S_PER_ITEM


def crossed_hops(obs: Observation) -> list[float]:
    """Per channel, its hop per item of the stage before it where ``obs`` measured it (the
    channel crossed and a side measured), else 0: what a tuner remembers for
    :func:`~.planner.plan`'s ``known_hops`` once the channel is inside a fused group."""
    r = per_delivered(obs)
    stages = obs.stages
    n = len(stages)
    out = []
    for i, h in enumerate(channel_hops(obs, r)):
        crossed = i + 1 < n and not stages[i + 1].fused
        sides = stages[i].hop_s_per_item > 0 or (crossed and stages[i + 1].hop_s_per_item > 0)
        out.append(h / r[i] if crossed and sides and r[i] > 0 else 0.0)
    return out
