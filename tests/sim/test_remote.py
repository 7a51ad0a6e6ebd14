"""Remote workers in the simulator (sim/remote.py): they free the host's cores, and the
network's round trip and bandwidth limit what they deliver."""

from __future__ import annotations

import pytest

from torchtune_pipe.sim.model import SimPipeline, StageModel, Workload
from torchtune_pipe.tuning.base import Allocation, MiB

US = 1e-6
BUF = (16 * MiB,) * 3


def _workload(udf_bytes=300, calls=64, **kw) -> Workload:
    return Workload(
        "remote",
        (
            StageModel("read", "source", 5 * US, bytes_per_item=300),
            StageModel("udf", "map", 200 * US, bytes_per_item=udf_bytes, items_per_call=calls),
            StageModel("out", "map", 2 * US, bytes_per_item=300),
        ),
        **kw,
    )


def _sim(wl=None, cluster=64, cpus=4) -> SimPipeline:
    return SimPipeline(
        wl or _workload(), cpus=cpus, memory_limit_bytes=64 << 30, cluster_cpus=cluster, noise=0
    )


def test_remote_workers_free_local_cores():
    sim = _sim()
    local = sim.evaluate(Allocation((1, 8, 1), BUF))
    # The host's bound: 4 cores over the CPU of every stage.
    assert local <= sim.upper_bound() * 1.001
    remote = sim.evaluate(Allocation((1, 40, 1), BUF, remote=(0, 40, 0)))
    assert remote > 3 * local
    # Past what the host could do with every item's CPU: the UDF's runs on the cluster.
    assert remote > 2 * sim.upper_bound()


def test_remote_workers_hold_no_host_memory_and_report_their_costs():
    sim = _sim()
    sim.apply(Allocation((1, 9, 1), BUF, remote=(0, 8, 0)))
    for _ in range(3):
        obs = sim.observe()
    udf = obs.stages[1]
    assert udf.workers == 9 and udf.remote_workers == 8 and udf.remotable
    assert not obs.stages[0].remotable  # a source keeps its state local
    assert udf.memory_bytes == sim.workload.worker_rss_bytes  # the one local worker's
    assert 0 < udf.remote_items_per_s < udf.items_per_s
    wl = sim.workload
    net = wl.rpc_s / 64 + (300 + 300) / wl.network_bytes_per_s
    assert udf.net_s_per_item == pytest.approx(net)
    assert 0 < udf.hop_cpu_s_per_item < udf.cpu_s_per_item
    assert obs.cluster_cpus == 64 and obs.rpc_s == wl.rpc_s
    assert obs.network_bytes_per_s == wl.network_bytes_per_s
    assert obs.allocation().remote == (0, 8, 0)


def test_round_trip_limits_a_remote_worker():
    # One item per call: each item waits the whole round trip.
    one = _sim(_workload(calls=1)).evaluate(Allocation((1, 1, 1), BUF, remote=(0, 1, 0)))
    wl = _workload()
    # Its function's CPU, the round trip and the call's CPU on the host, per item.
    assert one == pytest.approx(1 / (200 * US + wl.rpc_s + wl.rpc_cpu_s), rel=0.05)
    many = _sim(_workload(calls=64)).evaluate(Allocation((1, 1, 1), BUF, remote=(0, 1, 0)))
    assert many > 4 * one


def test_bandwidth_limits_remote_workers():
    wl = _workload(udf_bytes=1 << 20)
    sim = _sim(wl, cluster=256)
    x = sim.evaluate(Allocation((2, 200, 4), BUF, remote=(0, 200, 0)))
    assert x <= wl.network_bytes_per_s / ((1 << 20) + 300) * 1.001


def test_remote_workers_past_the_cluster_wait():
    sim = _sim(cluster=8)
    eight = sim.evaluate(Allocation((1, 8, 1), BUF, remote=(0, 8, 0)))
    assert sim.evaluate(Allocation((1, 30, 1), BUF, remote=(0, 30, 0))) == eight
    assert _sim(cluster=0).evaluate(Allocation((1, 8, 1), BUF, remote=(0, 8, 0))) < eight


def test_empty_remote_keeps_each_stage_placement():
    sim = _sim()
    sim.apply(Allocation((1, 8, 1), BUF, remote=(0, 8, 0)))
    sim.apply(Allocation((1, 12, 1), BUF))  # all remote stays all remote
    assert sim.allocation.remote == (0, 12, 0)
    sim.apply(Allocation((1, 12, 1), BUF, remote=(0, 4, 0)))
    sim.apply(Allocation((1, 3, 1), BUF))  # a count, at most the workers
    assert sim.allocation.remote == (0, 3, 0)


def test_bad_remote_inputs_raise_naming_them():
    sim = _sim()
    with pytest.raises(ValueError, match="'read' cannot run remote"):
        sim.apply(Allocation((2, 1, 1), BUF, remote=(1, 0, 0)))
    with pytest.raises(ValueError, match="cluster_cpus"):
        SimPipeline(_workload(), cpus=4, memory_limit_bytes=1 << 30, cluster_cpus=-1)
    with pytest.raises(ValueError, match="items_per_call"):
        StageModel("m", "map", 1e-6, items_per_call=0)
    with pytest.raises(ValueError, match="network_bytes_per_s"):
        _workload(network_bytes_per_s=0)
    with pytest.raises(ValueError, match="rpc_s"):
        _workload(rpc_s=-1)
    with pytest.raises(ValueError, match="remote must be >= 0"):
        Allocation((1, 1, 1), BUF, remote=(0, -1, 0))
    with pytest.raises(ValueError, match="remote has 2 stages"):
        Allocation((1, 1, 1), BUF, remote=(0, 1))
