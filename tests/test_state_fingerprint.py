"""A saved DataLoader state loads only into a loader that yields the same samples: the
fingerprint names each field that decides an epoch's samples, and a state is plain data."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, SequentialSampler, SubsetRandomSampler

from torchtune_pipe import DataLoader
from torchtune_pipe.errors import StateError

BATCH = 10


class Numbers(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class OtherNumbers(Numbers):
    pass


def _loader(n: int = 1000, seed: int | None = 0, **kw) -> DataLoader:
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("shuffle", True)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return DataLoader(Numbers(n), num_workers=0, generator=generator, **kw)


def _batches(loader: DataLoader, k: int | None = None) -> list[list[int]]:
    out = []
    for b in loader:
        out.append(b.tolist() if isinstance(b, torch.Tensor) else b)
        if k is not None and len(out) == k:
            break
    return out


def _saved_mid_epoch(loader: DataLoader, k: int = 50) -> tuple[list, dict]:
    it = iter(loader)
    taken = [next(it).tolist() for _ in range(k)]
    return taken, loader.state_dict()


@pytest.mark.parametrize(
    ("changed", "field"),
    [
        ({"n": 995}, "len(dataset)"),  # the same number of batches: once accepted
        ({"shuffle": False}, "shuffle"),
        ({"n": 1005, "drop_last": True}, "len(dataset)"),
        ({"drop_last": True}, "drop_last"),
        ({"seed": None}, "generator"),
        ({"batch_size": 20}, "batch_size"),
    ],
)
def test_a_state_of_another_loader_is_refused_naming_the_field(changed, field):
    _, state = _saved_mid_epoch(_loader())
    n = changed.pop("n", 1000)
    with pytest.raises(StateError) as e:
        _loader(n, **changed).load_state_dict(state)
    assert "state['fingerprint'] differs in" in str(e.value) and f"{field}: saved" in str(e.value)


def test_samplers_and_dataset_types_are_part_of_the_fingerprint():
    def subset(indices):
        g = torch.Generator().manual_seed(0)
        return DataLoader(Numbers(100), batch_size=5, sampler=SubsetRandomSampler(indices, g))

    _, state = _saved_mid_epoch(subset(range(0, 100, 2)), k=3)
    subset(range(0, 100, 2)).load_state_dict(state)  # the same indices: accepted
    with pytest.raises(StateError, match=r"differs in sampler: saved .*SubsetRandomSampler"):
        subset(range(1, 100, 2)).load_state_dict(state)  # as many other indices

    def batched(ds, size):
        return DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), size, False))

    _, state = _saved_mid_epoch(batched(Numbers(100), 4), k=3)
    with pytest.raises(StateError, match="differs in batch_size: saved 4, this loader's 5"):
        batched(Numbers(100), 5).load_state_dict(state)
    with pytest.raises(StateError, match=r"differs in dataset: saved '.*\.Numbers'"):
        batched(OtherNumbers(100), 4).load_state_dict(state)


def test_a_state_goes_through_json_and_resumes_exactly():
    whole = _batches(_loader()) + _batches(_loader_at_epoch(1))
    taken, state = _saved_mid_epoch(_loader())
    text = json.dumps(state)
    resumed = _loader()
    resumed.load_state_dict(json.loads(text))
    assert taken + _batches(resumed) + _batches(resumed) == whole


def _loader_at_epoch(epoch: int) -> DataLoader:
    """A loader whose next epoch is ``epoch`` of an uninterrupted run of :func:`_loader`."""
    loader = _loader()
    for _ in range(epoch):
        _batches(loader)
    return loader


def test_a_state_saved_before_fields_were_named_still_loads():
    from torchtune_pipe.sources.rng import rng_state_from_text

    taken, state = _saved_mid_epoch(_loader())
    rest = _batches(_loader_then(state))
    # As Loader.state_dict() wrote it before: the digest as the fingerprint, tensor states.
    old = dict(state, fingerprint=state["fingerprint"]["digest"])
    old["units_state"] = {
        k: None if (v := state["units_state"][k]) is None else rng_state_from_text(v, k)
        for k in ("torch", "generator")
    }
    assert _batches(_loader_then(old)) == rest
    with pytest.raises(StateError, match=r"state\['fingerprint'\] is '0123456789abcdef'"):
        _loader().load_state_dict(dict(old, fingerprint="0123456789abcdef"))


def _loader_then(state: dict) -> DataLoader:
    loader = _loader()
    loader.load_state_dict(state)
    return loader


def test_another_generator_seed_resumes_the_saved_draws():
    whole = _batches(_loader_at_epoch(0)) + _batches(_loader_at_epoch(1))
    taken, state = _saved_mid_epoch(_loader())
    resumed = _loader(seed=7)  # the state replays the saved epoch's draws: nothing lost
    resumed.load_state_dict(state)
    assert taken + _batches(resumed) + _batches(resumed) == whole


def test_a_malformed_generator_state_is_refused_naming_it():
    _, state = _saved_mid_epoch(_loader())
    loader = _loader()
    loader.load_state_dict(dict(state, units_state={"torch": "not base64!", "generator": None}))
    with pytest.raises(StateError, match=r"state\['units_state'\]\['torch'\]"):
        next(iter(loader))


def test_a_malformed_iterable_seed_state_is_refused_naming_it():
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    loader = DataLoader(Stream(), batch_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert isinstance(state["units_state"]["seed"], int)
    fresh = DataLoader(Stream(), batch_size=2)
    fresh.load_state_dict(dict(state, units_state={"seed": "7"}))
    with pytest.raises(StateError, match=r"state\['units_state'\]\['seed'\]"):
        next(iter(fresh))
