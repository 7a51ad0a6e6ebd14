"""Remote stages (``placement="ray"``) on a real two-node Ray cluster on this machine.

One cluster for the module (two raylets, two CPUs each). Every test that uses it must leave
no actor of ours alive and every CPU free (polled with a deadline: Ray frees resources
asynchronously); the suite's fixture still checks our own processes and segments, and the
module checks that the cluster's processes are gone after it shuts the cluster down.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import time

import psutil
import pytest

from torchtune_pipe import Pipeline, PipelineError, RemoteStageError
from torchtune_pipe.remote import stage as remote_mod
from torchtune_pipe.sources.map_dataset import MapDatasetSource
from torchtune_pipe.tuning.base import Allocation
from torchtune_pipe.tuning.safety import Guarded

from . import _subproc
from .conftest import is_ray_process

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed"
)


class _Ray:
    """Ray, imported at first use, not when the module is collected: a process that has
    imported Ray spawns its workers instead of forking them (servers.fork_unsafe), so every
    loader the session built after it would; tests/conftest.py runs these tests last."""

    def __getattr__(self, name: str):
        if name.startswith("_") or name.startswith("pytest"):
            raise AttributeError(name)  # pytest's questions at collection import nothing
        import ray as module

        return getattr(module, name)


ray = _Ray()

CPUS_PER_NODE = 2
DEADLINE_S = 60.0


def _ours() -> list[str]:
    return [a for a in ray.util.list_named_actors() if a.startswith(remote_mod.ACTOR_PREFIX)]


def _actors(stage: str) -> list[str]:
    return sorted(a for a in _ours() if a.startswith(f"{remote_mod.ACTOR_PREFIX}{stage}:"))


def _poll(what: str, ok, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while True:
        got = ok()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        time.sleep(0.05)  # polling with a deadline: Ray reports actor deaths asynchronously


def _ray_pids() -> set[int]:
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if is_ray_process(p.cmdline(), p.name()) and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.Error:
            continue
    return out


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=CPUS_PER_NODE, object_store_memory=80 << 20)
    c = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    try:
        c.add_node(**node)
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
    _poll("the Ray cluster's processes to end", lambda: not _ray_pids())


@pytest.fixture
def ray_cluster(cluster):
    """The module's cluster; afterwards, none of our actors alive and every CPU free."""
    yield cluster
    _poll("our actors to end", lambda: not _ours())
    total = ray.cluster_resources()["CPU"]
    _poll("every CPU to be free", lambda: ray.available_resources().get("CPU") == total)


def _source(n: int, per_unit: int = 16) -> MapDatasetSource:
    return MapDatasetSource(range(n), entries_per_unit=per_unit)


def spin(x: int) -> int:
    """About a millisecond of CPU on the actor per item."""
    t = time.thread_time_ns() + 1_000_000
    while time.thread_time_ns() < t:
        pass
    return x * 10


def fail_on_37(x: int) -> int:
    if x == 37:
        raise KeyError(f"C{x}")
    return x


def die_on_13(x: int) -> int:
    if x == 13:
        os._exit(1)  # the actor's process dies, every time it gets this item
    return x


# ---------------------------------------------------------------------------- without a cluster
def test_the_builder_checks_a_remote_stage():
    src = Pipeline.from_source(range(4))
    with pytest.raises(PipelineError, match="placement must be one of"):
        src.map(spin, placement="cloud")
    with pytest.raises(PipelineError, match="ray_options needs placement='ray'"):
        src.map(spin, ray_options={"num_cpus": 1})
    with pytest.raises(PipelineError, match="may not set 'name'"):
        src.map(spin, placement="ray", ray_options={"name": "x"})
    with pytest.raises(PipelineError, match="on_error='raise'"):
        src.map(spin, placement="ray", on_error="skip")
    stage = src.map(spin, placement="ray", ray_options={"num_cpus": 0.5}).stages[-1]
    assert (stage.placement, stage.worker_type, stage.ray_options) == (
        "ray", "thread", {"num_cpus": 0.5},
    )  # fmt: skip
    spec = src.map(spin, placement="ray").spec().stages[-1]
    assert (spec.kind, spec.placement, spec.worker_type) == ("batch_map", "ray", "thread")


def test_without_ray_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(remote_mod, "ray_installed", lambda: False)
    monkeypatch.setattr("torchtune_pipe.pipeline.ray_installed", lambda: False)
    with pytest.raises(PipelineError, match=r"pip install torchtune-pipe\[ray\]"):
        Pipeline.from_source(range(4)).map(spin, placement="ray")


def test_nothing_imports_ray_until_a_remote_stage_runs():
    code = (
        "import sys, torchtune_pipe, multiproc\n"
        "from torchtune_pipe import Pipeline\n"
        "Pipeline.from_source(range(4)).map(abs, placement='ray').spec()\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    done = _subproc.run(code)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------- on the cluster
@pytest.mark.slow
def test_exactly_once_over_two_epochs_while_actors_die_and_the_pool_resizes(ray_cluster, caplog):
    n = 384
    pipe = Pipeline.from_source(_source(n)).map(spin, name="feat", workers=2, placement="ray")
    want = collections.Counter(x * 10 for x in range(n))
    with pipe.loader(persistent_workers=True) as loader:  # one pool, two epochs
        killed: list[str] = []
        for epoch in range(2):
            got: collections.Counter = collections.Counter()
            for i, y in enumerate(loader):
                got[y] += 1
                if i == 60 or (epoch == 1 and i == 250):
                    victim = _poll("an actor of the stage", lambda: _actors("feat"))[0]
                    ray.kill(ray.get_actor(victim), no_restart=True)
                    killed.append(victim)
                if epoch == 0 and i == 150:
                    loader.tunable.executor.resize("feat", 3)
                    _poll("a third actor", lambda: len(_actors("feat")) == 3)  # with its worker
                if epoch == 0 and i == 260:
                    loader.tunable.executor.resize("feat", 1)
            assert got == want, f"epoch {epoch}: not every item exactly once"
        # Retired workers killed their actors; the killed ones were replaced.
        reruns = [r for r in caplog.records if "running it again on a new actor" in r.getMessage()]
        assert 1 <= len(reruns) <= len(killed)  # a kill after the epoch's last call goes unseen
        alive = _poll("one actor for the one worker", lambda: len(_actors("feat")) == 1 and 1)
        assert alive and not set(killed) & set(_actors("feat"))
        snap = loader.tunable.executor.snapshot().stage("feat")
        assert snap.placement == "ray" and snap.workers == 1
        # Each frame counted once, re-run or not (16 items and its unit's end per frame).
        assert snap.items_in == snap.items_out == 2 * (n + n // 16)
        # The actors' CPU is the stage's: about 1 ms per item, where the local threads only
        # wait in ray.get (at least half of it, as other work shares these two cores).
        assert snap.cpu_ns >= 0.5 * 2 * n * 1_000_000


@pytest.mark.slow
def test_a_remote_stage_reports_its_workers_remote_and_keeps_its_placement(ray_cluster):
    pipe = Pipeline.from_source(_source(640)).map(spin, name="feat", placement="ray")
    with pipe.loader() as loader:
        it = iter(loader)
        next(it)  # the executor is up once the first item arrives
        live = Guarded(loader.tunable)
        live.observe()
        for _ in range(63):
            next(it)
        obs = live.observe()
        source, feat = obs.stages
        assert obs.cluster_cpus == 2 * CPUS_PER_NODE  # Ray's count, while a remote stage runs
        assert (feat.workers, feat.remote_workers, feat.remotable) == (1, 1, False)
        assert feat.remote_items_per_s == feat.items_per_s > 0
        # The calls' wait beyond the function's own time on the actor, per item: more than
        # nothing, and less than the one worker's time per item.
        assert 0 < feat.net_s_per_item < 1 / feat.items_per_s
        assert feat.items_per_call > 1  # frames of a unit's items, one call each
        assert source.remote_workers == 0 and not source.remotable
        # The guard keeps the placement it was built with: more workers stay remote...
        live.apply(Allocation((1, 2), obs.buffer_bytes, remote=(0, 0)))
        assert live.applied is not None and live.applied.remote == (0, 2)
        _poll("a second actor", lambda: len(_actors("feat")) == 2)
        # ...and the live pipeline refuses another placement, naming the stage.
        with pytest.raises(ValueError, match="'feat' runs with placement='ray'"):
            loader.tunable.apply(Allocation((1, 2), obs.buffer_bytes, remote=(0, 1)))
        assert sum(1 for _ in it) == 640 - 64


@pytest.mark.slow
def test_resume_mid_epoch_with_a_remote_stage(ray_cluster):
    n = 320
    pipe = Pipeline.from_source(_source(n)).map(spin, name="feat", placement="ray")
    with pipe.loader(ordered=True) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(100)]
        state = loader.state_dict()
    assert first == [x * 10 for x in range(100)]  # ordered through the remote hop
    _poll("the first loader's actors to end", lambda: not _actors("feat"))
    with pipe.loader(ordered=True) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert first + rest == [x * 10 for x in range(n)]


@pytest.mark.slow
def test_a_remote_error_reaches_the_consumer_with_its_type_stage_and_traceback(ray_cluster):
    pipe = Pipeline.from_source(_source(64)).map(fail_on_37, name="parse", placement="ray")
    with pytest.raises(KeyError, match="C37") as info, pipe.loader() as loader:
        list(loader)
    e = info.value
    assert e.stage == "parse" and isinstance(e.worker, int)
    remote_tb = str(e.__cause__)
    assert "ray::_Runner.run()" in remote_tb and "fail_on_37" in remote_tb
    assert 'raise KeyError(f"C{x}")' in remote_tb  # the line on the actor that raised
    assert any("raised on Ray actor ttp:parse:" in note for note in e.__notes__)


@pytest.mark.slow
def test_a_frame_whose_actor_dies_twice_is_an_error_naming_it(ray_cluster):
    pipe = Pipeline.from_source(_source(32)).map(die_on_13, name="crash", placement="ray")
    with pytest.raises(RemoteStageError, match="second Ray actor") as info, pipe.loader() as ld:
        list(ld)
    assert "unit 0 items 0..15" in str(info.value) and info.value.stage == "crash"


@pytest.mark.slow
def test_an_actor_the_cluster_has_no_room_for_is_an_error_not_a_hang(ray_cluster, monkeypatch):
    monkeypatch.setattr(remote_mod, "ACTOR_START_TIMEOUT_S", 2.0)  # thread workers read it here
    pipe = Pipeline.from_source(_source(16)).map(
        spin, name="big", placement="ray", ray_options={"num_cpus": 64}
    )
    with pytest.raises(RemoteStageError, match="did not start actor") as info, pipe.loader() as ld:
        list(ld)
    assert "num_cpus': 64" in str(info.value)


@pytest.mark.slow
def test_tensors_travel_whole_and_writable_and_init_runs_on_the_actor(ray_cluster):
    import torch

    def init(stage: str, index: int) -> None:
        os.environ["TTP_TEST_INIT"] = f"{stage}/{index}"

    def make(i: int) -> dict:
        return {
            "i": i,
            "small": torch.arange(4) + i,
            "big": torch.full((64, 1024), float(i))[:, ::2],
        }

    def bump(x: dict) -> dict:
        x["big"] += 1  # the actor's inputs are its own, writable memory
        where = (os.environ.get("TTP_TEST_INIT", ""), os.getpid())
        return {**x, "sum": float(x["big"].sum()), "where": where}

    pipe = (
        Pipeline.from_source(_source(24, per_unit=8))
        .map(make, worker_type="thread")
        .map(bump, name="bump", placement="ray", init=init)
    )
    with pipe.loader(ordered=True) as loader:
        out = list(loader)
    assert [x["i"] for x in out] == list(range(24))
    for x in out:
        i = x["i"]
        assert x["big"].shape == (64, 512) and bool((x["big"] == i + 1).all())
        assert x["small"].tolist() == [i, i + 1, i + 2, i + 3] and x["sum"] == (i + 1) * 64 * 512
    assert {x["where"][0] for x in out} == {"bump/0"}  # init ran on the actor, not here
    assert os.getpid() not in {x["where"][1] for x in out} and "TTP_TEST_INIT" not in os.environ


@pytest.mark.slow
def test_the_dlrm_feature_stages_on_ray_make_the_local_batches(ray_cluster):
    pytest.importorskip("torchrec")
    from examples.dlrm.pipeline import DLRMPipelineConfig, build_pipeline

    data = os.path.join(os.path.dirname(__file__), "data", "criteo", "sample_train.txt")
    config = dict(batch_size=32, chunk_rows=16, pin_memory=False)

    def batches(placement: str, **options) -> list:
        cfg = DLRMPipelineConfig(**config, placement=placement, ray_max_workers=2)
        pipe = build_pipeline(data, cfg, shuffle=False)
        with pipe.loader(**options) as loader:
            return [(b.dense_features, b.sparse_features.values(), b.labels) for b in loader]

    remote = batches("ray", ordered=True)
    local = batches("local", inline=True)
    assert len(remote) == len(local) == 4
    for r, ll in zip(remote, local, strict=True):
        assert all(a.equal(b) for a, b in zip(r, ll, strict=True))
