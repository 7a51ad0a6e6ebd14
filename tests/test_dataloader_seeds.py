"""What "the same batches" means when ``__getitem__`` draws random numbers."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from torchtune_pipe import DataLoader

from ._compare import assert_same


class Noisy(Dataset):
    """A random augmentation: draws from torch, numpy and random for every sample."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {
            "i": i,
            "torch": torch.rand(2),
            "numpy": np.random.rand(2),
            "random": random.random(),
        }


class Seeds(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        info = get_worker_info()
        return (info.id, info.seed)


def _batches(cls, workers, seed=3, **kw):
    g = torch.Generator().manual_seed(seed)
    with DataLoader(cls(), batch_size=4, shuffle=True, generator=g, num_workers=workers, **kw) as d:
        return list(d)


def _torch(cls, workers, seed=3):
    g = torch.Generator().manual_seed(seed)
    return list(
        torch.utils.data.DataLoader(
            cls(), batch_size=4, shuffle=True, generator=g, num_workers=workers
        )
    )


def test_random_draws_do_not_depend_on_the_worker_count():
    """Default: each batch is seeded from the epoch's base seed and its position."""
    one = _batches(Noisy, 1)
    for workers in (2, "auto"):
        got = _batches(Noisy, workers)
        for a, b in zip(one, got, strict=True):
            assert_same(a, b)
    assert not torch.equal(one[0]["torch"], one[1]["torch"])  # batches draw different numbers


def test_the_first_batch_of_each_worker_draws_what_torchs_worker_draws():
    """Default: batch ``j`` is seeded as torch seeds its worker ``j`` (torch and random with
    ``base_seed + j``, numpy from ``_generate_state``), so with ``w`` workers the epoch's
    first ``w`` batches are torch's, numpy draws included."""
    want = _torch(Noisy, 2)
    got = _batches(Noisy, 2)
    for a, b in zip(want[:2], got[:2], strict=True):
        assert_same(a, b)
    assert not torch.equal(want[2]["torch"], got[2]["torch"])  # then each batch its own seed


def test_seeding_each_worker_once_is_torchs_seeding():
    """``seed_each_batch=False``: one stream per worker, seeded as torch seeds its workers, so
    a single worker draws exactly torch's numbers (torch, numpy and random)."""
    want = _torch(Noisy, 1)
    got = _batches(Noisy, 1, seed_each_batch=False)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("seed_each_batch", [True, False])
def test_worker_info_seed_is_torchs(seed_each_batch):
    """``get_worker_info().seed`` is ``base_seed + id``, the base seed torch draws."""
    want = {tuple(x.tolist()) for b in _torch(Seeds, 2) for x in torch.stack(b, 1)}
    got = {
        tuple(x.tolist())
        for b in _batches(Seeds, 2, seed_each_batch=seed_each_batch)
        for x in torch.stack(b, 1)
    }
    assert got <= want and len(want) == 2


def test_seeding_a_batch_is_torch_manual_seed_on_the_cpu(monkeypatch):
    """A batch's seed puts the three generators where ``random.seed``, ``np.random.seed`` and
    ``torch.manual_seed`` put them, and records no stack for accelerators this process never
    initialised (that cost a sixth of a worker's time per batch on cheap rows)."""
    import traceback

    from torchtune_pipe.sources.rng import rng_states, same_rng_states, seed_all

    seed = (1 << 40) + 12345
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    want = rng_states()
    random.seed(0)
    torch.manual_seed(0)
    np.random.seed(0)

    def no_stack(*a, **k):
        raise AssertionError("seed_all recorded a stack")

    monkeypatch.setattr(traceback, "format_stack", no_stack)
    seed_all(seed)
    assert same_rng_states(want, rng_states())


@pytest.mark.parametrize("caller_gauss", [False, True])
def test_an_inline_read_leaves_numpys_global_generator_exactly_as_it_was(caller_gauss):
    """``isolated_rng`` (around every unit read inline) puts numpy's global generator back
    exactly, the gaussian it held from an odd count of legacy normal draws included, whatever
    the read did: draw nothing, reseed, draw past a twister regeneration, leave a gaussian
    cached, or replace the bit generator."""
    from torchtune_pipe.sources.rng import isolated_rng

    def same(a, b):
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]

    reads = [
        lambda: None,
        lambda: np.random.seed(7),
        lambda: np.random.rand(1300),
        lambda: np.random.standard_normal(3),
        lambda: (np.random.seed(7), np.random.standard_normal()),
        lambda: np.random.set_bit_generator(np.random.MT19937(3)),
    ]
    bits = np.random.get_bit_generator()
    try:
        for i, read in enumerate(reads):
            np.random.seed(100 + i)
            np.random.rand(5)
            if caller_gauss:
                np.random.standard_normal()
            before = np.random.get_state()
            assert before[3] == int(caller_gauss)
            with isolated_rng():
                read()
            assert same(before, np.random.get_state()), f"read {i}"
            copy = np.random.RandomState()
            copy.set_state(before)
            assert np.random.standard_normal(4).tolist() == copy.standard_normal(4).tolist()
    finally:
        np.random.set_bit_generator(bits)


def test_a_persistent_loaders_later_epoch_resumes_with_its_order_and_draws():
    """With persistent workers the base seed is drawn at the first ``iter()`` only (as torch
    draws it) and read from a copy of the generator later: a state saved in the second epoch
    says so, and a new loader resumes it with the order and draws of the uninterrupted run."""

    def loader():
        return DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=True)  # fmt: skip

    torch.manual_seed(5)
    with loader() as a:
        list(a)
        it = iter(a)
        head = [next(it) for _ in range(3)]
        state = a.state_dict()
        want = list(it)
    assert state["units_state"]["drew_seed"] is False
    with loader() as b:
        b.load_state_dict(state)
        got = list(b)
    assert_same(want, got)
    assert len(head) + len(got) == 10


_INIT_SEED: dict = {}


def _record_initial_seed(worker_id):
    _INIT_SEED["seed"] = torch.initial_seed()  # torch's documented seed_worker recipe reads it


class InitSeeds(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = get_worker_info()
        return info.id, info.seed, _INIT_SEED.get("seed", -1)


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_worker_seeds_of_every_epoch_are_torchs(persistent):
    """``get_worker_info().seed`` and ``torch.initial_seed()`` in ``worker_init_fn`` are
    ``base_seed + id`` with each epoch's base seed, as torch's iterator draws it (once, with
    persistent workers), in every epoch."""

    def run(loader_cls):
        torch.manual_seed(0)
        loader = loader_cls(InitSeeds(), batch_size=2, num_workers=2,
                            worker_init_fn=_record_initial_seed, persistent_workers=persistent)  # fmt: skip
        out = [
            sorted({tuple(int(v) for v in row) for b in loader for row in zip(*b, strict=True)})
            for _ in range(2)
        ]
        getattr(loader, "close", lambda: None)()
        return out

    want, got = run(torch.utils.data.DataLoader), run(DataLoader)
    # Which of our workers reads which batch depends on which is free: each one's is torch's.
    assert all(got[e] and set(got[e]) <= set(want[e]) for e in range(2))
    assert all(seed == init for epoch in got for _, seed, init in epoch)
    bases = [{seed - i for i, seed, _ in epoch} for epoch in got]
    assert (bases[0] == bases[1]) == persistent  # fresh workers: a new base seed each epoch


class OwnGenerators(Dataset):
    """An augmentation drawing from generators the dataset holds, as users seed them in
    ``__init__``; reads take a little longer on some workers than on others."""

    def __init__(self, seed=0):
        self.np_rng = np.random.default_rng(seed)
        self.py_rng = random.Random(seed)
        self.torch_rng = torch.Generator().manual_seed(seed)

    def __len__(self):
        return 48

    def __getitem__(self, i):
        import time

        info = get_worker_info()
        time.sleep(0.002 * (info.id if info is not None else 0))  # workers finish out of turn
        return {
            "i": i,
            "numpy": float(self.np_rng.random()),
            "random": self.py_rng.random(),
            "torch": torch.rand(1, generator=self.torch_rng),
        }


def _own(workers, seed=0, epochs=1, **kw):
    ds = OwnGenerators(seed)
    with DataLoader(ds, batch_size=4, num_workers=workers, **kw) as d:
        out = [list(d) for _ in range(epochs)]
    return out, ds


def test_a_datasets_own_generators_draw_the_same_batches_run_to_run():
    """Torch's workers each go on from the dataset's generators as they were at ``iter()``
    through a fixed share of the batches: its batches are the same run to run. Ours take
    batches as they free up: each batch draws from the dataset's generators set from their
    state at ``iter()`` and its place in the epoch, whatever reads it."""
    want, _ = _own(1)
    for workers, kw in ((2, {}), (2, {}), (3, {}), ("auto", {}), (2, {"worker_method": "thread"})):
        got, _ = _own(workers, **kw)
        assert_same(want, got)
    draws = [b["numpy"].tolist() for b in want[0]]
    assert len({tuple(d) for d in draws}) == len(draws)  # every batch draws its own numbers
    other, _ = _own(2, seed=1)
    assert not torch.equal(other[0][0]["torch"], want[0][0]["torch"])  # the user's seed decides


def test_a_datasets_own_generators_draw_anew_each_epoch_and_the_callers_are_untouched():
    """Each epoch draws other numbers; the caller's generators are never drawn from (the
    reads of workers and of the readers standing in for them draw from copies)."""
    (first, second), ds = _own("auto", epochs=2)
    assert not torch.equal(first[0]["torch"], second[0]["torch"])
    fresh = OwnGenerators(0)
    assert ds.np_rng.random() == fresh.np_rng.random()
    assert ds.py_rng.random() == fresh.py_rng.random()
    assert torch.equal(ds.torch_rng.get_state(), fresh.torch_rng.get_state())


def test_a_datasets_own_generators_resume_with_the_uninterrupted_draws():
    """A state saved mid-epoch and loaded into a new loader goes on with the draws of the
    uninterrupted run."""
    want, _ = _own(2)
    with DataLoader(OwnGenerators(), batch_size=4, num_workers=2) as a:
        it = iter(a)
        head = [next(it) for _ in range(5)]
        state = a.state_dict()
    with DataLoader(OwnGenerators(), batch_size=4, num_workers=2) as b:
        b.load_state_dict(state)
        rest = list(b)
    assert_same(want[0], head + rest)


class _Uncopyable(random.Random):
    def __reduce_ex__(self, protocol):
        raise TypeError("this generator does not copy")


class UncopyableGenerator(Dataset):
    def __init__(self):
        self.rng = _Uncopyable(0)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i


def test_a_generator_that_will_not_copy_is_left_as_it_is():
    """A generator the views cannot copy, nor a digest read, is shared and left unseeded:
    the reads go on."""
    got, _ = _own_of(UncopyableGenerator, "auto")
    assert [int(x) for b in got for x in b] == list(range(8))


def _own_of(cls, workers):
    ds = cls()
    with DataLoader(ds, batch_size=4, num_workers=workers) as d:
        return list(d), ds


class Jitter:
    """An augmentation with a generator of its own, as the dataset's ``transform``."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def __call__(self, x):
        return x + float(self.rng.random())


class Augmented(Dataset):
    def __init__(self, seed=0):
        self.transform = Jitter(seed)

    def __len__(self):
        return 32

    def __getitem__(self, i):
        import time

        info = get_worker_info()
        time.sleep(0.002 * (info.id if info is not None else 0))
        return self.transform(float(i))


def test_a_generator_held_by_the_datasets_transform_draws_the_same_batches_run_to_run():
    """A generator one object further down (a transform's) is seeded per batch too, and the
    caller's transform keeps its own generator where it was."""
    want, _ = _own_of(Augmented, 1)
    for workers in (2, 3, "auto"):
        got, ds = _own_of(Augmented, workers)
        assert_same(want, got)
    assert ds.transform.rng.random() == Augmented().transform.rng.random()
