"""Frames bigger than a worker's budget travel in segments of their own (``multiproc.spill``):
written once, mapped by the consumer, unlinked once released, and never left behind."""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
import time

import numpy as np
import pytest
import torch

from multiproc import Executor, ExecutorSpec, StageSpec, arena, shm, spill
from multiproc.errors import ExecutorClosedError

from . import _fns

N = 24
ITEM_FLOATS = (1 << 20) // 4  # a 1 MiB tensor, and a 1 MiB array: 2 MiB items
BUDGET = 1 << 20  # split over two workers: every frame is bigger than a worker's share


def big(i: int) -> dict:
    return {
        "id": i,
        "t": torch.full((ITEM_FLOATS,), float(i)),
        "a": np.full(ITEM_FLOATS, i, dtype=np.int32),
    }


def assert_intact(x: dict, i: int) -> None:
    assert x["id"] == i
    assert x["t"].shape == (ITEM_FLOATS,) and float(x["t"][0]) == float(x["t"][-1]) == i
    assert x["a"].dtype == np.int32 and int(x["a"][0]) == int(x["a"][-1]) == i


class DieOnceHolding:
    """The identity, but the worker kills itself (SIGKILL) on item ``at``, once (a marker file
    records it): it dies holding a spilled frame, which is delivered again."""

    def __init__(self, marker: str, at: int):
        self.marker, self.at = marker, at

    def __call__(self, x: dict) -> dict:
        if x["id"] == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return x


class OrphanThenDie:
    """``big``, but on item ``at``, once, the worker writes a segment named as its next spill
    would be and dies before sending it (SIGKILL)."""

    def __init__(self, marker: str, at: int):
        self.marker, self.at = marker, at

    def __call__(self, i: int) -> dict:
        if i == self.at and not os.path.exists(self.marker):
            with open("/proc/self/maps") as f:
                own = {m for m in re.findall(r"/(ttp_\S+_w\d+)$", f.read(), re.M)}
            assert len(own) == 1, own  # its own arena: its source's frames travel inline
            name = spill.name(own.pop(), 999)
            with open(arena.segment_path(name), "wb") as f:
                f.write(b"x" * 4096)
            with open(self.marker, "w") as f:
                f.write(name)
            os.kill(os.getpid(), signal.SIGKILL)
        return big(i)


def spec(fn=big, then=_fns.identity, worker_type: str = "process") -> ExecutorSpec:
    return ExecutorSpec(
        (
            StageSpec("read", "source", _fns.read_range, frame_items=1, worker_type=worker_type),
            StageSpec("big", "map", fn, workers=2, buffer_bytes=BUDGET, worker_type=worker_type),
            StageSpec("then", "map", then, buffer_bytes=BUDGET, worker_type=worker_type),
        ),
        ordered=True,
        max_restarts=2,
    )


def spilled_to(ex: Executor) -> list[str]:
    """The executor's segments of one spilled frame each."""
    return [n for n in os.listdir(shm.directory()) if re.match(rf"ttp_{ex._tag}_w\d+_s\d+$", n)]


def wait_for(what, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return got


class Kinds(list):
    """Payload kinds the consumer decoded; ``in_workers``: those thread workers decoded."""

    def __init__(self) -> None:
        super().__init__()
        self.in_workers: list[str] = []


@pytest.fixture
def payload_kinds(monkeypatch):
    """What kind of payload each frame the consumer (this thread) decodes is: ``SpillRef``,
    ``ShmRef`` (an arena block), ``KeptSpillRef`` (objects a thread worker handed over, too
    big for its budget) or ``inline``."""
    kinds = Kinds()
    decode = arena.decode
    consumer = threading.current_thread()

    def recording(payload, *args):
        kind = payload[0] if payload[0] == "inline" else type(payload[1]).__name__
        if threading.current_thread() is consumer:
            kinds.append(kind)
        else:  # a thread worker
            kinds.in_workers.append(kind)
        return decode(payload, *args)

    monkeypatch.setattr(arena, "decode", recording)
    return kinds


def test_frames_bigger_than_the_budget_arrive_in_order_through_segments(payload_kinds):
    with Executor(spec()) as ex:
        for i, x in enumerate(ex.run([(0, N // 2), (N // 2, N)])):
            assert_intact(x, i)
            if i == 0:
                # Its tensors view the segment, mapped here: the bytes never crossed a pipe.
                with open("/proc/self/maps") as f:
                    assert re.search(rf"/dev/shm/ttp_{ex._tag}_w\d+_s\d+", f.read())
                x["t"] += 1  # the consumer's own memory: writable
            del x
        snap = ex.snapshot()
        assert snap.stage("big").spilled == snap.stage("then").spilled == N
        assert payload_kinds == ["SpillRef"] * N
        # Released, each segment is unlinked, while the executor runs on.
        wait_for(lambda: not spilled_to(ex) and not ex._state.spills)


def test_a_segment_goes_once_nothing_built_from_its_frame_is_alive():
    with Executor(spec()) as ex:
        kept = list(ex.run([(0, N)]))  # every frame held: each spills, one at a time
        names = wait_for(lambda: len(spilled_to(ex)) == N and spilled_to(ex))
        del kept[: N // 2]
        wait_for(lambda: len(spilled_to(ex)) == N // 2)
        assert set(spilled_to(ex)) < set(names)
        for i, x in enumerate(kept, N // 2):
            assert_intact(x, i)
    # A consumer that never lets go: its items outlive the executor, its segments do not.
    assert not spilled_to(ex)
    for i, x in enumerate(kept, N // 2):
        assert_intact(x, i)


def test_a_worker_dying_with_a_spilled_frame_loses_nothing_and_leaves_nothing(tmp_path):
    marker = str(tmp_path / "died")
    with Executor(spec(then=DieOnceHolding(marker, at=5))) as ex:
        for i, x in enumerate(ex.run([(0, N)])):
            assert_intact(x, i)
            del x
        assert os.path.exists(marker) and ex.snapshot().stage("then").restarts == 1
        wait_for(lambda: not spilled_to(ex))


def test_a_segment_a_dead_worker_never_sent_is_removed(tmp_path):
    marker = tmp_path / "orphan"
    with Executor(spec(fn=OrphanThenDie(str(marker), at=3))) as ex:
        for i, x in enumerate(ex.run([(0, N)])):
            assert_intact(x, i)
        orphan = marker.read_text()
        assert orphan.startswith(f"ttp_{ex._tag}_")
        # Gone once the router forgets the dead worker, before the executor closes.
        wait_for(lambda: not os.path.exists(arena.segment_path(orphan)))


def test_close_mid_epoch_leaves_no_segment():
    ex = Executor(spec())
    it = ex.run([(0, N)])
    held = [next(it), next(it)]
    wait_for(lambda: len(spilled_to(ex)) >= 2)
    ex.close()
    assert not [n for n in os.listdir(shm.directory()) if n.startswith(f"ttp_{ex._tag}_")]
    for i, x in enumerate(held):
        assert_intact(x, i)  # mapped still: only the names went
    with pytest.raises(ExecutorClosedError):
        next(it)


@pytest.mark.parametrize("why", ["no room to write", "little free"])
def test_without_room_for_a_segment_a_frame_travels_inline(monkeypatch, payload_kinds, why):
    """A directory that fails the write (ENOSPC: no SIGBUS, the write is not through a
    mapping), or whose free bytes a segment would take more than ``shm.SHARE`` of: the frame
    goes through the pipe, and no segment is left half-written."""

    def no_room(fd, chunks):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # Thread workers: they run this process's (patched) modules.
    with Executor(spec(worker_type="thread")) as ex:
        if why == "no room to write":
            monkeypatch.setattr(spill, "_write_all", no_room)
        else:
            monkeypatch.setattr(shm, "usage", lambda path: (64 << 20, 4 << 20))
        for i, x in enumerate(ex.run([(0, 8)])):
            assert_intact(x, i)
        assert ex.snapshot().stage("big").spilled == 8
        assert not spilled_to(ex)  # none half-written left (a write may be failing just now)
    assert payload_kinds.in_workers == ["inline"] * 16  # "read"'s (small) and "big"'s
    # "then"'s frames, for the consumer in their own process: handed over, never written.
    assert payload_kinds == ["KeptSpillRef"] * 8
