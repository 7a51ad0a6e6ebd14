"""Differential suite: datasets that return *views* give torch's batches, batch by batch.

The most common ``__getitem__`` is ``return self.x[i], self.y[i]``: views into a table at a
nonzero storage offset. Every way of running the drop-in ``DataLoader`` (in the calling
process, integer workers, ``"auto"`` under every tuner) must deliver exactly what torch's
``DataLoader`` delivers for the same generator.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from torchtune_pipe import DataLoader
from torchtune_pipe.tuning import TUNERS

from ._compare import assert_same

N = 103


class Rows(Dataset):
    """``return self.x[i], self.y[i]``: the pattern of most map-style datasets."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 6, generator=g)
        self.y = torch.arange(1000, 1000 + N)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class DictOfViews(Rows):
    """Views with steps, transposes and expands, in a dict."""

    def __init__(self):
        super().__init__()
        self.img = torch.arange(N * 3 * 4 * 5, dtype=torch.uint8).reshape(N, 3, 4, 5)
        self.flags = torch.arange(N * 4) % 3 == 0

    def __getitem__(self, i):
        return {
            "x": self.x[i, 1::2],
            "img": self.img[i].transpose(1, 2),
            "bias": self.y[i].expand(3),
            "flags": self.flags[i * 4 : i * 4 + 4],
            "half": self.x[i, :3].bfloat16(),
        }


class NumpySlices(Dataset):
    """Rows and stepped slices of a numpy table (what a memory-mapped file gives)."""

    def __init__(self):
        self.a = np.arange(N * 8, dtype=np.float32).reshape(N, 8)
        self.b = np.arange(N * 8, dtype=np.int64).reshape(8, N)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.a[i], self.a[i, 1::3], self.b[:, i]


class Strings(Rows):
    def __getitem__(self, i):
        return {"name": f"row-{i}", "x": self.x[i], "label": self.y[i]}


DATASETS = {"rows": Rows, "dict-of-views": DictOfViews, "numpy": NumpySlices, "str": Strings}


def _torch_batches(dataset, seed: int, **kw) -> list:
    g = torch.Generator().manual_seed(seed)
    return list(torch.utils.data.DataLoader(dataset, generator=g, **kw))


def _ours(dataset, seed: int, workers, **kw) -> list:
    g = torch.Generator().manual_seed(seed)
    with DataLoader(dataset, generator=g, num_workers=workers, **kw) as loader:
        return list(loader)


def _assert_batches_equal(expected: list, got: list) -> None:
    assert len(got) == len(expected)
    for k, (a, b) in enumerate(zip(expected, got, strict=True)):
        try:
            assert_same(a, b)
        except AssertionError as e:
            raise AssertionError(f"batch {k} differs from torch's: {a!r}\n!=\n{b!r}") from e


@pytest.mark.parametrize("workers", [0, 2, "auto"])
@pytest.mark.parametrize("name", list(DATASETS))
def test_views_give_torch_batches(name, workers):
    ds = DATASETS[name]()
    kw = dict(batch_size=8, shuffle=True)
    _assert_batches_equal(_torch_batches(ds, 5, **kw), _ours(ds, 5, workers, **kw))


@pytest.mark.parametrize("tuner", TUNERS)
def test_every_tuner_gives_torch_batches(tuner):
    ds = DictOfViews()
    kw = dict(batch_size=4, shuffle=True, drop_last=True)
    expected = _torch_batches(ds, 9, **kw)
    _assert_batches_equal(expected, _ours(ds, 9, "auto", tuner=tuner, **kw))


def test_unbatched_views_give_torch_items():
    """``batch_size=None``: items go through the transport one by one, uncollated."""
    ds = Rows()
    expected = _torch_batches(ds, 3, batch_size=None, shuffle=True)
    _assert_batches_equal(expected, _ours(ds, 3, "auto", batch_size=None, shuffle=True))
    _assert_batches_equal(expected, _ours(ds, 3, 2, batch_size=None, shuffle=True))


@pytest.mark.parametrize("extra", [{"pin_memory": True}, {"timeout": 60}], ids=["pin", "timeout"])
def test_views_through_the_prefetch_stage_give_torch_batches(extra):
    """``pin_memory`` and ``timeout`` add a prefetch stage in the calling process."""
    ds = Rows()
    kw = dict(batch_size=8, shuffle=True, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that there is no accelerator to pin for
        # torch takes a timeout only with worker processes.
        expected = _torch_batches(ds, 4, num_workers=2 if "timeout" in extra else 0, **kw)
    _assert_batches_equal(expected, _ours(ds, 4, "auto", **kw))


@pytest.mark.parametrize("method", ["process", "thread", "auto"])
def test_a_batch_from_workers_never_aliases_the_dataset(method):
    """torch's workers hand over copies: writing into a batch leaves the dataset as it was.
    Ours read the first units in this process while the workers start, and thread workers
    hand their batches over as objects; neither may give a view of the dataset's tensor."""
    x = torch.arange(200.0).view(100, 2)
    want = x.clone()
    ds = torch.utils.data.TensorDataset(x)
    with DataLoader(ds, batch_size=None, num_workers=2, worker_method=method) as dl:
        got = [b for (b,) in dl]
    for b in got:
        b.mul_(-1)  # the training loop's own in-place work
    assert torch.equal(x, want)
    assert torch.equal(torch.stack(got), -want)


def _warned(loader_cls, **kw) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = loader_cls(Rows(), batch_size=8, **kw)
        for _ in range(2):  # at every iter(), as torch's
            next(iter(loader))
        if hasattr(loader, "close"):
            loader.close()
    return [str(w.message) for w in caught if "pin_memory" in str(w.message)]


@pytest.mark.skipif(torch.accelerator.is_available(), reason="warns only without an accelerator")
def test_pin_memory_without_an_accelerator_warns_as_torch_does():
    for kw in ({"pin_memory": True}, {"pin_memory": True, "pin_memory_device": "cuda"}):
        want = _warned(torch.utils.data.DataLoader, **kw)
        assert want and _warned(DataLoader, **kw) == want
    assert _warned(DataLoader, pin_memory=False, pin_memory_device="cuda") == []
