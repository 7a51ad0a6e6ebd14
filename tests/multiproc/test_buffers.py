"""Large arrays of a stage's pickle shared by its workers (multiproc/buffers.py)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from multiproc import Executor, ExecutorSpec, StageSpec, arena, buffers

from . import _fns


def _run(fn, n=4):
    spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range), StageSpec("m", "map", fn)))
    with Executor(spec) as ex:
        name = ex._buffers.name
        assert os.path.exists(os.path.join(arena.SHM_DIR, name))
        out = list(ex.run([(0, n)]))
    assert not os.path.exists(os.path.join(arena.SHM_DIR, name))  # removed with the executor
    return out


def test_workers_see_the_consumers_views_with_their_sharing_and_write_only_their_own_copy():
    fn = _fns.Views()
    out = _run(fn)
    # Every item of a worker after its first write sees it; values otherwise the consumer's.
    expected = (-1.0, 26.0, 1000.0, 5 * 512 + 3, False, 3 * 512 + 5, True, 14, 9, True)
    assert set(out) == {expected}
    assert float(fn.base[1]) == 1.0  # the consumer's tensor is untouched


def test_a_worker_maps_a_large_array_instead_of_holding_a_copy():
    # Bytes travel in the pickle (a private copy per worker); an array is mapped, shared.
    assert set(_run(_fns.BigBuffers(48, array=True))) == {0}


def test_small_arrays_grad_tensors_and_object_arrays_stay_in_the_pickle():
    out = buffers.BufferFile(f"ttp_{os.getpid()}_test_{os.urandom(3).hex()}")
    try:
        kept = [
            np.zeros(1000),
            torch.zeros(1 << 20, requires_grad=True),
            np.array([object()] * (1 << 18), dtype=object),
        ]
        out.dumps(kept)
        assert not out.created
        big = np.ones(1 << 18)  # 2 MiB
        out.dumps([big, big[:10], big])
        assert out.created and out.size >= big.nbytes
    finally:
        out.close()
        if out.created:
            arena.remove_segment(out.name)


def test_values_are_a_snapshot_taken_when_the_stage_was_pickled():
    fn = _fns.Views()
    spec = ExecutorSpec((StageSpec("read", "source", _fns.read_range), StageSpec("m", "map", fn)))
    with Executor(spec) as ex:
        fn.base[1] = 123.0  # after the executor pickled the stage
        out = list(ex.run([(0, 2)]))
    assert {o[2] for o in out} == {1000.0}
    assert {o[0] for o in out} == {-1.0}


def test_the_executor_removes_the_file_when_a_stage_fails_to_pickle():
    before = set(os.listdir(arena.SHM_DIR))

    class Holder:
        def __init__(self):
            self.big = np.ones(1 << 18)
            self.lock = __import__("threading").Lock()  # does not pickle

        def __call__(self, x):
            return x

    spec = ExecutorSpec(
        (StageSpec("read", "source", _fns.read_range), StageSpec("m", "map", Holder()))
    )
    with pytest.raises(Exception, match="'m'.*pickle"):
        Executor(spec)
    left = {n for n in os.listdir(arena.SHM_DIR) if n.endswith("_pickled")} - before
    assert not left, left


def test_without_room_in_dev_shm_arrays_travel_in_the_pickle(monkeypatch):
    monkeypatch.setattr(buffers, "_room_for", lambda nbytes: False)
    out = buffers.BufferFile(f"ttp_{os.getpid()}_test_{os.urandom(3).hex()}")
    big = np.arange(1 << 18, dtype=np.float64)
    data = out.dumps(big)
    out.close()
    assert not out.created and len(data) > big.nbytes
    assert np.array_equal(pickle.loads(data), big)


def test_a_light_pickle_names_the_same_modules_without_the_arrays_data():
    from multiproc.spec import imported_modules

    fn = _fns.BigBuffers(8, array=True)
    light = buffers.dumps_light(fn)
    assert len(light) < 1 << 16  # not the 8 MiB
    assert set(imported_modules(light)) >= {"tests.multiproc._fns", "numpy"}
    assert not any(n.startswith("ttp_unwritten") for n in os.listdir(arena.SHM_DIR))


def test_without_a_dev_shm_to_write_to_arrays_travel_in_the_pickle(tmp_path):
    out = buffers.BufferFile("ttp_nowhere")
    out.path = str(tmp_path / "missing" / "ttp_nowhere")  # its directory does not exist
    big = torch.arange(1 << 18, dtype=torch.float64)
    data = out.dumps([big, big[10:]])
    out.close()
    back = pickle.loads(data)
    assert not out.created and torch.equal(back[0], big) and torch.equal(back[1], big[10:])
