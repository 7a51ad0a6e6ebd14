"""Under ``torch.distributed`` with several ranks, the drop-in reads its rank's share, as
Lightning and Accelerate make torch's ``DataLoader`` do (``sources/rank_share.py``). The ranks
are stood in for here (``process_group`` patched); ``tests/integrations/test_lightning.py``
runs two real ones under Lightning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DistributedSampler, Sampler, TensorDataset

from torchtune_pipe import DataLoader
from torchtune_pipe.sources import rank_share

from ._compare import assert_same

DATA = TensorDataset(torch.arange(30))


@pytest.fixture
def as_rank(monkeypatch):
    def be(rank: int | None, world: int = 2) -> None:
        group = None if rank is None else (rank, world)
        monkeypatch.setattr(rank_share, "process_group", lambda: group)

    return be


def _epochs(loader, n=2):
    out = []
    for e in range(n):
        len(loader)  # as Lightning asks, before it sets the epoch
        set_epoch = getattr(loader.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(e)  # as Lightning does each epoch
        out.append([b[0].tolist() for b in loader])
    getattr(loader, "close", lambda: None)()
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_each_rank_reads_what_lightnings_distributed_sampler_gives_torchs(as_rank, workers):
    for rank in (0, 1):
        as_rank(rank)
        want = _epochs(torch.utils.data.DataLoader(
            DATA, batch_size=4, sampler=DistributedSampler(DATA, 2, rank, shuffle=True, seed=0),
        ))  # fmt: skip
        ours = DataLoader(DATA, batch_size=4, shuffle=True, num_workers=workers)
        with pytest.warns(UserWarning, match=rf"rank {rank} of 2\): reads this rank's share"):
            assert len(ours) == 4  # 15 samples of 30, batches of 4
        assert isinstance(ours.sampler, DistributedSampler)
        assert_same(_epochs(ours), want)
        assert want[0] != want[1]  # set_epoch reshuffles


def test_distributed_false_reads_everything_and_true_needs_a_process_group(as_rank):
    as_rank(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _epochs(DataLoader(DATA, batch_size=5, distributed=False), n=1)
        assert got == [[list(range(i, i + 5)) for i in range(0, 30, 5)]]
        ours = DataLoader(DATA, batch_size=5, distributed=True)  # no warning either
        assert len(ours) == 3
    as_rank(None)
    with pytest.raises(RuntimeError, match=r"distributed=True\): torch.distributed must be"):
        iter(DataLoader(DATA, batch_size=5, distributed=True))
    with pytest.raises(ValueError, match="distributed must be None, True or False"):
        DataLoader(DATA, distributed="yes")


class Evens(Sampler):
    def __iter__(self):
        return iter(range(0, 30, 2))

    def __len__(self):
        return 15


def test_a_sampler_of_the_users_is_shared_between_ranks(as_rank):
    seen = []
    for rank in (0, 1):
        as_rank(rank)
        with pytest.warns(UserWarning, match="SamplerShare"):
            seen.append(_epochs(DataLoader(DATA, batch_size=4, sampler=Evens()), n=1)[0])
    flat = [[i for b in s for i in b] for s in seen]
    assert len(flat[0]) == len(flat[1]) == 8  # 15 indices, one repeated to even the shares
    assert set(flat[0]) | set(flat[1]) == set(range(0, 30, 2))


def test_a_distributed_sampler_given_stands_and_a_batch_sampler_is_warned_of(as_rank):
    as_rank(1)
    given = DistributedSampler(DATA, 2, 1, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = DataLoader(DATA, batch_size=5, sampler=given)
        assert ours.sampler is given and len(ours) == 3
    batches = [[0, 1], [2, 3, 4]]
    with pytest.warns(UserWarning, match="every rank reads the whole dataset"):
        got = _epochs(DataLoader(DATA, batch_sampler=batches), n=1)
    assert got == [batches]


def test_a_state_saved_on_a_rank_loads_into_a_new_loader_before_its_first_len(as_rank):
    """Lightning loads a loader's state before asking its length: the share is taken then
    too, so the state (it names the sampler) loads, and the epoch resumes where it stopped."""
    as_rank(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = DataLoader(DATA, batch_size=4, shuffle=True, num_workers=2)
        it = iter(ours)
        first = [next(it)[0].tolist() for _ in range(2)]
        state = ours.state_dict()
        rest = [b[0].tolist() for b in it]
        ours.close()
        again = DataLoader(DATA, batch_size=4, shuffle=True, num_workers=2)
        again.load_state_dict(state)
        assert [b[0].tolist() for b in again] == rest
        again.close()
    assert len(first) + len(rest) == 4
