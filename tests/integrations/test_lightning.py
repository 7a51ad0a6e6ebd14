"""TuningCallback in real Lightning fits of the DLRM example on generated Criteo rows.

Rows are tagged: their first count (I1) holds the row's index, so ``expm1`` of the first
dense feature tells which row a sample is, and the tests check that every row is seen
exactly once per epoch, across a checkpoint resume, and across DDP ranks.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("torchrec")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from examples.dlrm import generate as gen  # noqa: E402
from examples.dlrm.criteo import default_table_sizes  # noqa: E402
from examples.dlrm.model import DLRMConfig, DLRMModule  # noqa: E402
from examples.dlrm.pipeline import DLRMPipelineConfig, build_loader  # noqa: E402
from torchtune_pipe import Pipeline  # noqa: E402
from torchtune_pipe.integrations._steering import Session  # noqa: E402
from torchtune_pipe.integrations.lightning import TuningCallback, pipeline_metrics  # noqa: E402
from torchtune_pipe.tuning.base import Allocation, MiB, Observation, StageStats  # noqa: E402
from torchtune_pipe.tuning.loop import read_log  # noqa: E402

ROWS = 3000
TABLES = default_table_sizes(50)
PIPE = DLRMPipelineConfig(
    batch_size=128, chunk_rows=32, chunk_bytes=64 * 1024, shuffle_chunks=8,
    table_sizes=TABLES, buffer_bytes=4 * MiB, pin_memory=False,
)  # fmt: skip
MODEL = DLRMConfig(table_sizes=TABLES, embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1))


def write_tagged(path: Path, rows: int, first_id: int, seed: int, gzip_out: bool = False) -> None:
    """Generated Criteo rows with I1 replaced by the row's id."""
    raw = path.with_suffix(".raw")
    gen.generate(raw, rows, seed=seed)
    lines = raw.read_bytes().splitlines()
    raw.unlink()
    out = []
    for i, line in enumerate(lines):
        fields = line.split(b"\t")
        if len(fields) < 2:
            fields.append(b"")
        fields[1] = str(first_id + i).encode()
        out.append(b"\t".join(fields))
    data = b"\n".join(out) + b"\n"
    if gzip_out:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def row_ids(batch) -> list[int]:
    return np.rint(np.expm1(batch.dense_features[:, 0].double().numpy())).astype(int).tolist()


class Recording(DLRMModule):
    """Records the row ids it trains on, per epoch; under DDP writes them to ``out_dir``."""

    def __init__(self, out_dir: str | None = None):
        super().__init__(MODEL)
        self.seen: dict[int, list[int]] = {}
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(row_ids(batch))
        return super().training_step(batch, batch_idx)

    def on_train_end(self):
        if self.out_dir is not None:
            path = Path(self.out_dir) / f"rank{self.global_rank}.json"
            dm = self.trainer.datamodule
            dropped = dm.loader.last_epoch_dropped if dm is not None else 0
            report = {"seen": self.seen, "world": self.trainer.world_size, "dropped": dropped,
                      "steps": self.trainer.global_step}  # fmt: skip
            path.write_text(json.dumps(report))


class StepTuner:
    """A tuner with state: each step grows one stage's buffer by 1 MiB, in turn."""

    name = "step-test"

    def __init__(self):
        self.steps = 0
        self.alloc: Allocation | None = None

    def reset(self, obs: Observation, start: Allocation | None = None) -> Allocation:
        self.alloc = start or Allocation((1,) * len(obs.stages), (2 * MiB,) * len(obs.stages))
        return self.alloc

    def step(self, obs: Observation) -> Allocation:
        self.steps += 1
        buffers = list(self.alloc.buffer_bytes)
        buffers[self.steps % len(buffers)] += MiB
        self.alloc = Allocation(self.alloc.workers, tuple(buffers))
        return self.alloc

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def trainer(tmp_path: Path, callbacks: list, **kw) -> pl.Trainer:
    kw.setdefault("logger", False)
    kw.setdefault("limit_val_batches", 0)
    return pl.Trainer(
        accelerator="cpu", devices=1, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("criteo") / "train.txt"
    write_tagged(path, ROWS, 0, seed=3)
    return path


def test_fit_sees_every_row_once_per_epoch_and_logs_the_pipeline(data, tmp_path):
    cb = TuningCallback("heuristic", interval_s=0.05, log_every_n_steps=1)
    logger = CSVLogger(tmp_path, name="csv")
    module = Recording()
    with build_loader(data, PIPE, timeout_s=60) as loader:
        trainer(tmp_path, [cb], max_epochs=2, logger=logger, enable_checkpointing=False).fit(
            module, train_dataloaders=loader
        )
    for epoch in (0, 1):
        assert sorted(module.seen[epoch]) == list(range(ROWS)), f"epoch {epoch}"
    assert module.seen[0] != module.seen[1]  # shuffled differently each epoch
    assert cb.changes and cb.changes[0].stages == ("read", "shuffle", "features", "batch")
    assert cb.allocation is not None and len(cb.allocation.workers) == 4
    assert cb.model_step_s > 0
    # The tuner saw the model's step time as the consumer latency.
    assert any(obs.consumer_step_s > 0 for obs in cb.history)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("pipeline/throughput")]
    assert logged, f"no pipeline metrics in {list(rows[0]) if rows else 'an empty file'}"
    assert {"pipeline/workers/read", "pipeline/memory_used_mib"} <= set(logged[0])
    assert all(float(r["pipeline/workers/features"]) >= 1 for r in logged)
    # Whether training waits on data: the share of the loop's time inside next().
    shares = [float(r["pipeline/data_wait_share"]) for r in logged
              if r.get("pipeline/data_wait_share")]  # fmt: skip
    assert shares and all(0.0 <= x <= 1.0 for x in shares)


def test_resume_restores_allocation_and_continues_mid_epoch(data, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    tuner_a = StepTuner()
    cb_a = TuningCallback(tuner_a, interval_s=0.02)
    first = Recording()
    steps = 7
    save = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=steps, save_top_k=-1)
    with build_loader(data, PIPE, timeout_s=60) as loader:
        trainer(tmp_path, [cb_a, save], max_steps=steps).fit(first, train_dataloaders=loader)
    (ckpt,) = list(ckpt_dir.glob("*.ckpt"))
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["TuningCallback"]
    assert saved["tuner"]["steps"] > 0
    assert len(saved["allocation"]["workers"]) == 4

    tuner_b = StepTuner()
    log_b = tmp_path / "decisions.jsonl"
    cb_b = TuningCallback(tuner_b, interval_s=0.02, log_path=str(log_b))
    second = Recording()
    with build_loader(data, PIPE, timeout_s=60) as loader:
        trainer(tmp_path, [cb_b], max_epochs=1).fit(
            second, train_dataloaders=loader, ckpt_path=str(ckpt)
        )
    a, b = first.seen[0], second.seen[0]
    assert len(a) > 0 and len(b) > 0
    assert not set(a) & set(b), "the resumed epoch repeated samples"
    assert sorted(a + b) == list(range(ROWS)), "the resumed epoch skipped samples"
    # The restored allocation is the first one applied; the tuner's state came back too.
    first_decision = json.loads(log_b.read_text().splitlines()[0])["allocation"]
    assert first_decision == saved["allocation"]
    assert tuner_b.steps >= saved["tuner"]["steps"]


class Vectors(torch.utils.data.IterableDataset):
    """64 small vectors; without a length, so Lightning reads each epoch to its end."""

    def __iter__(self):
        return (torch.full((4,), float(i)) for i in range(64))


class Linear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch).pow(2).mean(), batch_size=len(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def small_loader(**kw):
    pipe = Pipeline.from_source(Vectors()).batch(8, collate=torch.stack)
    return pipe.loader(timeout_s=60, **kw)


class Failing(StepTuner):
    """Breaks at its first decision: an epoch of the small loader lasts a few milliseconds,
    so a tuner that broke only at a later step might never get one in before an epoch ends."""

    def reset(self, obs, start=None):
        raise RuntimeError("tuner broke")

    def step(self, obs):
        raise RuntimeError("tuner broke")


def test_a_tuner_error_stops_the_fit(tmp_path):
    cb = TuningCallback(Failing(), interval_s=0.01)
    with small_loader() as loader:
        with pytest.raises(RuntimeError, match="tuner broke"):
            trainer(tmp_path, [cb], max_epochs=1000).fit(Linear(), train_dataloaders=loader)
    assert cb._train.loop is None  # stopped on the exception path


def test_tune_val_tunes_the_validation_loader_with_its_own_tuner(tmp_path):
    cb = TuningCallback("heuristic", interval_s=0.01, tune_val=True)
    with small_loader() as train_loader, small_loader() as val_loader:
        t = trainer(tmp_path, [cb], max_epochs=2, limit_val_batches=1.0, num_sanity_val_steps=0)
        t.fit(Linear(), train_dataloaders=train_loader, val_dataloaders=val_loader)
    assert cb._val.session.started and cb._val.session.tuner is not cb.tuner
    # Each steered its own loader's pipeline; both stopped with their last epochs.
    assert cb._val.inner is not None and cb._train.inner is not None
    assert cb._val.inner is not cb._train.inner
    assert val_loader.tunable is None and train_loader.tunable is None
    assert cb._val.loop is None and cb._train.loop is None  # both stopped


def test_session_resumes_from_a_restored_allocation_and_continues_after_a_pause():
    class WithStart(StepTuner):
        def reset(self, obs, start=None):
            super().reset(obs)
            self.alloc = start or self.alloc
            return self.alloc

    o = Observation(tuple(StageStats(name=f"s{i}", workers=1) for i in range(2)), 1.0, cpus=2,
                    memory_limit_bytes=1 << 30, memory_used_bytes=0)  # fmt: skip
    saved = Allocation((2, 1), (3 * MiB, MiB))
    for tuner in (StepTuner(), WithStart()):
        session = Session(tuner)
        session.restored = saved
        assert session.reset(o) == saved  # the restored allocation runs first
        stepped = session.step(o)
        assert session.reset(o) == stepped  # a restarted loop re-applies the last decision
        assert tuner.steps == 1


def test_pipeline_metrics_names_every_stage():
    stages = tuple(
        StageStats(name=n, workers=w, busy=0.5, buffer_bytes=2 * MiB)
        for n, w in (("read", 2), ("batch", 1))
    )
    obs = Observation(stages, throughput=10.0, cpus=2, memory_limit_bytes=8 * MiB,
                      memory_used_bytes=MiB)  # fmt: skip
    m = pipeline_metrics(obs, ("read", "batch"), model_step_s=0.004)
    assert m["pipeline/workers/read"] == 2 and m["pipeline/buffer_mib/batch"] == 2
    assert m["pipeline/memory_used_mib"] == 1 and m["pipeline/model_step_ms"] == pytest.approx(4)
    assert "pipeline/data_wait_share" not in m  # not measured: not logged as 0
    fused = dataclasses.replace(stages[1], fused=True)
    m = pipeline_metrics(dataclasses.replace(obs, stages=(stages[0], fused), data_wait_share=0.6))
    assert m["pipeline/data_wait_share"] == 0.6 and m["pipeline/workers/batch"] == 0


class ShardedData(pl.LightningDataModule):
    """Builds this rank's loader once the process group exists."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern
        self.loader = None

    def train_dataloader(self):
        t = self.trainer
        self.loader = build_loader(
            self.pattern, PIPE, rank=t.global_rank, world_size=t.world_size, timeout_s=60
        )
        return self.loader

    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()


@pytest.mark.timeout(300)  # two spawned ranks import torch, Lightning and TorchRec
def test_ddp_ranks_see_disjoint_rows_and_stop_together(tmp_path):
    rows = [1000, 1300]  # uneven shards: rank 1 has 3+ more batches than rank 0
    for r in range(2):  # one .gz file is one unit: each rank reads one file
        write_tagged(tmp_path / f"part_{r}.gz", rows[r], r * rows[0], seed=10 + r, gzip_out=True)
    out = tmp_path / "out"
    out.mkdir()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    log = tmp_path / "tuning.jsonl"  # both ranks write to it, each record naming its rank
    cb = TuningCallback("heuristic", interval_s=0.1, log_path=str(log))
    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[cb], max_epochs=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    t.fit(Recording(str(out)), datamodule=ShardedData(os.path.join(tmp_path, "part_*.gz")))
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(s["world"] == 2 for s in seen)
    # Units are shuffled before sharding: the rank holding part_0 (1000 rows) is the short one.
    short, long_ = sorted(seen, key=lambda s: min(s["seen"]["0"]))
    a, b = short["seen"]["0"], long_["seen"]["0"]
    assert sorted(a) == list(range(rows[0]))  # the short rank delivers every row
    assert len(set(b)) == len(b) and set(b) <= set(range(rows[0], sum(rows)))
    # The long rank stopped with the short one (same number of steps) and counted the batches
    # it dropped.
    assert short["steps"] == long_["steps"]
    assert short["dropped"] == 0 and long_["dropped"] >= 3
    assert 0 < rows[1] - len(b) <= 128 * long_["dropped"]
    assert {r["rank"] for r in read_log(log)} == {0, 1}
    assert all(r["unit"] == "batches" for r in read_log(log))
