"""TuningCallback with the drop-in DataLoader, in every mode, with one line (no TorchRec)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402

from torchtune_pipe import DataLoader  # noqa: E402
from torchtune_pipe.integrations.lightning import TuningCallback  # noqa: E402


class Points(torch.utils.data.Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.full((4,), float(i)), torch.tensor(float(i % 2))


class Linear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += len(x)
        return (self.layer(x).squeeze(1) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(loader, callback, tmp_path, epochs=2) -> Linear:
    model = Linear()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, callbacks=[callback], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["auto", 2])
def test_callback_takes_over_the_dataloaders_own_tuner(workers, tmp_path, caplog):
    callback = TuningCallback("heuristic", interval_s=0.02)
    with DataLoader(Points(), batch_size=8, num_workers=workers, timeout=60) as loader:
        had_tuner = loader.loader.tuner is not None
        with caplog.at_level(logging.INFO, "torchtune_pipe.integrations.lightning"):
            model = fit(loader, callback, tmp_path)
        assert model.seen == 2 * 96
        assert loader.loader.tuner is None  # handed over: only the callback tunes
        assert callback._train.session.started
    assert had_tuner == (workers == "auto")
    assert ("took over" in caplog.text) == had_tuner


@pytest.mark.slow
def test_callback_with_intune_on_a_one_stage_dataloader(tmp_path):
    # num_workers=2 is one stage: no shipped agent for that length, the planner tunes it.
    callback = TuningCallback("intune", interval_s=0.02)
    with DataLoader(Points(), batch_size=8, num_workers=2, timeout=60) as loader:
        model = fit(loader, callback, tmp_path, epochs=1)
    assert model.seen == 96


class Epochs(torch.utils.data.Dataset):
    """Rows that say which epoch the dataset was set to when they were read."""

    def __init__(self):
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([float(i), float(self.epoch)])


class EpochModel(pl.LightningModule):
    """Sets its dataset's epoch at each epoch's start, as a curriculum does."""

    def __init__(self, dataset: Epochs):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.dataset = dataset
        self.seen: dict[int, set[float]] = {}

    def on_train_epoch_start(self):
        self.dataset.set_epoch(self.current_epoch)

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, set()).update(batch[:, 1].tolist())
        return self.layer(batch[:, :1]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _epochs_seen(make_loader, callbacks, tmp_path) -> dict:
    ds = Epochs()
    model = EpochModel(ds)
    loader = make_loader(ds)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    try:
        trainer.fit(model, train_dataloaders=loader)
    finally:
        getattr(loader, "close", lambda: None)()
    return model.seen


@pytest.mark.parametrize("workers", ["auto", 2])
def test_a_set_epoch_in_the_epoch_hook_is_seen_where_torchs_workers_see_it(workers, tmp_path):
    """Lightning calls iter() on the loader before epoch 0's on_train_epoch_start, and after
    it from epoch 1 on: torch's workers see epoch 0 read as the dataset was built, and each
    later epoch as its hook set it. So do ours, and so do the batches this process reads
    while they start (they read the dataset as it was at that iter(), as a worker does)."""
    want = _epochs_seen(
        lambda ds: torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2), [], tmp_path
    )
    callback = TuningCallback("heuristic", interval_s=0.02)
    got = _epochs_seen(
        lambda ds: DataLoader(ds, batch_size=8, num_workers=workers), [callback], tmp_path
    )
    assert got == want


class RankRows(Linear):
    """Writes the rows each rank trained on, per epoch (ranks are spawned processes)."""

    def __init__(self, out: str):
        super().__init__()
        self.out, self.rows = out, []

    def training_step(self, batch, batch_idx):
        self.rows.append(batch[0][:, 0].long().tolist())
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self):
        name = f"{self.out}/rank{self.global_rank}_epoch{self.current_epoch}.json"
        with open(name, "w") as f:
            json.dump(self.rows, f)
        self.rows = []


@pytest.mark.slow
@pytest.mark.timeout(300)  # two spawned ranks import torch and Lightning
def test_under_ddp_each_rank_reads_the_share_lightning_gives_torchs(tmp_path):
    """Lightning gives torch's DataLoader a DistributedSampler under DDP (it rebuilds torch's
    class only): the drop-in gives itself the same one, so each rank trains on the batches it
    would with torch's, disjoint halves reshuffled each epoch."""
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(RankRows(str(tmp_path)), train_dataloaders=DataLoader(
        Points(), batch_size=8, shuffle=True, num_workers=2,  # distributed: default
    ))  # fmt: skip
    for epoch in range(2):
        for rank in range(2):
            share = torch.utils.data.DistributedSampler(Points(), 2, rank, shuffle=True, seed=0)
            share.set_epoch(epoch)
            want = [b[0][:, 0].long().tolist() for b in torch.utils.data.DataLoader(
                Points(), batch_size=8, sampler=share,
            )]  # fmt: skip
            got = json.loads((tmp_path / f"rank{rank}_epoch{epoch}.json").read_text())
            assert got == want, (rank, epoch)
