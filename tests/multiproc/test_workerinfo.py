"""``multiproc.workerinfo``: a worker info set in one thread (or one read) never shows in
another, and none outlives its block, while other threads collate and read beside it."""

from __future__ import annotations

import contextvars
import threading

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils import worker as torch_worker

from multiproc import serialize, workerinfo


def _info(i: int):
    return torch_worker.WorkerInfo(id=i, num_workers=2, seed=i, dataset=None)


def test_a_collate_on_another_thread_never_hides_this_threads_info():
    """The private-memory collate reads no worker info for its call, in its own thread only:
    a read here (a fast start beside thread workers) keeps seeing its own, every time."""
    stop = threading.Event()
    rows = [torch.ones(3), torch.zeros(3)]
    stacked: list[bool] = []

    def collate_in_a_loop() -> None:
        with workerinfo.info_set(_info(1)):  # a thread worker's own info
            while not stop.is_set():
                out = serialize._stack_in_private_memory(rows)
                stacked.append(not out.is_shared() and get_worker_info().id == 1)

    t = threading.Thread(target=collate_in_a_loop)
    seen = set()
    with workerinfo.info_set(_info(0)):
        t.start()
        try:
            while len(stacked) < 2000:
                seen.add(get_worker_info().id)
        finally:
            stop.set()
            t.join()
    assert seen == {0} and all(stacked)
    assert get_worker_info() is None and torch_worker._worker_info is None


def test_a_read_sees_its_info_at_each_step_and_its_caller_never_does():
    var = contextvars.ContextVar("the dataset's own", default="unset")
    seen = []

    def shard():
        var.set("set by the shard")
        for i in range(3):
            seen.append((get_worker_info().id, var.get()))
            yield i

    got = []
    for x in workerinfo.read_with_info(_info(1), shard()):
        got.append((x, get_worker_info(), var.get()))  # the caller, between items
    assert got == [(0, None, "unset"), (1, None, "unset"), (2, None, "unset")]
    assert seen == [(1, "set by the shard")] * 3


def test_none_for_a_read_wins_over_the_module_global(monkeypatch):
    """A worker process's init sets the module global; the only shard of an iterable dataset
    reads None there, as torch's in-process loader gives."""
    monkeypatch.setattr(torch_worker, "_worker_info", _info(0))

    def shard():
        yield get_worker_info()

    assert list(workerinfo.read_with_info(None, shard())) == [None]
    assert get_worker_info().id == 0


def test_closing_a_read_early_closes_its_iterator_in_the_reads_context():
    closed = []

    def shard():
        try:
            yield 1
            yield 2
        finally:
            closed.append(get_worker_info().id)

    it = workerinfo.read_with_info(_info(1), shard())
    assert next(it) == 1
    it.close()
    assert closed == [1] and get_worker_info() is None
