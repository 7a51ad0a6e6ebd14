"""The image and Hugging Face examples end to end on a few hundred samples."""

from __future__ import annotations

import sys

import pytest
import torch


def test_images_decode_augment_and_train(capsys):
    pytest.importorskip("PIL")
    from examples.images import train

    assert train.main(["--images", "256", "--epochs", "2", "--batch-size", "32",
                       "--interval-s", "0.1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "epoch 1: 256 images" in out
    for stage in ("read", "decode", "augment", "batch"):
        assert f"'{stage}'" in out
    pipe = train.build_pipeline(train.make_images(8), batch_size=4, seed=0)
    with pipe.loader(inline=True) as loader:
        images, labels = next(iter(loader))  # default_collate: stacked tensors
    assert images.shape == (4, 3, train.CROP, train.CROP) and labels.shape == (4,)


@pytest.mark.parametrize("with_datasets", [True, False])
def test_hugging_face_dataset_through_the_dataloader(with_datasets, monkeypatch, capsys):
    from examples.text import hf_datasets

    if with_datasets:
        pytest.importorskip("datasets")
    else:
        monkeypatch.setitem(sys.modules, "datasets", None)
    ds = hf_datasets.make_dataset(10)
    assert len(ds) == 10 and set(ds[3]) == {"text", "label"}
    assert hf_datasets.main(["--rows", "512", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "epoch 1: 512 reviews" in out
    assert ("from a datasets dataset" in out) == with_datasets
    batch = hf_datasets.tokenize([ds[0], ds[1]])
    assert batch["ids"].shape == (2, hf_datasets.MAX_LEN) and batch["label"].dtype == torch.float
