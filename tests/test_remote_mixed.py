"""Map stages split between host and cluster (``placement="auto"``) on a real two-node Ray
cluster on this machine (tests/test_remote.py's fixtures: every test leaves no actor of ours
alive and every CPU free; the suite's fixture checks our processes and segments)."""

from __future__ import annotations

import collections
import importlib.util

import pytest

from torchtune_pipe import Pipeline
from torchtune_pipe.tuning import run_episode
from torchtune_pipe.tuning.base import Allocation
from torchtune_pipe.tuning.intune.agent import InTuneTuner
from torchtune_pipe.tuning.safety import Guarded

from . import _subproc
from .test_remote import _actors, _poll, _source, cluster, ray, ray_cluster, spin  # noqa: F401
from .tuning.test_seam import _check

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed"
)


def test_without_a_connected_cluster_auto_runs_local_and_imports_no_ray():
    code = (
        "import sys\n"
        "from torchtune_pipe import Pipeline\n"
        "pipe = Pipeline.from_source(range(40)).map(abs, workers=2, placement='auto')\n"
        "assert pipe.spec().stages[-1].offload is None\n"
        "with pipe.loader() as loader:\n"
        "    assert sorted(loader) == list(range(40))\n"
        "    obs = loader.observe()  # the epoch's last, as its workers stopped\n"
        "    assert not obs.stages[-1].remotable and obs.stages[-1].remote_workers == 0\n"
        "    assert obs.cluster_cpus == 0 and obs.rpc_s == 0\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    done = _subproc.run(code)
    assert done.returncode == 0, done.stderr[-2000:]


def _remote_items(loader) -> int:
    return loader.tunable.executor.snapshot().stage("feat").remote_items_out


def _remote_calls(loader) -> int:
    return loader.tunable.executor.snapshot().stage("feat").calls.n


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_an_auto_stage_moves_workers_to_the_cluster_and_back_mid_epoch():
    n = 1280
    pipe = Pipeline.from_source(_source(n)).map(spin, name="feat", placement="auto")
    want = collections.Counter(x * 10 for x in range(n))
    got: collections.Counter = collections.Counter()
    # Workers kept after the epoch: the live pipeline is observed once its items are all out.
    with pipe.loader(persistent_workers=True) as loader:
        it = iter(loader)
        got[next(it)] += 1  # the executor is up once the first item arrives
        live = Guarded(loader.tunable)
        obs = live.observe()
        feat = obs.stages[1]
        assert (feat.remotable, feat.remote_workers) == (True, 0)
        assert not obs.stages[0].remotable and obs.cluster_cpus == 4
        # Two of three workers onto the cluster, through the guard and the live pipeline.
        live.apply(Allocation((1, 3), obs.buffer_bytes, remote=(0, 2)))
        assert live.applied is not None and live.applied.remote == (0, 2)
        assert loader.tunable.allocation().remote in ((), (0, 2))  # the router applies it
        _poll("two actors", lambda: len(_actors("feat")) == 2)
        # The pipeline runs ahead of its consumer into its buffers: remote items come.
        _poll("items made on the cluster", lambda: _remote_items(loader) > 0)
        # A worker counts a frame's items as it sends the frame and the frame's remote call as
        # it books the frame's time, just after: the interval holds a call once one is booked.
        _poll("a remote call booked", lambda: _remote_calls(loader) > 0)
        for _ in range(100):
            got[next(it)] += 1
        obs = live.observe()
        feat = obs.stages[1]
        assert (feat.workers, feat.remote_workers, feat.remotable) == (3, 2, True)
        assert loader.tunable.allocation().remote == (0, 2)
        assert 0 < feat.remote_items_per_s <= feat.items_per_s
        assert 0 < feat.net_s_per_item < 2 / feat.remote_items_per_s  # two remote workers
        assert obs.rpc_s > 0 and obs.network_bytes_per_s >= 0  # fitted to the remote calls
        _check(obs, "live", flowing=False)
        # Back onto the host: the actors end with their workers, nothing is lost.
        live.apply(Allocation((1, 2), obs.buffer_bytes, remote=(0, 0)))
        _poll("the remote workers to retire", lambda: not _actors("feat"))
        snap = loader.tunable.executor.snapshot().stage("feat")
        assert (snap.workers, snap.remote_workers) == (2, 0)
        for y in it:
            got[y] += 1
        obs = live.observe()
        assert obs.stages[1].remote_workers == 0 and obs.stages[1].remote_items_per_s == 0
    assert got == want, "not every item exactly once"


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_the_planner_tunes_an_auto_stage_without_errors():
    n = 2400
    pipe = Pipeline.from_source(_source(n)).map(spin, name="feat", max_workers=4, placement="auto")
    got: collections.Counter = collections.Counter()
    with pipe.loader() as loader:
        it = iter(loader)
        got[next(it)] += 1
        live = loader.tunable
        live.observe()

        def consume(_obs) -> None:
            for _ in range(60):
                got[next(it)] += 1

        trace = run_episode(live, InTuneTuner(plan_only=True), 4, on_step=consume)
        assert len(trace) == 4
        for obs in trace:
            _check(obs, "live", flowing=False)
            assert obs.stages[1].remotable and obs.cluster_cpus == 4
        for y in it:
            got[y] += 1
    assert got == collections.Counter(x * 10 for x in range(n))
