"""An epoch that ends early (a ``break``, a peek, an exception, Lightning's limits) leaves a
loader that runs the next epochs whole, under every tuner, with no error logged."""

from __future__ import annotations

import logging

import pytest
import torch

from torchtune_pipe import DataLoader
from torchtune_pipe.tuning.registry import TUNERS

N, BATCH = 96, 8
WANT = [list(range(i, i + BATCH)) for i in range(0, N, BATCH)]


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Boom(Exception):
    pass


def _break(loader) -> None:
    for k, _ in enumerate(loader):
        if k == 2:
            break


def _peek(loader) -> None:
    next(iter(loader))


def _raise(loader) -> None:
    with pytest.raises(Boom):
        for k, _ in enumerate(loader):
            if k == 1:
                raise Boom


ENDS = {"break": _break, "peek": _peek, "exception": _raise}


@pytest.mark.parametrize("tuner", TUNERS)
def test_every_tuner_runs_whole_epochs_after_early_ends(tuner, caplog):
    with (
        caplog.at_level(logging.ERROR),
        DataLoader(
            Ids(), batch_size=BATCH, num_workers=2, tuner=tuner, tuning_interval_s=0.02
        ) as loader,
    ):
        for name, end in ENDS.items():
            end(loader)
            if name == "break":
                end(loader)  # twice in a row
            assert [b.tolist() for b in loader] == WANT, name  # then a whole epoch
        assert [b.tolist() for b in loader] == WANT  # and another
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


@pytest.mark.slow
def test_auto_runs_whole_epochs_after_early_ends(caplog):
    with (
        caplog.at_level(logging.ERROR),
        DataLoader(Ids(), batch_size=BATCH, num_workers="auto", tuning_interval_s=0.02) as loader,
    ):
        for end in (_break, _peek, _raise, _peek, _break):
            end(loader)
            assert [b.tolist() for b in loader] == WANT
            assert [b.tolist() for b in loader] == WANT
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


pl = pytest.importorskip("lightning.pytorch")


class _Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen = 0

    def training_step(self, batch, batch_idx):
        self.seen += len(batch)
        return self.layer(batch.float().unsqueeze(1)).mean()

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


LIMITS = {
    "limit_train_batches": dict(limit_train_batches=3, max_epochs=3),
    "limit_val_batches": dict(limit_val_batches=2, max_epochs=3),
    "fast_dev_run": dict(fast_dev_run=2),
    "val_check_interval": dict(val_check_interval=4, limit_val_batches=2, max_epochs=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("limits", list(LIMITS), ids=list(LIMITS))
@pytest.mark.parametrize("tuner", ["intune", "autotune"])
def test_lightning_limits_with_the_callback(limits, tuner, tmp_path, caplog):
    from torchtune_pipe.integrations.lightning import TuningCallback

    model = _Model()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        callbacks=[TuningCallback(tuner, interval_s=0.02)], **LIMITS[limits],
    )  # fmt: skip
    train = DataLoader(Ids(), batch_size=BATCH, num_workers="auto")
    val = DataLoader(Ids(), batch_size=BATCH, num_workers=2, tuner=tuner)
    with caplog.at_level(logging.ERROR), train, val:
        trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
        assert [b.tolist() for b in train] == WANT  # and whole epochs after
        assert [b.tolist() for b in val] == WANT
    assert model.seen > 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def _orders(make, stop_at):
    """Three epochs of a shuffled loader, the first stopped after ``stop_at`` batches without
    asking for its end; each epoch's order."""
    loader, out = make(), []
    for epoch in range(3):
        got = []
        for k, b in enumerate(loader):
            got.append(b.tolist())
            if epoch == 0 and k + 1 == stop_at:
                break
        out.append(got)
    getattr(loader, "close", lambda: None)()
    return out


def _shuffled(cls, workers, where):
    """A shuffled loader whose generator is given to the loader or to its sampler."""
    g = torch.Generator().manual_seed(7)
    if where == "loader":
        return cls(Ids(), batch_size=BATCH, shuffle=True, generator=g, num_workers=workers)
    sampler = torch.utils.data.RandomSampler(Ids(), generator=g)
    return cls(Ids(), batch_size=BATCH, sampler=sampler, num_workers=workers)


@pytest.mark.parametrize("where", ["loader", "sampler"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_at", [3, 11, len(WANT)])
def test_the_order_after_an_epoch_that_stopped_early_is_torchs(workers, stop_at, where):
    """torch's RandomSampler draws from the generator when a pull finds the sampler's end,
    and its iterator pulls ``prefetch_factor * num_workers`` batches ahead: where an epoch
    stops (mid-epoch, or at ``len()`` without asking for the end) decides the next epochs'
    orders, whether the generator was given to the loader or to the sampler. They are
    torch's."""
    want = _orders(lambda: _shuffled(torch.utils.data.DataLoader, workers, where), stop_at)
    got = _orders(lambda: _shuffled(DataLoader, workers, where), stop_at)
    assert got == want


class Counting(torch.utils.data.Sampler):
    """A sampler of the user's that counts the epochs it was iterated for."""

    def __init__(self):
        self.epochs = 0

    def __len__(self):
        return N

    def __iter__(self):
        self.epochs += 1
        return iter(range(N))


def test_a_users_sampler_is_iterated_once_per_epoch_even_when_one_stops_early():
    """The generator is put back by drawing the epoch again only through torch's own
    samplers: a sampler of the user's is iterated once per epoch, as torch does."""
    sampler = Counting()
    loader = DataLoader(Ids(), batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    _break(loader)
    assert [b.tolist() for b in loader] == WANT
    assert sampler.epochs == 2


_EXIT_WHILE_STARTING = """
import sys
import torch
from torch.utils.data import TensorDataset
from torchtune_pipe import DataLoader

loader = DataLoader(TensorDataset(torch.arange(400.0)), batch_size=5, num_workers=2)
for i, _ in enumerate(loader):
    if i == 3:
        break
it = iter(loader)
next(it)  # read inline while the executor is still being built on a thread
print("ready", flush=True)
sys.exit(0)
"""


def test_exiting_while_the_workers_start_is_silent_and_clean():
    """The interpreter's exit closes an executor a fast start is still building: its start
    stops there (no fork server forked again from an exiting process, nothing said), and no
    process or segment is left."""
    from . import _subproc

    code, err, left, segs = _subproc.leftovers(_EXIT_WHILE_STARTING, "ready")
    assert code == 0 and err == "", err
    assert not left and not segs, (left, segs)
