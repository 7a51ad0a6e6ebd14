"""TorchRec's DLRM on Criteo features, trained by a LightningModule.

One embedding table per categorical feature (an ``EmbeddingBagCollection``), Kaggle-like
table sizes capped for CPU memory (:data:`~examples.dlrm.criteo.DEFAULT_TABLE_SIZES`), the
original dot interaction, BCE-with-logits loss and AUROC from torchmetrics. Embeddings take
sparse gradients and all parameters train with Adagrad (as TorchRec's DLRM recipes do for
embeddings), so a step touches only the rows of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from examples.dlrm.criteo import DEFAULT_TABLE_SIZES, NUM_DENSE, NUM_SPARSE, SPARSE_KEYS


@dataclass(frozen=True)
class DLRMConfig:
    """The model's shape and optimiser.

    Attributes:
        table_sizes: rows per embedding table, one table per categorical feature.
        embedding_dim: width of every embedding (TorchRec's DLRM needs one width).
        dense_arch: bottom MLP layer sizes; the last must equal ``embedding_dim``.
        over_arch: top MLP layer sizes; the last must be 1 (the logit).
        lr: Adagrad learning rate.
        sparse_gradients: embeddings take sparse gradients (only the batch's rows update).
    """

    table_sizes: tuple[int, ...] = DEFAULT_TABLE_SIZES
    embedding_dim: int = 16
    dense_arch: tuple[int, ...] = (64, 16)
    over_arch: tuple[int, ...] = (64, 32, 1)
    lr: float = 0.05
    sparse_gradients: bool = True

    def __post_init__(self) -> None:
        if len(self.table_sizes) != NUM_SPARSE:
            raise ValueError(
                f"DLRMConfig: table_sizes needs {NUM_SPARSE} values, got {len(self.table_sizes)}"
            )
        if not self.dense_arch or self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(
                f"DLRMConfig: dense_arch must end with embedding_dim={self.embedding_dim}, got "
                f"{self.dense_arch}"
            )
        if len(self.over_arch) < 2 or self.over_arch[-1] != 1:
            raise ValueError(
                f"DLRMConfig: over_arch needs >= 2 layers ending in 1, got {self.over_arch}"
            )
        if not self.lr > 0:
            raise ValueError(f"DLRMConfig: lr must be positive, got {self.lr}")


def build_dlrm(config: DLRMConfig = DLRMConfig(), device: torch.device | None = None) -> DLRM:
    """TorchRec's ``DLRM`` with one table per categorical feature (``cat_0``..``cat_25``)."""
    tables = [
        EmbeddingBagConfig(
            num_embeddings=int(rows),
            embedding_dim=config.embedding_dim,
            name=f"t_{key}",
            feature_names=[key],
        )
        for rows, key in zip(config.table_sizes, SPARSE_KEYS, strict=True)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=device)
    if config.sparse_gradients:
        for bag in ebc.embedding_bags.values():
            bag.sparse = True  # nn.EmbeddingBag reads the flag on every forward
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=list(config.dense_arch),
        over_arch_layer_sizes=list(config.over_arch),
        dense_device=device,
    )


class DLRMModule(pl.LightningModule):
    """Trains :func:`build_dlrm` on TorchRec ``Batch`` es: BCE with logits, AUROC on eval.

    Logs ``train/loss`` every step, ``val/loss`` and ``val/auroc`` per validation run
    (``test/...`` for test runs).

    Args:
        config: the model's shape and optimiser.
    """

    def __init__(self, config: DLRMConfig = DLRMConfig()):
        super().__init__()
        self.config = config
        self.model = build_dlrm(config)
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.val_auroc = BinaryAUROC()
        self.test_auroc = BinaryAUROC()
        self.samples = 0  # training samples seen by this process

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits, one per row."""
        return self.model(batch.dense_features, batch.sparse_features).squeeze(-1)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        logits = self(batch)
        loss = self.loss_fn(logits, batch.labels)
        n = batch.labels.shape[0]
        self.samples += n
        self.log("train/loss", loss, batch_size=n, prog_bar=True)
        return loss

    def _eval_step(self, batch: Batch, metric: BinaryAUROC, prefix: str) -> None:
        logits = self(batch)
        n = batch.labels.shape[0]
        self.log(f"{prefix}/loss", self.loss_fn(logits, batch.labels), batch_size=n, sync_dist=True)
        metric.update(torch.sigmoid(logits), batch.labels.long())
        self.log(f"{prefix}/auroc", metric, batch_size=n, on_step=False, on_epoch=True)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._eval_step(batch, self.val_auroc, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._eval_step(batch, self.test_auroc, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=self.config.lr)
