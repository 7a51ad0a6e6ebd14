"""The DLRM training script end to end on a tiny generated set, and its pieces."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("torchrec")

from examples.dlrm import train  # noqa: E402
from examples.dlrm.model import DLRMConfig, build_dlrm  # noqa: E402
from examples.dlrm.pipeline import DLRMPipelineConfig, build_pipeline  # noqa: E402
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats  # noqa: E402


def tiny_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--cache-dir", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "logs"),
        "--rows", "3000", "--val-rows", "1000", "--batch-size", "128", "--chunk-rows", "32",
        "--table-cap", "50", "--embedding-dim", "4", "--extra-cost-ns", "1000",
        "--interval-s", "0.05", "--baseline-s", "0.2", "--warmup-s", "0", "--print-every-s", "0.5", "--log-every-n-steps", "2", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_main_trains_evaluates_and_reports(tmp_path, capsys):
    args = train.parse_args(tiny_args(tmp_path, "--tuner", "heuristic", "--max-steps", "12"))
    result = train.train(args)
    out = capsys.readouterr().out
    assert 0 < result.samples <= 12 * 128
    assert 0.0 <= result.auroc <= 1.0
    assert result.stages == ("read", "shuffle", "features", "extra_cost", "batch")
    assert result.allocation is not None and len(result.allocation.workers) == 5
    for line in ("generated 3,000 rows", "allocation @ step", "held-out AUROC",
                 "final allocation", "pipeline throughput"):  # fmt: skip
        assert line in out, f"{line!r} missing from:\n{out}"
    assert list((tmp_path / "logs").rglob("metrics.csv"))
    # A second run reuses the cached files.
    assert train.prepare_data(args) == train.prepare_data(args)
    assert "generated" not in capsys.readouterr().out


def test_real_data_needs_a_held_out_split(tmp_path):
    one = tmp_path / "day_0.txt"
    one.write_text("0\t1\n")
    with pytest.raises(SystemExit, match="--val-data"):
        train.prepare_data(train.parse_args(["--data", str(one)]))
    two = tmp_path / "day_1.txt"
    two.write_text("1\t2\n")
    files, held_out = train.prepare_data(train.parse_args(["--data", str(tmp_path / "day_*")]))
    assert files == [str(one)] and held_out == [str(two)]


def obs(t: float, throughput: float, n: int = 3) -> Observation:
    stages = tuple(StageStats(name=f"s{i}", workers=1) for i in range(n))
    return Observation(stages, throughput, cpus=4, memory_limit_bytes=1 << 30,
                       memory_used_bytes=0, t=t)  # fmt: skip


class Counting:
    name = "counting"

    def __init__(self):
        self.steps = 0

    def reset(self, o: Observation) -> Allocation:
        return Allocation((1,) * len(o.stages), (MiB,) * len(o.stages))

    def step(self, o: Observation) -> Allocation:
        self.steps += 1
        return Allocation((2,) * len(o.stages), (MiB,) * len(o.stages))


def test_hold_start_keeps_the_start_and_measures_it_after_warm_up():
    inner = Counting()
    hold = train.HoldStart(inner, hold_s=2.0, warmup_s=1.0)
    start = hold.reset(obs(0.0, 0.0))
    assert hold.step(obs(1.0, 0.0)) == start  # no data yet: the hold has not begun
    assert hold.step(obs(2.0, 5.0)) == start  # data flows from here
    assert hold.step(obs(3.0, 7.0)) == start  # warm-up: not measured
    assert hold.step(obs(4.0, 10.0)) == start
    assert hold.step(obs(5.0, 12.0)) == start
    assert inner.steps == 0 and hold.held == [10.0, 12.0]
    assert hold.step(obs(6.0, 20.0)).workers == (2, 2, 2)
    assert inner.steps == 1


def test_pipeline_and_model_shapes():
    pipe = build_pipeline(
        __file__, DLRMPipelineConfig(noise_std=0.1, extra_cost_ns_per_row=5), shuffle=False
    )
    assert [s.name for s in pipe.stages] == ["read", "features", "augment", "extra_cost", "batch"]
    assert pipe.prefetch_spec is not None
    with pytest.raises(ValueError, match="multiple of chunk_rows"):
        DLRMPipelineConfig(batch_size=100, chunk_rows=64)
    with pytest.raises(ValueError, match="dense_arch must end with embedding_dim"):
        DLRMConfig(embedding_dim=8, dense_arch=(16, 4))
    sizes = DLRMConfig().table_sizes
    model = build_dlrm(DLRMConfig(table_sizes=tuple(min(s, 20) for s in sizes), embedding_dim=4,
                                  dense_arch=(8, 4), over_arch=(8, 1)))  # fmt: skip
    bags = model.sparse_arch.embedding_bag_collection.embedding_bags
    assert len(bags) == 26 and all(b.sparse for b in bags.values())


def test_the_feature_stages_can_run_on_ray_actors():
    from torchtune_pipe.remote.stage import ray_installed

    if not ray_installed():
        pytest.skip("ray is not installed")
    config = DLRMPipelineConfig(extra_cost_ns_per_row=5, placement="ray", ray_max_workers=3)
    pipe = build_pipeline(__file__, config, shuffle=False)
    where = {s.name: (s.placement, s.max_workers) for s in pipe.stages}
    assert where == {"read": ("local", 32), "features": ("ray", 3),
                     "extra_cost": ("ray", 3), "batch": ("local", 32)}  # fmt: skip
    assert train.parse_args(["--ray"]).ray == "ray" and not train.parse_args([]).ray
    assert train.parse_args(["--ray", "auto"]).ray == "auto"
    auto = build_pipeline(__file__, DLRMPipelineConfig(placement="auto"), shuffle=False)
    assert {s.name: s.placement for s in auto.stages}["features"] == "auto"
    with pytest.raises(ValueError, match="placement must be"):
        DLRMPipelineConfig(placement="gpu")


def test_the_allocation_line_shows_remote_workers_concurrency_and_fusion():
    a = Allocation(
        workers=(2, 5, 3, 1),
        buffer_bytes=(8 * MiB, 16 * MiB, 4 * MiB, 2 * MiB),
        concurrency=(1, 16, 1, 1),
        fused=(False, False, False, True),
        remote=(0, 2, 9, 0),
    )
    assert train.describe_allocation(["read", "features", "udf", "collate"], a) == [
        "read=2w/8MiB", "features=3w+2ray(x16)/16MiB", "udf=0w+3ray/4MiB", "collate=fused",
    ]  # fmt: skip
    plain = Allocation(workers=(2,), buffer_bytes=(MiB,))
    assert train.describe_allocation(["read"], plain) == ["read=2w/1MiB"]
