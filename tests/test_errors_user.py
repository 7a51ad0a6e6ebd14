"""What a user sees when their code fails: the traceback names their file and line, the note
names the stage, the batch and the sample, wherever the batch was read; arguments are checked
with the value echoed; a tuner adds nothing to the user's error."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest
import torch

from torchtune_pipe import DataLoader, Pipeline
from torchtune_pipe.sources.map_dataset import IndexUnit, PackedEntries
from torchtune_pipe.tuning import HeuristicTuner, TuningLoop

from . import _subproc

DEADLINE_S = 30.0


class _FailsAt(torch.utils.data.Dataset):
    """``__getitem__(bad)`` raises."""

    def __init__(self, n: int, bad: int = -1):
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise KeyError(f"bad sample {i}")
        return i


_SCRIPT = """\
import torch
from torchtune_pipe import DataLoader


class Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        raise KeyError(f"bad sample {i}")  # the line the traceback must show


if __name__ == "__main__":
    # seed_each_batch=False: no batch is read in this process while the workers start.
    with DataLoader(Broken(), batch_size=4, num_workers=2, seed_each_batch=False) as loader:
        next(iter(loader))
"""


def test_a_worker_traceback_names_the_scripts_file_and_line(tmp_path):
    """As torch's: a dataset class of the script (``__main__``, pickled by value) raising in
    a worker shows ``File "<script>", line N`` and the line, not ``<dynamic-code>``."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    r = _subproc.run(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert r.returncode != 0 and "KeyError: 'bad sample" in r.stderr, r.stderr[-3000:]
    assert f'File "{script}", line 10, in __getitem__' in r.stderr, r.stderr[-3000:]
    assert "# the line the traceback must show" in r.stderr
    assert "<dynamic-code>" not in r.stderr
    assert "raised in stage 'fetch', worker" in r.stderr


def _notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


def test_a_workers_error_note_names_the_stage_the_batch_and_the_sample():
    # seed_each_batch=False: every batch is read by a worker (no fast start).
    with (
        DataLoader(
            _FailsAt(400, bad=37), batch_size=4, num_workers=2, seed_each_batch=False
        ) as loader,
        pytest.raises(KeyError) as e,
    ):
        list(loader)
    notes = _notes(e.value)
    assert "dataset[37] raised it: batch 9 of the epoch, samples [36, 37, 38, 39]" in notes
    assert "raised in stage 'fetch', worker" in notes
    # The work unit whole, not cut in the middle: its position and its samples.
    assert "work unit Work(pos=9, unit=IndexUnit(id=9, entries=[[36, 37, 38, 39]]))" in notes


@pytest.mark.parametrize("getitems", [False, True])
def test_a_batch_read_in_this_process_gets_the_note_too(getitems):
    ds = _FailsAt(100, bad=37)
    if getitems:
        ds.__getitems__ = lambda idx: [ds[i] for i in idx]
    with DataLoader(ds, batch_size=4, num_workers=0) as loader, pytest.raises(KeyError) as e:
        list(loader)
    notes = _notes(e.value)
    read = "dataset.__getitems__()" if getitems else "dataset[37]"
    assert f"{read} raised it: batch 9 of the epoch, samples [36, 37, 38, 39]" in notes
    assert "raised in stage 'fetch', in the calling process" in notes
    assert "Work(pos=9, unit=IndexUnit(id=9, entries=[[36, 37, 38, 39]])), item 0" in notes


def _fail_on_13(x: int) -> int:
    if x == 13:
        raise ValueError("thirteen")
    return x


def test_a_map_stage_read_in_this_process_names_the_stage_and_the_item():
    pipe = Pipeline.from_source(list(range(40))).map(_fail_on_13, name="udf")
    with pipe.loader(inline=True) as loader, pytest.raises(ValueError) as e:
        list(loader)
    notes = _notes(e.value)
    assert "raised in stage 'udf', in the calling process" in notes
    assert "item 13 of work unit 0" in notes


def test_a_large_units_repr_is_bounded_and_whole():
    unit = IndexUnit(7, PackedEntries.pack([list(range(1792, 2048))], batched=True), seed=1)
    assert repr(unit) == "IndexUnit(id=7, entries=[[1792, 1793, 1794, ..., 2047] (256)])"


@pytest.mark.parametrize("workers", [np.int64(2), np.int32(0), np.uint8(1)])
def test_num_workers_takes_any_integral(workers):
    """As torch's DataLoader does (``operator.index``)."""
    with DataLoader(_FailsAt(8), batch_size=4, num_workers=workers) as loader:
        assert loader.num_workers == int(workers) and type(loader.num_workers) is int
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("workers", ["auto ", "Auto", 2.0, None])
def test_num_workers_neither_int_nor_auto_is_echoed(workers):
    with pytest.raises(ValueError, match=re.escape(f"or 'auto', got {workers!r}")):
        DataLoader(_FailsAt(8), num_workers=workers)


def test_negative_num_workers_is_echoed():
    with pytest.raises(ValueError, match="non-negative .*got -1; use num_workers=0"):
        DataLoader(_FailsAt(8), num_workers=np.int64(-1))


def _plus_one(x: int) -> int:
    return x + 1


def test_a_tuning_loop_ends_quietly_when_its_pipeline_is_closed_under_it(caplog):
    """An error or Ctrl-C ends the epoch and closes the executor under the tuning loop: the
    user's error is the only one reported, not an ExecutorClosedError from the loop."""
    pipe = Pipeline.from_source(list(range(100_000)), workers=1).map(_plus_one)
    with pipe.loader() as loader:
        it = iter(loader)
        next(it)
        loop = TuningLoop(loader.tunable, HeuristicTuner(), interval_s=0.01).start()
        deadline = time.monotonic() + DEADLINE_S
        while loop.steps < 2:
            assert time.monotonic() < deadline, "the loop never stepped"
            time.sleep(0.01)  # polling with a deadline: a step has no event to wait on
        with caplog.at_level(logging.ERROR):
            loader.tunable.executor.close()  # what an error in the epoch does
            while loop.running:
                assert time.monotonic() < deadline, "the loop outlived its pipeline"
                time.sleep(0.01)
            loop.stop()  # raises nothing: nothing of the loop's own failed
        assert loop.error is None and not caplog.records, caplog.text
        it.close()
