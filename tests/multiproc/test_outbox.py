"""The router's side of a worker's pipe: multiproc/outbox.py and multiproc/poller.py."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time

from multiproc import Executor, ExecutorSpec, StageSpec
from multiproc.outbox import Outbox
from multiproc.poller import Poller, pipe_poller

from . import _fns


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


@contextlib.contextmanager
def _pipe(name: str):
    """An outbox on the router's end of a fresh pipe, and the worker's end; all closed after."""
    router, worker = mp.Pipe(duplex=True)
    box = Outbox(router, name)
    try:
        yield box, router, worker
    finally:
        box.close()
        router.close()
        worker.close()


def test_messages_go_straight_into_the_pipe_without_a_sender_thread():
    with _pipe("outbox-direct") as (box, _, worker):
        box.post(("a", 1))
        box.post(("b", 2), ("c", 3))  # several at once: one write
        assert box.thread is None and not _threads("outbox-direct")
        assert [worker.recv() for _ in range(3)] == [("a", 1), ("b", 2), ("c", 3)]


def test_a_full_pipe_never_blocks_the_poster_and_keeps_the_order():
    # A worker busy sending (not reading): the router's messages outgrow the pipe's buffer.
    router, worker = mp.Pipe(duplex=True)
    box = Outbox(router, "outbox-full")
    try:
        big = b"x" * 50_000
        t0 = time.monotonic()
        for i in range(40):  # ~2 MB: far over a socket pair's buffer
            box.post((i, big))
        assert time.monotonic() - t0 < 2.0  # nothing waited for the reader
        assert box.thread is not None  # what did not fit went to the sender thread
        got = [worker.recv() for _ in range(40)]
        assert [g[0] for g in got] == list(range(40)) and all(g[1] == big for g in got)
        # Once the queue is empty, messages go straight in again, still in order.
        deadline = time.monotonic() + 5
        while box._backlog and time.monotonic() < deadline:
            time.sleep(0.01)
        box.post(("after", 0))
        assert worker.recv() == ("after", 0)
    finally:
        box.close(timeout_s=2.0)
        assert box.thread is not None and not box.thread.is_alive()
        router.close()
        worker.close()


def test_a_message_past_the_short_header_uses_connections_long_one(monkeypatch):
    from multiproc import outbox

    monkeypatch.setattr(outbox, "_MAX", 10)  # as a message over 2 GiB would
    with _pipe("outbox-long") as (box, _, worker):
        box.post(("x" * 100, 1), ("y", 2))
        assert worker.recv() == ("x" * 100, 1) and worker.recv() == ("y", 2)


def test_posting_to_a_gone_worker_or_after_close_raises_nothing():
    router, worker = mp.Pipe(duplex=True)
    box = Outbox(router, "outbox-gone")
    worker.close()
    box.post(("to", "nobody"))  # the peer is gone: its EOF or sentinel tells the router
    box.close()
    box.post(("after", "close"))
    box.close()  # idempotent
    router.close()


def test_the_outbox_keeps_the_pipe_blocking_for_the_reader():
    with _pipe("outbox-blocking") as (_, router, worker):
        assert os.get_blocking(router.fileno())
        threading.Timer(0.2, worker.send, args=("late",)).start()
        assert router.recv() == "late"  # a blocking read, not BlockingIOError


def test_the_poller_reports_ready_objects_and_follows_a_changing_set():
    a_r, a_w = mp.Pipe(duplex=False)
    b_r, b_w = mp.Pipe(duplex=False)
    r, w = os.pipe()
    p = Poller()
    try:
        assert p.wait([a_r, b_r, r], 0.05) == []
        b_w.send("b")
        os.write(w, b"x")
        ready = p.wait([a_r, b_r, r], 1.0)
        assert len(ready) == 2 and b_r in ready and r in ready
        assert pipe_poller(b_r)() and not pipe_poller(a_r)()
        b_r.recv()
        os.read(r, 1)
        a_w.send("a")
        assert p.wait([a_r], 1.0) == [a_r]  # fewer descriptors than the last wait
        a_w.close()
        a_r.recv()
        assert p.wait([a_r], 1.0) == [a_r]  # hung up: ready, as multiprocessing's wait says
    finally:
        for c in (a_r, a_w, b_r, b_w):
            c.close()
        os.close(r)
        os.close(w)


def test_releasing_frames_while_workers_report_wakes_the_router_only_when_needed():
    # A release while a worker has work in flight waits for that worker's report; the last
    # ones of a run (nothing in flight) wake the router, so every block goes back.
    spec = ExecutorSpec(
        (StageSpec("read", "source", _fns.read_range), StageSpec("m", "map", _fns.big_tensor))
    )
    with Executor(spec) as ex:
        wakes = []
        real = ex._res.wake
        ex._res.wake = lambda: (wakes.append(1), real())[1]
        out = [x["payload"][0].item() for x in ex.run([(i, i + 1) for i in range(200)])]
        assert sorted(out) == [float(i) for i in range(200)]
        deadline = time.monotonic() + 5
        while ex._state.seg_bytes[1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex._state.seg_bytes[1] == 0  # every frame's block was freed
        assert not ex._state.sink_frees
        assert len(wakes) < 200  # not one wake per released frame
