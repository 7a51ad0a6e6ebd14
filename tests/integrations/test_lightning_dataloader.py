"""TuningCallback with the drop-in DataLoader, in every mode, with one line (no TorchRec)."""

from __future__ import annotations

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


def test_callback_with_intune_on_a_one_stage_dataloader(tmp_path):
    # num_workers=2 is one stage: no shipped agent for that length, the planner tunes it.
    callback = TuningCallback("intune", interval_s=0.02)
    with DataLoader(Points(), batch_size=8, num_workers=2, timeout=60) as loader:
        model = fit(loader, callback, tmp_path, epochs=1)
    assert model.seen == 96
